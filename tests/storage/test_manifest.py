"""The manifest beside each shard: written at each flush, atomically, as the file then was;
`vartrace.open` lists a run from the manifests alone and reads what it reads without them;
stale and damaged manifests are ignored."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import vartrace
from tests._manifest_runs import assert_same_run, write_shard
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.manifest import MANIFEST_SUFFIX, manifest_path
from vartrace.storage.reader import RunFileError
from vartrace.trace import RunContext, Trace

WORLD = 3


def _manifest(shard: Path) -> dict[str, Any]:
    return json.loads(Path(manifest_path(str(shard))).read_text())


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    for rank in range(WORLD):
        write_shard(folder, rank, WORLD)
    return folder


@pytest.fixture
def without_manifests(run_dir: Path, tmp_path: Path) -> Path:
    """The same shards, no manifest beside them."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for shard in run_dir.glob("*.h5"):
        shutil.copy2(shard, bare / shard.name)
    return bare


@pytest.fixture
def h5_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The HDF5 files opened from now on (every reader opens them through `h5py.File`)."""
    opened: list[str] = []
    real = h5py.File.__init__

    def counted(self: h5py.File, name: Any, *args: Any, **kwargs: Any) -> None:
        opened.append(os.fspath(name) if isinstance(name, (str, os.PathLike)) else repr(name))
        real(self, name, *args, **kwargs)

    monkeypatch.setattr(h5py.File, "__init__", counted)
    yield opened


def test_each_flush_rewrites_the_manifest_as_the_file_then_was(tmp_path: Path) -> None:
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    saver.on_start(RunContext(rank=1, world_size=2, sharded=True))
    shard = tmp_path / "run.rank1.h5"
    for gather in range(3):
        saver("x", Trace([torch.full((2,), float(gather))] * 2, [gather + 1] * 2, [1, 1], [0, 1]))
        saver.flush()
        manifest = _manifest(shard)
        (site,) = manifest["sites"]
        assert site["records"] == 2 * (gather + 1) == manifest["records"]
        assert (site["first_iteration"], site["last_iteration"]) == (1, gather + 1)
        assert manifest["open"] is True and manifest["shard"] == [1, 2]
        assert manifest["pid"] == os.getpid() and manifest["format"] == 2
    saver.close()
    manifest = _manifest(shard)
    stat = shard.stat()
    assert manifest["open"] is False
    assert (manifest["size"], manifest["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
    site = manifest["sites"][0]
    assert (site["dtype"], site["shape"], site["bytes"]) == ("float32", [2], 6 * 2 * 4)
    with h5py.File(shard, "r") as handle:  # the committed counts of the file it describes
        assert int(handle["committed"][site["slot"]]) == site["records"]
        assert handle.attrs["run_id"] == manifest["run_id"]
    # Written atomically: the manifest and the file, no temporary left behind.
    assert sorted(os.listdir(tmp_path)) == ["run.rank1.h5", "run.rank1.h5" + MANIFEST_SUFFIX]


def test_files_of_their_own_get_no_manifest(tmp_path: Path) -> None:
    with H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver:
        saver("x", Trace([torch.ones(2)], [1], [0], [0]))
    assert os.listdir(tmp_path) == ["run.h5"]


def test_a_run_is_listed_from_its_manifests_without_opening_a_file(
    run_dir: Path, h5_opens: list[str]
) -> None:
    (run_dir / f"run.rank1.h5{MANIFEST_SUFFIX}").unlink()
    os.replace(run_dir / "run.rank1.h5", run_dir.parent / "elsewhere.h5")  # rank 1 missing
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) 1 of a 3-rank run are missing"):
        run = vartrace.open(run_dir)
    with run:
        assert run.missing_ranks == [1] and not run.live
        assert run.names[:2] == ["blocks.0.forward.x", "blocks.0.forward.x_alias"]
        assert run.names[-1] == "late.only_rank0" and len(run) == 8
        assert run.aliases == {"blocks.0.forward.x_alias": "blocks.0.forward.x"}
        assert len(run["blocks.0.forward.x"]) == 6 and len(run["late.only_rank0"]) == 1
        assert "step" in run and all(m is not None for m in run.manifests)
        assert h5_opens == []
        assert run["late.only_rank0"].ranks.tolist() == [0]  # tags read: rank 0's file only
        assert h5_opens == [str(run_dir / "run.rank0.h5")]


def test_a_run_read_from_manifests_reads_what_its_files_hold(
    run_dir: Path, without_manifests: Path
) -> None:
    with vartrace.open(run_dir) as run, vartrace.open(without_manifests) as files:
        assert all(m is not None for m in run.manifests)
        assert all(m is None for m in files.manifests)
        assert_same_run(run, files)


def test_a_manifest_of_an_older_file_is_ignored(tmp_path: Path) -> None:
    """A file rewritten, or appended to, after its manifest was written is opened instead."""
    shard = write_shard(tmp_path, 0, 1)
    older = Path(manifest_path(str(shard))).read_bytes()
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False, overwrite=True)
    saver.on_start(RunContext(rank=0, world_size=1, sharded=True))
    saver("other", Trace([torch.ones(3)], [1], [0], [0]))
    saver.close()
    Path(manifest_path(str(shard))).write_bytes(older)  # an older run's manifest left behind
    with vartrace.open(shard) as run:
        assert run.manifests == [None] and run.names == ["other"]
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False, append=True)
    saver.on_start(RunContext(rank=0, world_size=1, sharded=True))
    saver("other", Trace([torch.zeros(3)], [2], [0], [1]))
    saver.close()
    appended = _manifest(shard)
    assert appended["sites"][0]["records"] == 2 and appended["sites"][0]["last_iteration"] == 2
    Path(manifest_path(str(shard))).write_bytes(older)
    with vartrace.open(shard) as run:
        assert run.manifests == [None] and len(run["other"]) == 2


def test_a_file_that_no_longer_matches_its_manifest_is_an_error_once_read(
    tmp_path: Path,
) -> None:
    """A manifest that passes for its file (same size and time) but is not its file's: the
    file is checked when opened, and refused rather than read for other records."""
    shard = write_shard(tmp_path, 0, 1)
    manifest = _manifest(shard)
    manifest["run_id"] = "another run"
    Path(manifest_path(str(shard))).write_text(json.dumps(manifest))
    with vartrace.open(shard) as run:
        assert run.manifests[0] is not None
        with pytest.raises(RunFileError, match="no longer holds what its manifest"):
            _ = run["step"].iterations


def test_damaged_manifests_are_ignored_with_one_warning(
    run_dir: Path, without_manifests: Path
) -> None:
    manifests = sorted(run_dir.glob(f"*{MANIFEST_SUFFIX}"))
    manifests[0].write_text('{"vartrace_manifest": 1, "sites": [')
    broken = json.loads(manifests[1].read_text())
    broken["sites"][0]["records"] = "many"
    manifests[1].write_text(json.dumps(broken))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = vartrace.open(run_dir)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "ignoring a damaged manifest" in messages[0], messages
    assert "(and 1 more)" in messages[0]
    with run, vartrace.open(without_manifests) as files:
        assert [m is None for m in run.manifests] == [True, True, False]
        assert_same_run(run, files)


def test_a_manifest_that_cannot_be_written_is_a_warning_not_an_error(tmp_path: Path) -> None:
    (tmp_path / f"run.rank0.h5{MANIFEST_SUFFIX}").mkdir()  # os.replace cannot replace it
    with pytest.warns(RuntimeWarning, match="could not write the manifest") as caught:
        shard = write_shard(tmp_path, 0, 1)
    assert len([w for w in caught if "manifest" in str(w.message)]) == 1  # once, not a flush
    with vartrace.open(shard) as run:
        assert run.manifests == [None]
        assert run["step"].iterations.tolist() == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["run.rank0.h5", f"run.rank0.h5{MANIFEST_SUFFIX}"]


def test_ragged_records_read_through_manifests(run_dir: Path) -> None:
    with vartrace.open(run_dir / "run.rank*.h5") as run:
        site = run["blocks.0.forward.ragged"]
        assert site.shapes[:, 0].tolist() == [1, 2, 3, 2, 3, 4, 3, 4, 5]
        value = site.get(3, rank=2)
    np.testing.assert_array_equal(value.numpy(), np.arange(5.0, dtype=np.float32))


def test_the_shards_benchmark_prints_its_table() -> None:
    """`tools/bench_shards.py` writes its shards, reads them with and without manifests and
    prints a row per step (a smoke test of the benchmark: its figures are the README's)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_shards.py"
    done = subprocess.run(
        [sys.executable, str(tool), "--shards", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0] for line in done.stdout.splitlines()[2:]}
    assert rows == {"open", "names", "open+names", "to_frame", "close", "total"}, done.stdout
