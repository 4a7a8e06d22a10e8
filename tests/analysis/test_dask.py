"""Analysis on Dask: a real `LocalCluster` of two worker processes over sharded runs
written by the real saver (`tests/_dask_runs.py`).  Whatever runs on the cluster must give
what runs in process: the same report row for row, the same frames."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("distributed")
import cloudpickle
import pandas as pd
from distributed import Client, LocalCluster, get_task_stream

import vartrace
from tests._dask_runs import ALIAS, write_run, write_shard
from vartrace.analysis.comparison.on_dask import compare_calls
from vartrace.analysis.scheduling import as_delayed
from vartrace.analysis.sources import open_source
from vartrace.analysis.tasks import TASK_BYTES, RunFiles
from vartrace.trace import Trace

WORLD = 8
DIFFERENCES = {("blocks.0.forward", 3, 2), ("note", 3, 1), ("stats", 2, 0), ("bf16", 4, 5)}


@pytest.fixture(scope="module")
def client() -> Any:
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as connected,
    ):
        yield connected


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two 8-rank runs: b differs in four records, lacks one, misses rank 7's shard and
    has a site of its own."""
    folder = tmp_path_factory.mktemp("runs")
    a = write_run(folder / "a", WORLD)
    with pytest.warns(RuntimeWarning, match="rank"):
        vartrace.open(write_run(folder / "b", WORLD, missing={7})).close()
    for rank in range(WORLD - 1):
        (folder / "b" / f"run.rank{rank}.h5").unlink()
    b = write_run(
        folder / "b",
        WORLD,
        missing={7},
        perturb=DIFFERENCES,
        drop={("calls", 2, 1)},
        extra=True,
    )
    return a, b


