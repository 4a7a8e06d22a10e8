"""File handling of the HDF5 storage: overwrite/append, errors, shards, laziness, to_frame."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from vartrace.storage import H5PYSaverCallback, open_run
from vartrace.storage.layout import FORMAT_ATTR, FORMAT_VERSION
from vartrace.trace import RunContext, Trace


def _trace(values: list[Any], iterations: list[int], rank: int = 0, first: int = 0) -> Trace:
    trace = Trace()
    for offset, (value, iteration) in enumerate(zip(values, iterations, strict=True)):
        trace.append(value, iteration, rank, first + offset)
    return trace


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path: Path, iterations: list[int], **options: Any) -> None:
    with H5PYSaverCallback(path, **options) as saver:
        saver("forward.x", _trace([torch.full((2,), float(i)) for i in iterations], iterations))


def test_an_existing_file_raises_file_exists_and_stays_byte_identical(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, [1, 2])
    before = _digest(path)
    saver = H5PYSaverCallback(path)
    with pytest.raises(FileExistsError, match="overwrite=True") as caught:
        saver.on_start(RunContext())
    assert caught.value.filename == str(path)
    with pytest.raises(FileExistsError):
        saver("forward.x", _trace([1], [3]))
    saver.close()
    assert _digest(path) == before
    other = tmp_path / "notes.txt"
    other.write_text("not ours")
    with pytest.raises(FileExistsError):
        H5PYSaverCallback(other)("x", _trace([1], [1]))
    assert other.read_text() == "not ours"


@pytest.mark.warnings_as_errors
def test_overwrite_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, [1, 2, 3])
    _write(path, [7], overwrite=True)
    with open_run(path) as run:
        assert run["forward.x"].iterations.tolist() == [7]


@pytest.mark.warnings_as_errors
def test_append_continues_a_run_with_new_records_and_new_sites(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, [1, 2])
    with open_run(path) as run:
        meta_before = run.meta
    with H5PYSaverCallback(path, append=True) as saver:
        saver("forward.x", _trace([torch.full((3,), 3.0), torch.full((2,), 4.0)], [3, 4], first=2))
        saver("forward.new", _trace(["hello"], [3]))
    with open_run(path) as run:
        site = run["forward.x"]
        assert site.iterations.tolist() == [1, 2, 3, 4]
        assert site.order.tolist() == [0, 1, 2, 3]
        assert [site.get(i).tolist() for i in (1, 2, 3, 4)] == [
            [1.0, 1.0],
            [2.0, 2.0],
            [3.0, 3.0, 3.0],
            [4.0, 4.0],
        ]
        assert run["forward.new"].get(3) == "hello"
        assert run.meta == meta_before, "metadata is written once per file"


def test_append_creates_a_missing_file_and_refuses_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "fresh.h5"
    _write(path, [1], append=True)
    with open_run(path) as run:
        assert run.names == ["forward.x"]
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as handle:
        handle["data"] = np.arange(3)
    before = _digest(foreign)
    with pytest.raises(ValueError, match="not a vartrace file"):
        _write(foreign, [1], append=True)
    assert _digest(foreign) == before
    with pytest.raises(ValueError, match="exclude each other"):
        H5PYSaverCallback(path, append=True, overwrite=True)


def test_not_a_vartrace_file_and_newer_versions_raise_value_errors_naming_the_path(
    tmp_path: Path,
) -> None:
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.h5 is not a vartrace file: not an HDF5 file"):
        open_run(text)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as handle:
        handle["data"] = np.arange(3)
    with pytest.raises(ValueError, match=r"foreign\.h5 is not a vartrace file"):
        open_run(foreign)
    newer = tmp_path / "newer.h5"
    _write(newer, [1])
    with h5py.File(newer, "r+") as handle:
        handle.attrs[FORMAT_ATTR] = FORMAT_VERSION + 1
    with pytest.raises(
        ValueError, match=rf"newer\.h5 has vartrace format version {FORMAT_VERSION + 1}, newer"
    ):
        open_run(newer)
    with pytest.raises(FileNotFoundError):
        open_run(tmp_path / "missing.h5")


def test_unknown_site_raises_key_error_with_close_matches(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        for layer in range(3):
            saver(f"layers.{layer}.attn.forward.scores", _trace([1.0], [1]))
    with open_run(path) as run:
        with pytest.raises(KeyError, match=r"close matches: layers\.1\.attn\.forward\.scores"):
            run["layers.1.atn.forward.scores"]
        with pytest.raises(KeyError, match="no site 'zzz'"):
            run["zzz"]
        assert "layers.0.attn.forward.scores" in run and len(run) == 3


def test_get_returns_one_value_and_calls_every_record_of_an_iteration(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("shared.forward.x", _trace([10, 11, 20, 30], [1, 1, 2, 1], first=5))
    with open_run(path) as run:
        site = run["shared.forward.x"]
        assert site.get(1) == 30, "the last record of iteration 1 in capture order"
        assert site.calls(1) == [10, 11, 30]
        assert site.get(2) == 20 and site.calls(2) == [20]
        assert site.get(3) == 20 and site.calls(3) == [], "as of iteration 3: unchanged since 2"
        with pytest.raises(KeyError, match="no record on rank 1"):
            site.get(1, rank=1)


def test_opening_is_lazy_and_values_is_the_h5py_dataset(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    records = [torch.randn(64, 64) for _ in range(40)]
    with H5PYSaverCallback(path) as saver:
        saver("big", _trace(records, list(range(1, 41))))
    with open_run(path) as run:
        values = run["big"].values
        assert isinstance(values, h5py.Dataset)
        assert values.shape == (40, 64, 64) and values.dtype == np.float32
        assert np.array_equal(values[7], records[7].numpy())
        assert values.chunks[1:] == (64, 64), "chunks hold whole records"
        assert values.chunks[0] > 1, "small records share a chunk"
        with pytest.raises((OSError, ValueError)):
            values[0] = 1.0  # read-only


def test_a_sharded_saver_writes_its_rank_file_and_a_glob_reads_them_as_one_run(
    tmp_path: Path,
) -> None:
    base = tmp_path / "run.h5"
    plan = {  # rank -> (iterations, values): ranks record different numbers of records
        0: ([1, 2, 2, 3], [0.0, 1.0, 2.0, 3.0]),
        1: ([1, 3], [10.0, 30.0]),
        2: ([2], [20.0]),
    }
    for rank, (iterations, values) in plan.items():
        saver = H5PYSaverCallback(base)
        saver.on_start(RunContext(rank=rank, world_size=3, sharded=True))
        assert saver.path == tmp_path / f"run.rank{rank}.h5"
        saver("forward.x", _trace([torch.tensor(v) for v in values], iterations, rank=rank))
        if rank == 1:
            saver("forward.only1", _trace(["a"], [1], rank=rank))
        saver.close()
    assert not base.exists()
    with pytest.raises(FileNotFoundError, match=r"run\.rank\*\.h5"):
        open_run(base)
    with open_run(str(tmp_path / "run.rank*.h5")) as run:
        assert run.names == ["forward.only1", "forward.x"]
        site = run["forward.x"]
        assert site.iterations.tolist() == [1, 1, 2, 2, 2, 3, 3]
        assert site.ranks.tolist() == [0, 1, 0, 0, 2, 0, 1]
        assert [float(site.record(i)) for i in range(len(site))] == [
            0.0,
            10.0,
            1.0,
            2.0,
            20.0,
            3.0,
            30.0,
        ]
        assert site.calls(2) == [torch.tensor(1.0), torch.tensor(2.0)]
        assert site.get(2) == torch.tensor(2.0)
        assert site.get(3, rank=1) == torch.tensor(30.0)
        assert site.values.shape == (7,) and site.values[4] == 20.0
        assert site.values[[1, 6]].tolist() == [10.0, 30.0]
        assert run["forward.only1"].get(1, rank=1) == "a"
    with open_run([tmp_path / "run.rank2.h5", tmp_path / "run.rank0.h5"]) as run:
        assert run["forward.x"].ranks.tolist() == [0, 0, 0, 2, 0]


@pytest.mark.warnings_as_errors
def test_non_zero_ranks_of_a_gathered_run_write_nothing(tmp_path: Path) -> None:
    saver = H5PYSaverCallback(tmp_path / "run.h5")
    saver.on_start(RunContext(rank=1, world_size=2, sharded=False))
    with pytest.raises(RuntimeError, match="only rank 0 writes"):
        saver("forward.x", _trace([1], [1]))
    saver.close()
    assert list(tmp_path.iterdir()) == []


def test_a_closed_saver_refuses_records(tmp_path: Path) -> None:
    saver = H5PYSaverCallback(tmp_path / "run.h5")
    saver("x", _trace([1], [1]))
    assert set(saver.datasets) == {"x"} and isinstance(saver.datasets["x"], h5py.Dataset)
    saver.close()
    saver.close()
    with pytest.raises(RuntimeError, match="is closed"):
        saver("x", _trace([2], [2]))


def test_to_frame_has_one_row_per_record_with_the_statistic(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    scores = [torch.tensor([[1.0, -3.0], [2.0, 0.0]]), torch.tensor([[0.5]])]
    halves = [torch.tensor([1.0, -2.0]).bfloat16()]
    with H5PYSaverCallback(path) as saver:
        saver("scores", _trace(scores, [1, 2]))
        saver("half", _trace(halves, [1]))
        saver("misc", _trace([None, "text", 4, {"a": 1}], [1, 2, 3, 4]))
        saver("loss", _trace([0.5, 1.5], [1, 2]))
    with open_run(path) as run:
        frame = run.to_frame("absmax")
        assert list(frame.columns) == [
            "site",
            "iteration",
            "rank",
            "order",
            "shape",
            "dtype",
            "absmax",
        ]
        assert len(frame) == 9
        assert frame[frame.site == "loss"]["absmax"].tolist() == [0.5, 1.5]
        assert frame[frame.site == "loss"]["dtype"].tolist() == ["float64", "float64"]
        rows = frame.set_index(["site", "iteration"])
        assert rows.loc[("scores", 1), "absmax"] == 3.0
        assert rows.loc[("scores", 2), "shape"] == (1, 1)
        assert rows.loc[("half", 1), "dtype"] == "bfloat16"
        assert rows.loc[("half", 1), "absmax"] == 2.0
        assert rows.loc[("misc", 3), "absmax"] == 4.0
        assert math.isnan(rows.loc[("misc", 2), "absmax"])
        assert rows.loc[("misc", 4), "dtype"] == "pickle"
        for stat, want in (("mean", 0.0), ("std", math.sqrt(3.5)), ("norm", math.sqrt(14))):
            got = run.to_frame(stat, names=["scores"])[stat].iloc[0]
            assert got == pytest.approx(want)
        custom = run.to_frame(lambda value: tuple(value.shape), names=["scores"])
        assert custom["stat"].tolist() == [(2, 2), (1, 1)]
        with pytest.raises(ValueError, match="unknown statistic"):
            run.to_frame("median")


def test_context_manager_and_repr(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("x", _trace([1], [1]))
        assert "open" in repr(saver)
    assert "closed" in repr(saver)
    with open_run(path) as run:
        assert "sites=1" in repr(run)
        assert "records=1" in repr(run["x"])


@pytest.mark.slow
def test_thousands_of_sites_in_one_gather(tmp_path: Path) -> None:
    """More sites than stay open, and than one chunk of /committed counts, in one file."""
    path = tmp_path / "run.h5"
    count = 4100
    with H5PYSaverCallback(path, metadata=False) as saver:
        for site in range(count):
            saver(f"layers.{site}.forward", _trace([site], [1], first=site))
        saver.flush()
        for site in range(300):  # long closed since: reopened to append
            saver(f"layers.{site}.forward", _trace([-site], [2], first=count + site))
        assert saver.datasets["layers.0.forward"].shape == (2,)
        assert len(saver.datasets) == count
    with open_run(path) as run:
        assert len(run.names) == count
        assert run["layers.4099.forward"].get(1) == 4099
        assert run["layers.7.forward"].get(2) == -7
        assert run["layers.300.forward"].iterations.tolist() == [1]


def test_hundreds_of_sites_kept_open_across_gathers_are_all_stored(tmp_path: Path) -> None:
    """600 sites of 4 KiB records in three gathers of 8, every site's datasets open all
    along: with HDF5's default metadata cache SWMR mode failed here ("Child entry doesn't
    have a flush dependency parent array", or a crash) once a few hundred sites were open
    while new ones were created."""
    path = tmp_path / "run.h5"
    sites = [f"layers.{index}.forward.x" for index in range(600)]
    with H5PYSaverCallback(path, metadata=False) as saver:
        for gather in range(3):
            steps = list(range(gather * 8 + 1, gather * 8 + 9))
            for index, name in enumerate(sites):
                values = [np.full(1024, index * 100 + step, np.float32) for step in steps]
                saver(name, _trace(values, steps, first=gather * 8))
            saver.flush()
    with open_run(path) as run:
        assert len(run.names) == len(sites)
        for index in (0, 299, 599):
            site = run[sites[index]]
            assert len(site) == 24
            np.testing.assert_array_equal(site.get(24), np.full(1024, index * 100 + 24, np.float32))
