"""Read paths whose cost does not grow with the run: the iteration index of ``get`` and
``calls``, record-by-record loops served from blocks read ahead, ``to_frame`` in blocks and
sites opened only when used, checked record for record against what was written (real
files through H5PYSaverCallback, shards, a live writer)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from vartrace.statistics.named import STATS, reduce_block
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.reader import RunFileError
from vartrace.trace import RunContext, Trace

#: (value, iteration, rank, order) of each record of the long site, in capture order.
Record = tuple[torch.Tensor, int, int, int]


def _records(count: int, seed: int = 0) -> list[Record]:
    """``count`` records on ranks 0 and 1: one, two or three calls an iteration, some
    iterations with none, every value distinct (its record number at [0])."""
    generator = torch.Generator().manual_seed(seed)
    records: list[Record] = []
    iteration = 0
    while len(records) < count:
        iteration += int(torch.randint(1, 3, (), generator=generator))
        for _ in range(int(torch.randint(1, 4, (), generator=generator))):
            value = torch.randn(64, generator=generator)
            value[0] = len(records)
            records.append((value, iteration, len(records) % 2, len(records)))
    return records[:count]


def _write(path: Path, name: str, records: list[Record], gather: int = 250) -> None:
    with H5PYSaverCallback(path, metadata=False) as saver:
        for start in range(0, len(records), gather):
            chunk = records[start : start + gather]
            saver(name, Trace(*(list(field) for field in zip(*chunk, strict=True))))
            saver.flush()


def _expected_get(records: list[Record], iteration: int, rank: int) -> torch.Tensor | None:
    """The last record of ``rank`` at or before ``iteration`` in (iteration, order) order."""
    held = [r for r in records if r[2] == rank and r[1] <= iteration]
    return max(held, key=lambda r: (r[1], r[3]))[0] if held else None


def test_get_and_calls_answer_as_a_scan_of_every_record_would(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    records = _records(3000)
    _write(path, "x", records)
    last = records[-1][1]
    with vartrace.open(path) as run:
        site = run["x"]
        for iteration in [0, 1, 2, *range(3, last + 3, 7), last, last + 1]:
            for rank in (0, 1):
                want = _expected_get(records, iteration, rank)
                if want is None:
                    with pytest.raises(KeyError, match="no record at or before iteration"):
                        site.get(iteration, rank)
                    continue
                assert torch.equal(site.get(iteration, rank), want), (iteration, rank)
                assert torch.equal(site.get(np.int64(iteration), rank=np.int32(rank)), want)
                calls = site.calls(iteration, rank)
                tagged = [r[0] for r in records if r[1] == iteration and r[2] == rank]
                assert len(calls) == len(tagged)
                assert all(torch.equal(a, b) for a, b in zip(calls, tagged, strict=True))
        assert torch.equal(site.get(2**70), _expected_get(records, last, 0))  # beyond int64
        assert torch.equal(site.get(12.5, 1), _expected_get(records, 12, 1))
        with pytest.raises(KeyError, match="no record at or before iteration nan"):
            site.get(float("nan"))
        assert site.calls(12.5) == []
        with pytest.raises(
            KeyError, match=r"no record on rank 2 \(it has records of rank\(s\) 0, 1"
        ):
            site.get(5, rank=2)


def test_record_loops_in_any_order_read_every_record_exactly(tmp_path: Path) -> None:
    """Forward, backward, strided and interleaved over more sites than blocks are kept."""
    path = tmp_path / "run.h5"
    sites = {f"s{k}": _records(700, seed=k) for k in range(11)}
    with H5PYSaverCallback(path, metadata=False) as saver:
        for name, records in sites.items():
            saver(name, Trace(*(list(field) for field in zip(*records, strict=True))))
    with vartrace.open(path) as run:
        site = run["s0"]
        values = [r[0] for r in sites["s0"]]
        orders = [range(700), range(699, -1, -1), range(0, 700, 3), [5, 6, 7, 300, 301, 8, 9]]
        for indices in orders:
            for i in indices:
                assert torch.equal(site.record(i), values[i]), i
        for i in range(700):  # eleven loops at once: blocks are dropped and read again
            for name, records in sites.items():
                assert torch.equal(run[name].record(i), records[i][0]), (name, i)


def test_a_record_read_from_a_block_is_a_value_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    records = _records(40)
    _write(path, "x", records)
    with vartrace.open(path) as run:
        site = run["x"]
        first, second = site.record(0), site.record(1)  # the second read a block ahead
        second += 1000
        assert torch.equal(site.record(2), records[2][0])
        assert torch.equal(site.record(1), records[1][0])
        assert not torch.equal(first, second)


def _ragged_records() -> list[tuple[object, int, int, int]]:
    """Ragged arrays, scalars of another kind, NaN and inf, and a None: one site."""
    generator = np.random.default_rng(3)
    records: list[tuple[object, int, int, int]] = []
    for i in range(600):
        value: object = generator.standard_normal((1 + i % 5, 3 + i % 4)).astype(np.float32)
        if i % 97 == 5:
            value[0, 0] = np.nan  # type: ignore[index]
        if i % 89 == 7:
            value[-1, -1] = np.inf  # type: ignore[index]
        if i % 101 == 9:
            value = None
        if i % 103 == 11:
            value = "text"
        records.append((value, i + 1, 0, i))
    return records


def test_ragged_records_read_and_to_frame_as_each_record_alone(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    records = _ragged_records()
    _write(path, "r", records, gather=128)  # type: ignore[arg-type]
    with vartrace.open(path) as run:
        site = run["r"]
        for i, (value, *_) in enumerate(records):
            read = site.record(i)
            if isinstance(value, np.ndarray):
                assert read.shape == value.shape and np.array_equal(read, value, equal_nan=True)
            else:
                assert read == value
        frame = run.to_frame(["mean", "std", "absmax", "nan", "posinf", "zeros"])
        shapes = frame["shape"].tolist()
        for i, (value, *_) in enumerate(records):
            numeric = isinstance(value, np.ndarray)
            assert shapes[i] == (value.shape if numeric else ())  # type: ignore[union-attr]
            for stat in ("mean", "std", "absmax", "nan", "posinf", "zeros"):
                want = (
                    float(reduce_block(STATS[stat], np.asarray(value)[None])[0])
                    if numeric
                    else math.nan
                )
                got = frame[stat].iloc[i]
                assert got == want or (math.isnan(got) and math.isnan(want)), (i, stat)
        sums = run.to_frame(lambda value: None if value is None else np.asarray(value).size)
        assert sums["stat"].tolist()[:3] == [3, 8, 15]


def test_shards_merge_by_iteration_for_get_calls_and_loops(tmp_path: Path) -> None:
    records = {rank: _records(400, seed=10 + rank) for rank in (0, 1)}
    for rank, mine in records.items():
        saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
        ranked = [(v, it, rank, order) for v, it, _, order in mine]
        saver("x", Trace(*(list(field) for field in zip(*ranked, strict=True))))
        saver.close()
    with vartrace.open(tmp_path / "run.rank*.h5") as run:
        site = run["x"]
        merged = sorted(
            ((v, it, rank, order) for rank, mine in records.items() for v, it, _, order in mine),
            key=lambda r: (r[1], r[2], r[3]),
        )
        assert site.ranks.tolist() == [r[2] for r in merged]
        for i, record in enumerate(merged):
            assert torch.equal(site.record(i), record[0]), i
        for rank in (0, 1):
            ranked = [(v, it, rank, order) for v, it, _, order in records[rank]]
            for iteration in range(0, ranked[-1][1] + 2, 5):
                want = _expected_get(ranked, iteration, rank)
                if want is not None:
                    assert torch.equal(site.get(iteration, rank), want)
                assert len(site.calls(iteration, rank)) == sum(r[1] == iteration for r in ranked)
        frame = run.to_frame("max")
        assert frame["max"].tolist() == [float(r[0].double().max()) for r in merged]


def test_a_damaged_site_fails_only_when_used(tmp_path: Path) -> None:
    """Listing opens no site's values: a site whose values are damaged lists, the others
    read, and using it names the damage."""
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("w", Trace([torch.ones(3)], [1], [0], [0]))
        saver("note", Trace([torch.zeros(2)], [1], [0], [1]))
    with h5py.File(path, "r+") as handle:
        handle["vars/note/values"].attrs.update(key="float64/1", torch_dtype="")
    with vartrace.open(path) as run:
        assert run.names == ["w", "note"] and len(run) == 2 and "note" in run
        assert torch.equal(run["w"].get(1), torch.ones(3))
        with pytest.raises(RunFileError, match="/vars/note/values has the key"):
            run["note"]


_GROWING = """
import sys, time
from pathlib import Path
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace
saver = H5PYSaverCallback(sys.argv[1], metadata=False)
go = Path(sys.argv[2])
for step in range(1, 7):
    value = torch.full((8,), float(step))
    saver("x", Trace([value, value.clone()], [step] * 2, [0] * 2, [2 * step, 2 * step + 1]))
    saver.flush()
    if step == 3:
        print("flushed", flush=True)
        while not go.exists():
            time.sleep(0.05)