class Refusing(cloudpickle.Pickler):
    """cloudpickle refusing any h5py object (a handle does not pickle, nor belong in a graph)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj).__module__.startswith("h5py"):
            raise AssertionError(f"an h5py object in the graph: {obj!r}")
        return super().reducer_override(obj)


def _same(report: Any, expected: Any) -> None:
    pd.testing.assert_frame_equal(report.to_frame(), expected.to_frame(), check_exact=True)
    assert report.first_divergence == expected.first_divergence
    assert report.sites == expected.sites and str(report) == str(expected)
    assert (report.only_in_a, report.only_in_b) == (expected.only_in_a, expected.only_in_b)


def _compare(a: Any, b: Any, **options: Any) -> Any:
    with pytest.warns(RuntimeWarning, match="rank"):  # b's rank 7
        return vartrace.compare(a, b, **options)


def test_compare_on_a_cluster_is_the_comparison_in_process(client: Any, runs: Any) -> None:
    a, b = runs
    for first, second in ((a, b), (b, a)):
        expected = _compare(first, second)
        assert expected.first_divergence == ("embed", 1, 7)  # rank 7's shard is missing
        _same(_compare(first, second, scheduler=client), expected)
    expected = _compare(a, b, names=["blocks.*", "stats", "note", "bf16"])
    assert expected.first_divergence == ("blocks.0.forward", 1, 7)
    frame = expected.to_frame().set_index(["site", "iteration", "rank"])
    assert frame.loc[("stats", 2, 0), "dtype_a"] == "statistics of bfloat16"
    assert frame.loc[("bf16", 4, 5), "status"] == "differs"
    for scheduler in (client, "threads", client.scheduler.address):
        _same(
            _compare(a, b, names=["blocks.*", "stats", "note", "bf16"], scheduler=scheduler),
            expected,
        )
    with vartrace.open(a) as run:
        assert ALIAS in run.aliases
        _same(vartrace.compare(run, a, scheduler=client), vartrace.compare(run, a))


def test_shards_that_do_not_pair_by_name_and_memory_compare_the_same(
    client: Any, runs: Any, tmp_path: Path
) -> None:
    a, _ = runs
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for rank in range(WORLD):  # rank k's shard named as rank k + 1's
        shutil.copy(a.replace("*", str(rank)), renamed / f"run.rank{(rank + 1) % WORLD}.h5")
    other = str(renamed / "run.rank*.h5")
    _same(vartrace.compare(a, other, scheduler=client), vartrace.compare(a, other))
    with vartrace.open(a) as run:
        memory = {
            name: Trace(run[name].calls(1, rank=0), [1, 1], [0, 0], [0, 1]) for name in ["calls"]
        }
        _same(vartrace.compare(memory, run, scheduler=client), vartrace.compare(memory, run))


def test_the_graph_carries_paths_never_an_h5py_object(runs: Any) -> None:
    a, b = runs
    with pytest.warns(RuntimeWarning), vartrace.open(a) as run_a, vartrace.open(b) as run_b:
        source_a, source_b = open_source(run_a), open_source(run_b)
        common = [name for name in run_a.names if name in run_b]
        calls = compare_calls(
            (RunFiles.of(run_a), RunFiles.of(run_b)), source_a, source_b, common, 1e-8, 1e-5
        )
        assert len(calls) == WORLD
        graph = as_delayed(calls)
        Refusing(io.BytesIO()).dump([dict(node.__dask_graph__()) for node in graph])
        with pytest.raises(AssertionError, match="h5py object"):
            Refusing(io.BytesIO()).dump(run_a["embed"].values)


def test_a_comparison_takes_a_task_per_shard_pair_or_per_256_mb(
    client: Any, runs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = runs
    with get_task_stream(client) as stream:
        report = _compare(a, b, scheduler=client)
    assert len({task["key"] for task in stream.data}) == WORLD
    shard_bytes = max(os.path.getsize(a.replace("*", str(rank))) for rank in range(WORLD))
    limit = 40_000  # a task per 40 kB: several tasks share a pair of shards
    monkeypatch.setattr("vartrace.analysis.tasks.TASK_BYTES", limit)
    with get_task_stream(client) as stream:
        split = _compare(a, b, scheduler=client)
    tasks = len({task["key"] for task in stream.data})
    assert WORLD < tasks <= WORLD * math.ceil(shard_bytes / limit) + 2
    _same(split, report)
    assert TASK_BYTES == 256 << 20


def test_a_live_shard_compares_as_of_its_last_flush(client: Any, tmp_path: Path) -> None:
    live = tmp_path / "live"
    for rank in range(1, 4):
        write_shard(live, rank, 4)
    writer = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "_dask_runs.py"), str(live), "0", "4"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "flushed\n"
        closed = write_run(tmp_path / "closed", 4, perturb={("embed", 5, 0)})
        with vartrace.open(live / "run.rank*.h5") as run:
            assert writer.poll() is None  # its writer still holds the shard open
            expected = vartrace.compare(run, closed)
            assert expected.first_divergence == ("embed", 5, 0)
            _same(vartrace.compare(run, closed, scheduler=client), expected)
    finally:
        writer.kill()
        writer.wait(timeout=60)


def test_a_damaged_shard_is_named_by_the_error_from_the_worker(
    client: Any, runs: Any, tmp_path: Path
) -> None:
    a, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(Path(a).parent, copy)
    damaged = copy / "run.rank2.h5"
    with vartrace.open(copy / "run.rank*.h5") as run:  # listed whole, then damaged
        with damaged.open("r+b") as raw:
            raw.truncate(damaged.stat().st_size // 2)
        with pytest.raises(Exception) as on_cluster:
            vartrace.compare(run, a, scheduler=client)
    assert str(damaged) in str(on_cluster.value), on_cluster.value


def test_the_command_line_compares_on_workers_or_at_an_address(client: Any, runs: Any) -> None:
    a, b = runs

    def command(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vartrace", "compare", a, b, *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    in_process = command()
    assert in_process.returncode == 1 and "first divergence: embed" in in_process.stdout
    for extra in (("--workers", "2"), ("--scheduler", client.scheduler.address)):
        done = command(*extra)
        assert (done.returncode, done.stdout) == (1, in_process.stdout), done.stderr
    refused = command("--workers", "0")
    assert refused.returncode == 2 and "above 0" in refused.stderr


def test_a_bad_scheduler_is_refused_naming_what_is_taken(runs: Any) -> None:
    a, _ = runs
    with pytest.raises(ValueError, match="neither a Dask scheduler"):
        vartrace.compare(a, a, scheduler="fast")
    with pytest.raises(TypeError, match=r"distributed\.Client or an address"):
        vartrace.compare(a, a, scheduler=4)


def test_to_frame_on_a_cluster_is_the_frame_in_process(client: Any, runs: Any) -> None:
    _, b = runs
    with pytest.warns(RuntimeWarning), vartrace.open(b) as run:
        for stat in (["mean", "absmax", "q0.5"], "std", lambda value: type(value).__name__):
            expected = run.to_frame(stat)
            got = run.to_frame(stat, scheduler=client)
            pd.testing.assert_frame_equal(got, expected, check_exact=True)
        names = [ALIAS, "note", "rank0.only", "stats"]
        expected = run.to_frame("mean", names=names)
        pd.testing.assert_frame_equal(
            run.to_frame("mean", names=names, scheduler="threads"), expected
        )
        with pytest.raises(KeyError, match="no site"):
            run.to_frame("mean", names=["nowhere"], scheduler=client)
        lazy = run.to_dask_frame(["mean", "absmax"])
        assert lazy.npartitions == WORLD - 1
        computed = lazy.compute(scheduler=client)
        key = ["site", "iteration", "rank", "order"]
        expected = run.to_frame(["mean", "absmax"]).sort_values(key, ignore_index=True)
        computed = computed.sort_values(key, ignore_index=True)
        assert computed[key].astype(object).values.tolist() == expected[key].values.tolist()
        np.testing.assert_array_equal(computed["absmax"], expected["absmax"])


def test_to_dask_and_a_lazy_xarray_read_the_records_by_path(client: Any, runs: Any) -> None:
    a, _ = runs
    with vartrace.open(a) as run:
        arrays = run.to_dask("*")
        assert "note" not in arrays and "stats" not in arrays  # text, statistics rows
        assert arrays["embed"].numblocks[0] == WORLD  # a chunk per shard: never a record
        assert arrays["ragged"].shape == (WORLD * 5, 5 + WORLD - 1, 3)
        for name in ("ragged", "bf16", ALIAS, "rank0.only"):
            eager = run[name].to_xarray()
            lazy = run[name].to_xarray(chunks=2)
            assert lazy.chunks is not None and lazy.dtype == eager.dtype
            got = lazy.compute(scheduler=client)
            order = [
                np.lexsort([x[c].values for c in ("order", "rank", "iteration")])
                for x in (eager, got)
            ]
            np.testing.assert_array_equal(got.values[order[1]], eager.values[order[0]])
        np.testing.assert_array_equal(
            arrays["bf16"].sum(axis=(1, 2)).compute(scheduler=client).sort(),
            run["bf16"].to_xarray().sum(["dim_1", "dim_2"]).values.sort(),
        )
        with pytest.raises(TypeError, match="numeric records only"):
            run["note"].to_xarray(chunks="auto")
        calls = [
            node.__dask_graph__() for node in (arrays["embed"], run[ALIAS].to_xarray(chunks=1).data)
        ]
        for graph in calls:
            Refusing(io.BytesIO()).dump(dict(graph))


def test_to_dask_gives_the_records_shard_by_shard_as_documented(runs: Any) -> None:
    """`run.to_dask` orders records file by file (each shard's records as that shard opened
    alone gives them), not merged by iteration as `to_frame` and `Site` are."""
    a, _ = runs
    with vartrace.open(a) as run:
        computed = run.to_dask("embed")["embed"].compute(scheduler="threads")
        merged, paths = run["embed"].to_xarray().values, list(run.paths)
    pieces = []
    for path in paths:
        with pytest.warns(RuntimeWarning, match="missing"), vartrace.open(path) as shard:
            pieces.append(shard["embed"].to_xarray().values)
    np.testing.assert_array_equal(computed, np.concatenate(pieces))
    assert computed.shape == merged.shape and not np.array_equal(computed, merged)


def test_a_worker_killed_mid_comparison_is_replaced_and_the_report_unchanged(
    client: Any, runs: Any
) -> None:
    a, b = runs
    expected = _compare(a, b)
    pids = client.run(os.getpid)
    with ThreadPoolExecutor(1) as pool, pytest.warns(RuntimeWarning, match="rank"):
        pending = pool.submit(vartrace.compare, a, b, scheduler=client)
        deadline = time.monotonic() + 60
        busy: list[str] = []
        while not busy and time.monotonic() < deadline:
            busy = [worker for worker, keys in client.processing().items() if keys]
        assert busy, "no task ever ran"
        os.kill(pids[busy[0]], signal.SIGKILL)
        report = pending.result(timeout=120)
    _same(report, expected)
    client.wait_for_workers(2, timeout=60)
