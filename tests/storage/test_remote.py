"""Runs read through fsspec: shards copied into fsspec's in-memory filesystem (`memory://`,
one per process) open, list and read as the same files on disk do, with their manifests
or without, and `vartrace ls` / `show` take their URLs."""

from __future__ import annotations

import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import vartrace
from tests._manifest_runs import assert_same_run, write_shard
from vartrace.cli import main
from vartrace.storage.manifest import MANIFEST_SUFFIX

fsspec = pytest.importorskip("fsspec")

WORLD = 3


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """Ranks 0 and 2 of a 3-rank run, with their manifests."""
    for rank in (0, 2):
        write_shard(tmp_path, rank, WORLD)
    return tmp_path


@pytest.fixture
def root() -> Iterator[str]:
    """A folder of its own in the process's memory filesystem, removed afterwards."""
    fs = fsspec.filesystem("memory")
    folder = f"/vartrace-test-{uuid.uuid4().hex}"
    yield folder
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def _upload(shards: Path, folder: str, *, manifests: bool = True) -> str:
    fs = fsspec.filesystem("memory")
    for path in sorted(shards.iterdir()):
        if manifests or not path.name.endswith(MANIFEST_SUFFIX):
            fs.pipe(f"{folder}/{path.name}", path.read_bytes())
    return f"memory://{folder}"


def _open(spec: object, **options: object) -> vartrace.Run:
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) 1 of a 3-rank run are missing"):
        return vartrace.open(spec, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("manifests", [True, False])
def test_a_run_in_memory_reads_as_on_disk(shards: Path, root: str, manifests: bool) -> None:
    url = _upload(shards, root, manifests=manifests)
    expected = [f"memory://{root}/run.rank0.h5", f"memory://{root}/run.rank2.h5"]
    with _open(shards) as local:
        for spec in (url, f"{url}/", f"{url}/run.rank*.h5", expected, [f"{url}/*.h5"]):
            with _open(spec, storage_options={}) as run:
                assert run.paths == expected, spec
                assert [m is not None for m in run.manifests] == [manifests] * 2
                assert run.storage_options == {}
                assert_same_run(run, local)


def test_a_missing_url_is_an_error_naming_it(root: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such run file.*run\.rank0\.h5"):
        vartrace.open(f"memory://{root}/run.rank0.h5")
    with pytest.raises(FileNotFoundError, match="no run file matches"):
        vartrace.open(f"memory://{root}/run.rank*.h5")


def test_ls_and_show_take_urls(shards: Path, root: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = _upload(shards, root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["ls", f"{url}/run.rank*.h5"]) == 0
        listed, err = capsys.readouterr()
        assert main(["show", url, "step"]) == 0
        shown, _ = capsys.readouterr()
        assert main(["ls", f"memory://{root}/nothing.h5"]) == 2
        _, missing = capsys.readouterr()
    assert "blocks.1.forward.label" in listed and "late.only_rank0" in listed
    assert "rank(s) 1 of a 3-rank run are missing" in err
    assert "step: 6 records" in shown and "302" in shown  # iteration 3, rank 2
    assert "nothing.h5" in missing and "error" in missing


_WRITER = """
import sys, time
from pathlib import Path
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import RunContext, Trace
saver = H5PYSaverCallback(Path(sys.argv[1]) / "run.h5", metadata=False)
saver.on_start(RunContext(rank=0, world_size=2, sharded=True))
for step in range(1, 4):
    saver("x", Trace([torch.full((8,), float(step))], [step], [0], [step]))
    saver.flush()
print("flushed", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("manifests", [True, False])
def test_a_running_writers_shard_read_remotely_is_live_until_the_writer_is_killed(
    tmp_path: Path, root: str, manifests: bool
) -> None:
    """A copy of a running writer's shard (its superblock says it is open for writing) is
    live while its writer runs, before and after its file is opened, and no longer once
    the writer is killed; `memory://name` finds the manifests as `memory:///name` does."""
    script, out = tmp_path / "writer.py", tmp_path / "out"
    script.write_text(_WRITER)
    out.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "flushed\n"
        url = _upload(out, root.lstrip("/"), manifests=manifests) + "/run.rank0.h5"
        with pytest.warns(RuntimeWarning, match=r"rank\(s\) 1 of a 2-rank run are missing"):
            run = vartrace.open(url)
        with run:
            assert (run.manifests[0] is not None) == manifests
            assert run.live
            assert run["x"].get(3).tolist() == [3.0] * 8  # the file opened
            assert run.live
        process.kill()
        process.wait(timeout=60)
        with pytest.warns(RuntimeWarning, match="missing"):
            run = vartrace.open(url)
        with run:
            assert len(run["x"]) == 3 and not run.live
    finally:
        process.kill()
        process.wait(timeout=60)