print("done", flush=True)
time.sleep(600)
"""


def test_a_live_run_answers_as_of_its_opening_and_a_reopen_sees_more(tmp_path: Path) -> None:
    path, go, script = tmp_path / "live.h5", tmp_path / "go", tmp_path / "writer.py"
    script.write_text(_GROWING)
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), str(go)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "flushed\n"
        with vartrace.open(path) as run:
            assert run.live
            site = run["x"]
            assert torch.equal(site.get(5), torch.full((8,), 3.0))
            assert len(site.calls(3)) == 2
            go.touch()
            assert process.stdout.readline() == "done\n"
            assert torch.equal(site.get(5), torch.full((8,), 3.0)), "as of its opening"
            assert site.calls(5) == [] and len(site) == 6
        with vartrace.open(path) as run:
            site = run["x"]
            assert len(site) == 12
            assert torch.equal(site.get(5), torch.full((8,), 5.0))
            assert [float(v[0]) for v in site.calls(6)] == [6.0, 6.0]
    finally:
        process.kill()
        process.wait(timeout=60)


def test_closing_a_run_of_shards_closes_its_objects_and_no_other_runs(tmp_path: Path) -> None:
    """A run's shards close together (their objects, then the files, then h5py's dead
    identifiers looked for once): the run's datasets are closed with it, while another run
    of the same files, open at the same time, keeps reading."""
    for rank in range(3):
        saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=3, sharded=True))
        for site in ("a", "b"):
            saver(site, Trace([torch.full((4,), float(rank))], [1], [rank], [0]))
        saver.close()
    for manifest in tmp_path.glob("*.manifest.json"):
        manifest.unlink()  # every file opened at once
    before = _open_objects()
    closed, kept = vartrace.open(tmp_path), vartrace.open(tmp_path)
    assert sorted(closed["a"].get(1, rank=r)[0].item() for r in range(3)) == [0.0, 1.0, 2.0]
    both = _open_objects()
    closed.close()
    with kept:
        assert before < _open_objects() < both
        assert sorted(kept["b"].get(1, rank=r)[0].item() for r in range(3)) == [0.0, 1.0, 2.0]
        assert np.asarray(kept["a"].values[:]).shape == (3, 4)
    assert _open_objects() == before


def _open_objects() -> int:
    """The HDF5 files and objects in files open in this process."""
    kinds = h5py.h5f.OBJ_FILE | h5py.h5f.OBJ_DATASET | h5py.h5f.OBJ_GROUP | h5py.h5f.OBJ_ATTR
    return len(h5py.h5f.get_obj_ids(h5py.h5f.OBJ_ALL, kinds))
