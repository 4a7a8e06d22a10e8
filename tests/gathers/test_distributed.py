"""Multi-process tests of vartrace's distributed gathering on real gloo process groups.

Every test spawns 2 or 4 ranks (``spawn`` start method, gloo over 127.0.0.1 on
a free port) running a scenario from ``_dist_workers.py``; the ranks pickle
what they saw and the assertions run here.  Each launch has a hard deadline:
a rank still running after it is killed and the test fails, so nothing can
hang CI.
"""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from vartrace.trace import Trace

workers = importlib.import_module("tests._dist_workers")

pytestmark = pytest.mark.slow

DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(
    scenario: str, world: int, out: Path, *, pg_timeout: float = 60.0, deadline: float = DEADLINE_S
) -> list[int | None]:
    """Run ``scenario`` on ``world`` spawned ranks; return their exit codes.

    Fails the test (after killing every rank) when any rank is still running
    at the deadline.
    """
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(
            target=workers.entry,
            args=(r, world, port, str(out), scenario, pg_timeout),
            daemon=True,
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if hung:
        pytest.fail(f"{scenario}: ranks {hung} still running after {deadline:.0f}s; killed")
    return [proc.exitcode for proc in procs]


def _run_ok(
    scenario: str,
    world: int,
    out: Path,
    *,
    pg_timeout: float = 60.0,
    deadline: float = DEADLINE_S,
) -> list[Any]:
    """Launch ``scenario``, require every rank to succeed, return each rank's result."""
    codes = _launch(scenario, world, out, pg_timeout=pg_timeout, deadline=deadline)
    errors = {r: (out / f"error{r}.txt") for r in range(world)}
    details = "\n".join(f"rank {r}:\n{p.read_text()}" for r, p in errors.items() if p.exists())
    assert codes == [0] * world, f"exit codes {codes}\n{details}"
    results = []
    for r in range(world):
        results.append(torch.load(out / f"result{r}.pt", weights_only=False))
    return results


def _bits(value: torch.Tensor) -> torch.Tensor:
    """The exact bytes of a tensor's elements (so -0.0 != 0.0 and float8 compares)."""
    return value.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


def _assert_same_value(got: Any, want: Any, where: str) -> None:
    assert type(got) is type(want), f"{where}: type {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
        assert torch.equal(_bits(got), _bits(want)), f"{where}: {got} != {want}"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert np.array_equal(got, want), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _as_records(trace: Trace) -> list[tuple[Any, int, int, int]]:
    """(value, iteration, rank, order) per record, stacked values cut to their true shapes."""
    values = trace.values
    if isinstance(values, torch.Tensor):
        rows = list(values.unbind(0))
        if trace.shapes is not None:
            pairs = zip(rows, trace.shapes, strict=True)
            rows = [row[tuple(slice(0, n) for n in shape)] for row, shape in pairs]
        values = rows
    tags = [
        t.tolist() if isinstance(t, torch.Tensor) else list(t)
        for t in (trace.iterations, trace.ranks, trace.order)
    ]
    return list(zip(values, *tags, strict=True))


def _expected_merge(world: int, round_: int) -> dict[str, list[tuple[Any, int, int, int]]]:
    """Every rank's records per site, rank 0 first, in the order the ranks built them."""
    merged: dict[str, list[tuple[Any, int, int, int]]] = {}
    for r in range(world):
        for name, trace in workers.build_chunk(r, world, round_).items():
            merged.setdefault(name, []).extend(_as_records(trace))
    return merged


def _check_round(got: dict[str, Trace], world: int, round_: int) -> None:
    want = _expected_merge(world, round_)
    assert list(got) == list(want)
    for name, records in want.items():
        trace = got[name]
        trace.check_lengths()
        got_records = _as_records(trace)
        assert len(got_records) == len(records), name
        for i, (g, w) in enumerate(zip(got_records, records, strict=True)):
            _assert_same_value(g[0], w[0], f"{name}[{i}] value")
            assert g[1:] == w[1:], f"{name}[{i}] tags {g[1:]} != {w[1:]}"


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def direct(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One launch of the ``gather_direct`` scenario per world size, shared by its tests."""
    world = request.param
    out = tmp_path_factory.mktemp(f"direct{world}")
    return world, _run_ok("gather_direct", world, out)


def test_gather_chunk_merges_every_rank_on_rank0(direct: Any) -> None:
    world, results = direct
    for r in range(1, world):
        assert results[r]["rounds"] == [None, None, None]
        assert results[r]["chunked"] is None and results[r]["after"] is None
    rank0 = results[0]
    for round_, got in enumerate(rank0["rounds"]):
        _check_round(got, world, round_)

    first = rank0["rounds"][1]
    stacked = first["stacked.forward"]
    assert isinstance(stacked.values, torch.Tensor)
    assert stacked.values.shape == (sum(r + 1 for r in range(world)), 2, world + 1)
    assert stacked.shapes == [(2, r + 2) for r in range(world) for _ in range(r + 1)]
    assert stacked.ranks.dtype == torch.int64
    assert stacked.ranks.tolist() == [r for r in range(world) for _ in range(r + 1)]
    half = first["half.forward"]
    assert isinstance(half.values, list)
    assert half.ranks == [r for r in range(world) for _ in range(2 if r % 2 == 0 else 1)]
    assert first["odd.forward"].ranks == list(range(1, world, 2))
    assert len(first["empty.forward"]) == 0
    scores = first["layers.0.attn.forward.scores"]
    for value, r in zip(scores.values, scores.ranks, strict=True):
        if r:
            assert value.untyped_storage().nbytes() == value.nbytes, "record shares a buffer"


def test_gather_chunk_in_several_rounds_and_errors_raise_everywhere(direct: Any) -> None:
    world, results = direct
    big = results[0]["chunked"]["big"]
    assert big.ranks == list(range(world))
    for value, r in zip(big.values, big.ranks, strict=True):
        assert torch.equal(value, torch.arange(300_000, dtype=torch.float32) * (r + 1))

    for r, result in enumerate(results):
        unpicklable, bad_lengths, unknown_class = result["errors"]
        if r == 1:
            assert unpicklable.startswith("vartrace: rank 1 could not pack its chunk")
        else:
            assert "rank(s) [1] could not pack" in unpicklable
        if r == 0:
            assert "trace fields differ in length" in bad_lengths
            assert unknown_class.startswith("vartrace: rank 0 could not unpack the chunk of rank 1")
            assert "only_on_this_rank" in unknown_class
        else:
            assert "rank(s) [0] could not pack" in bad_lengths
            assert unknown_class is None
    after = results[0]["after"]["after"]
    assert after.values == [2 * r for r in range(world)] and after.ranks == list(range(world))


def _outcomes(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"outcome{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(
    ("scenario", "world", "pg_timeout"),
    [("rank1_raises_and_exits", 4, 60.0), ("rank1_raises_and_lingers", 2, 3.0)],
    ids=["failed-rank-exits", "failed-rank-lingers"],
)
def test_a_rank_that_raises_leaves_no_rank_hanging(
    tmp_path: Path, scenario: str, world: int, pg_timeout: float
) -> None:
    """Rank 1 raises before a gather the others are in: every process ends with an error.

    When rank 1's process exits, gloo reports the closed connection to the
    others; when it stays alive, the process group timeout releases them.
    Either way ``_launch`` would fail the test if any process were still
    running at the deadline.
    """
    codes = _launch(scenario, world, tmp_path, pg_timeout=pg_timeout, deadline=DEADLINE_S)
    assert all(code not in (0, None) for code in codes), codes
    outcomes = _outcomes(tmp_path, world)
    assert outcomes[1]["type"] == "ValueError"
    assert outcomes[1]["message"] == "rank 1 failed inside the traced step"
    for r, outcome in enumerate(outcomes):
        if r != 1:
            assert outcome["runtime_error"], (r, outcome)
    if scenario.endswith("lingers"):
        assert all("timed out" in o["message"].lower() for r, o in enumerate(outcomes) if r != 1)


# --- ModelTracer on a DDP-wrapped model ------------------------------------------------


def _rank_records(rank: int, sites: list[str]) -> list[tuple[str, Any, int, int]]:
    """(site, value, iteration, order) of what rank ``rank`` records of ``sites``, in order.

    Per iteration: ``forward.x`` (the rank's known input), ``block.forward.repeats``
    (an int that never changes, so change detection keeps it at iteration 1
    only) and ``block.helper.doubled`` once per helper call (rank 1 calls the
    helper twice per iteration).
    """
    records = []
    order = 0
    for step in range(1, workers.STEPS + 1):
        x = workers.rank_input(rank, step)
        repeats = 2 if rank == 1 else 1
        captured = [("forward.x", x)]
        if step == 1:
            captured.append(("block.forward.repeats", repeats))
        captured.extend(("block.helper.doubled", x * 2**call) for call in range(1, repeats + 1))
        for site, value in captured:
            if site in sites:
                order += 1
                records.append((site, value, step, order))
    return records


def _gathered(world: int, interval: int, sites: list[str]) -> dict[str, list[tuple]]:
    """What rank 0 accumulates: per gather, rank 0's records of the chunk, then rank 1's..."""
    per_rank = [_rank_records(r, sites) for r in range(world)]
    merged: dict[str, list[tuple]] = {site: [] for site in sites}
    for first in range(1, workers.STEPS + 1, interval):
        chunk = range(first, first + interval)
        for r, records in enumerate(per_rank):
            for site, value, step, order in records:
                if step in chunk:
                    merged[site].append((value, step, r, order))
    return merged


def _assert_records(got: list[tuple], want: list[tuple], where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} records, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same_value(g[0], w[0], f"{where}[{i}]")
        assert tuple(g[1:]) == tuple(w[1:]), f"{where}[{i}]: tags {g[1:]} != {w[1:]}"


def _file_records(site: Any) -> list[tuple]:
    return [
        (site.record(i), int(site.iterations[i]), int(site.ranks[i]), int(site.order[i]))
        for i in range(len(site))
    ]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def traced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One launch of the ``tracer_runs`` scenario per world size, shared by its tests."""
    world = request.param
    out = tmp_path_factory.mktemp(f"traced{world}")
    return world, _run_ok("tracer_runs", world, out), out


def test_ddp_tracer_gathers_exact_values_of_every_rank_on_rank0(traced: Any) -> None:
    world, results, _ = traced
    memory = results[0]["memory"]
    want = _gathered(world, 2, workers.PATHS)
    assert sorted(memory) == sorted(workers.PATHS), "paths must not start with 'module.'"
    for site in workers.PATHS:
        _assert_records(_as_records(memory[site]), want[site], site)
    for r in range(1, world):
        assert results[r]["memory"] == {} and results[r]["stacked"] == {}


def test_ddp_tracer_merges_stacked_chunks(traced: Any) -> None:
    world, results, _ = traced
    stacked = results[0]["stacked"]["block.helper.doubled"]
    assert isinstance(stacked.values, torch.Tensor)
    assert stacked.ranks.dtype == torch.int64
    site = "block.helper.doubled"
    _assert_records(_as_records(stacked), _gathered(world, 2, [site])[site], "stacked")


def test_ddp_tracer_hdf5_file_is_written_by_rank0_only(traced: Any) -> None:
    import vartrace

    world, results, out = traced
    assert sorted(p.name for p in (out / "gather").iterdir()) == ["run.h5"]
    assert all(result["left_after_saver"] == {} for result in results)
    want = _gathered(world, 3, workers.PATHS)
    with vartrace.open(out / "gather" / "run.h5") as run:
        assert sorted(run.names) == sorted(workers.PATHS)
        for name in workers.PATHS:
            _assert_records(_file_records(run[name]), want[name], f"run.h5 {name}")
        assert run["block.helper.doubled"].calls(2, rank=1)[1].sum().item() == (
            (workers.rank_input(1, 2) * 4).sum().item()
        )


def test_ddp_tracer_shards_one_file_per_rank_read_as_one_run(traced: Any) -> None:
    import vartrace

    world, results, out = traced
    for r, result in enumerate(results):
        assert result["context"] == (r, world, True)
        assert result["left_after_shard_saver"] == {}
    files = sorted(p.name for p in (out / "shards").iterdir())
    shards = [f"run.rank{r}.h5" for r in range(world)]
    assert files == sorted([*shards, *(f"{shard}.manifest.json" for shard in shards)])
    per_rank = [_rank_records(r, workers.PATHS) for r in range(world)]
    with vartrace.open(str(out / "shards" / "run.rank*.h5")) as run:
        assert sorted(run.names) == sorted(workers.PATHS)
        for name in workers.PATHS:
            want = sorted(
                (
                    (value, step, r, order)
                    for r in range(world)
                    for site, value, step, order in per_rank[r]
                    if site == name
                ),
                key=lambda record: (record[1], record[2], record[3]),
            )
            _assert_records(_file_records(run[name]), want, f"shards {name}")


def test_a_rank_that_raises_inside_a_traced_ddp_step_leaves_no_rank_hanging(
    tmp_path: Path,
) -> None:
    world = 2
    codes = _launch("tracer_rank1_raises", world, tmp_path, pg_timeout=60.0)
    assert all(code not in (0, None) for code in codes), codes
    outcomes = _outcomes(tmp_path, world)
    assert outcomes[1]["type"] == "ValueError"
    assert outcomes[0]["runtime_error"], outcomes[0]


def test_ddp_example_runs_and_reads_its_files_back(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "ddp_tracing.py"
    done = subprocess.run(
        [sys.executable, str(example), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "1. stacked forward.x: (52, 8, 16) (records x padded batch x features)" in lines
    assert "   ranks [0, 1], true shapes [(4, 16), (8, 16)]" in lines
    assert "2. ddp.h5 forward.x: values (52, 8, 16), ranks [0, 1]" in lines
    assert "3. mean of forward.x per rank and gather: (14, 16)" in lines
    assert "4. shards read as one run: forward has 52 records," in lines
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "ddp.h5",
        "shards.rank0.h5",
        "shards.rank0.h5.manifest.json",
        "shards.rank1.h5",
        "shards.rank1.h5.manifest.json",
    ]


def test_staged_gathers_run_off_the_training_thread_with_no_sync(tmp_path: Path) -> None:
    """On the stand-in accelerator, records are gathered from the staging thread over the
    tracer's own gloo group while the training thread runs collectives on the default one:
    no rank waits for the device in its step, and rank 0 gathers what the synchronous path
    gathers on the CPU, bit for bit, into its file."""
    world = 2
    results = _run_ok("staged_gathers", world, tmp_path)
    for rank, result in enumerate(results):
        assert result["device"]["staging"] == "async" and result["cpu"]["staging"] == "sync"
        assert result["device"]["syncs"] == [], rank
    device, cpu = results[0]["device"]["records"], results[0]["cpu"]["records"]
    assert sorted(device) == sorted(cpu)
    assert "layers.0.attn._scores" in device and "head.weight@grad" in device
    for name, records in cpu.items():
        assert {r for _, _, r, _ in records} == {0, 1}, name
        assert device[name] == records, name


# --- ranks that run different numbers of iterations ------------------------------------


def _uneven_records(steps: dict[int, range]) -> list[tuple[str, Any, int, int, int]]:
    """(site, value, iteration, rank, order) of what each rank ``r`` records in the
    iterations ``steps[r]`` of the ``Evaluator``, sorted by site, rank and iteration."""
    records = []
    for r, iterations in steps.items():
        for step in iterations:
            x = workers.rank_input(r, step)
            records.append(("forward.x", x, step, r, 2 * step - 1))
            records.append(("forward.scores", x.sum(dim=1) * 2, step, r, 2 * step))
    return sorted(records, key=lambda record: (record[0], record[3], record[2]))


def _assert_uneven(got: list[tuple], want: list[tuple], where: str) -> None:
    """``got`` holds exactly the records of ``want`` (in any order), bit for bit."""
    got = sorted(got, key=lambda record: (record[0], record[3], record[2]))
    keys = [(site, rank, step) for site, _, step, rank, _ in got]
    wanted = [(site, rank, step) for site, _, step, rank, _ in want]
    assert keys == wanted, f"{where}: got (site, rank, iteration) {keys}, expected {wanted}"
    for g, w in zip(got, want, strict=True):
        _assert_same_value(g[1], w[1], f"{where} {w[0]} rank {w[3]} iteration {w[2]}")
        assert g[4] == w[4], f"{where} {w[0]} rank {w[3]} iteration {w[2]}: order {g[4]}"


@pytest.mark.parametrize("staging", ["sync", "async"])
@pytest.mark.parametrize("world", [2, 3], ids=["2ranks", "3ranks"])
def test_ranks_running_different_numbers_of_iterations_gather_every_record(
    tmp_path: Path, world: int, staging: str
) -> None:
    """Evaluation shards of 8/10/13 batches: the ranks issue different numbers of gathers.
    Every record of every rank reaches rank 0's results and its file, tagged with its rank
    and iteration, and no rank waits for the process group's timeout (15 s here: a gather
    left without its partners would fail the run)."""
    (tmp_path / "uneven.json").write_text(json.dumps({"staging": staging}))
    results = _run_ok("uneven_eval", world, tmp_path, pg_timeout=15.0, deadline=60.0)
    shortest_first = workers.uneven_steps(world, reverse=False)
    want = _uneven_records({r: range(1, n + 1) for r, n in enumerate(shortest_first)})
    _assert_uneven(results[0]["memory"], want, "results")
    shortest_last = workers.uneven_steps(world, reverse=True)
    want = _uneven_records({r: range(1, n + 1) for r, n in enumerate(shortest_last)})
    _assert_uneven(results[0]["file"], want, "uneven.h5")
    for r, result in enumerate(results):
        assert result["left_after_saver"] == [], r
        if r:
            assert result["memory"] == [], r


@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_rank_that_never_reaches_the_final_gather_is_waited_for_within_the_timeout(
    tmp_path: Path, staging: str
) -> None:
    """Rank 1 stays in its loop until rank 0 has left its tracer.  Rank 0 waits for it at
    exit no longer than the process group's timeout (3 s), warns naming rank 1 and writes
    every record it has; rank 1 then finds rank 0 gone, warns, and keeps its last records
    in its own results.  No record is lost, no rank raises."""
    (tmp_path / "uneven.json").write_text(json.dumps({"staging": staging}))
    rank0, rank1 = _run_ok("uneven_absent", 2, tmp_path, pg_timeout=3.0, deadline=60.0)
    gathered = range(1, workers.ABSENT_STEPS)  # the gather at iteration 2
    last = range(workers.ABSENT_STEPS, workers.ABSENT_STEPS + 1)
    want = _uneven_records({0: range(1, workers.ABSENT_STEPS + 1), 1: gathered})
    _assert_uneven(rank0["file"], want, "absent.h5")
    assert rank0["memory"] == []
    _assert_uneven(rank1["memory"], _uneven_records({1: last}), "rank 1's results")
    assert rank0["seconds"] < 15.0, rank0["seconds"]
    [absent] = [m for m in rank0["warnings"] if "rank(s) [1] did not come" in m]
    assert "rank 0 hands on its own last 2 records alone" in absent
    [kept] = [m for m in rank1["warnings"] if "rank(s) [0] did not come" in m]
    assert "this rank's last 2 records stay in tracer.results on rank 1" in kept


def test_rank_zero_describes_what_every_rank_reduced_and_aliased(tmp_path: Path) -> None:
    """With gather=True rank 0 writes every rank's records, so it must describe them as
    every rank saw them: a statistics site whose shard has another width on each rank
    reads as `(2, -1)`, one only rank 1 reduced is described at all, a name that is an
    alias on rank 1 only reads back, and a name that is an alias on rank 1 but held
    records of its own on rank 0 says where rank 1's are."""
    results = _run_ok("facts_of_every_rank", 2, tmp_path)
    zero = results[0]
    assert zero["reductions"] == {
        "forward.y": ("float32", (2, -1)),
        "forward.z": ("float64", (2, 6)),
    }
    assert zero["aliases"] == {"inner.t": "helper.t"}  # the argument is captured first
    for said in (zero["warnings0"], zero["warnings1"]):
        assert len(said) == 1 and "forward.t held the same tensor as helper.t" in said[0]
    file = zero["file"]
    assert file["forward.y"][0] == ("float32", (2, -1)) and file["forward.y"][1] == [0, 1]
    assert file["forward.z"][0] == ("float64", (2, 6)) and file["forward.z"][1] == [1]
    assert file["inner.t"] == (None, [1])  # reads as helper.t: rank 1's records
    assert file["forward.t"] == (None, [0])  # rank 0's own; rank 1's under helper.t
