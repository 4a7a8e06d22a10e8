"""Worker functions for ``tests/gathers/test_distributed.py``, importable by spawned ranks.

Each spawned process runs :func:`entry`, which joins a gloo process group over
127.0.0.1, runs one named scenario and pickles what the scenario returns to
``<out_dir>/result<rank>.pt`` (``torch.save``) (or the traceback to ``error<rank>.txt``), so
the parent test can assert on it.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vartrace.distributed import gathers as distributed
from vartrace.trace import Trace


def entry(rank: int, world: int, port: int, out_dir: str, scenario: str, pg_timeout: float) -> None:
    """Join the group, run ``scenario`` and write its result (spawned process target)."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        _wait_for_files(out, [f"ready{r}" for r in range(world)], create=f"ready{rank}")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = _scenario(scenario)(rank, world, out)
        torch.save(result, out / f"result{rank}.pt")
        if scenario not in UNSYNCED:
            dist.barrier()  # the safe shutdown order: no rank tears down while another works
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _scenario(name: str) -> Callable[[int, int, Path], Any]:
    """The scenario named ``name``: one of ``SCENARIOS``, or ``"module:function"`` (the
    scenarios of another worker module, e.g. ``tests._parallel_workers``)."""
    if ":" not in name:
        return SCENARIOS[name]
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def _wait_for_files(out: Path, names: list[str], *, create: str = "", limit: float = 60.0) -> None:
    """Wait (bounded) until every file in ``names`` exists under ``out``, after creating one.

    Used as a start line before ``init_process_group``, so that a short process
    group timeout cannot expire while a slow rank is still importing torch.
    """
    if create:
        (out / create).touch()
    end = time.monotonic() + limit
    while not all((out / name).exists() for name in names):
        if time.monotonic() > end:
            raise TimeoutError(f"waited {limit}s for {names} in {out}")
        time.sleep(0.02)


def _write_outcome(out: Path, rank: int, exc: BaseException, start: float) -> None:
    """Record how this rank ended: exception type, whether a RuntimeError, message, seconds."""
    outcome = {
        "type": type(exc).__name__,
        "runtime_error": isinstance(exc, RuntimeError),
        "message": str(exc),
        "seconds": time.monotonic() - start,
    }
    (out / f"outcome{rank}.json").write_text(json.dumps(outcome))


# --- hand-built chunks for gather_chunk ------------------------------------------------


class Opaque:
    """A non-leaf object: it travels pickled in the header."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.payload == self.payload

    def __hash__(self) -> int:
        return hash(repr(self.payload))


def _mixed_records(rank: int) -> list[Any]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
    return [
        base.to(torch.bfloat16),
        base.to(torch.float16),
        base > 105,
        torch.complex(base, -base),
        torch.complex(base, base).to(torch.complex128).conj(),
        base.to(torch.int8),
        base.to(torch.uint8),
        base.to(torch.int64) * 1_000_000_007,
        base.to(torch.float64) / 3,
        base.t(),
        torch.tensor(rank + 0.5),
        torch.zeros(0, 5, dtype=torch.float32),
        torch.arange(3 + rank, dtype=torch.float32) * (rank + 1),
        base.to(torch.float8_e4m3fn),
        np.arange(6, dtype=np.int16).reshape(2, 3) - rank,
        np.asarray(["a", "bc", f"rank{rank}"]),
        np.float32(rank + 0.25),
        rank,
        rank + 0.75,
        complex(rank, 1),
        True,
        f"text from {rank}",
        bytes([rank, 255, 0]),
        None,
        Opaque({"rank": rank, "items": (1, 2)}),
        torch.arange(150_000, dtype=torch.float32).to(torch.bfloat16) + rank,
        torch.arange(300_000) % (rank + 2) == 0,
        torch.complex(torch.arange(40_000.0), torch.full((40_000,), float(rank))),
        np.arange(200_000, dtype=np.int16).reshape(400, 500) * (rank + 1),
    ]


def build_chunk(rank: int, world: int, round_: int) -> dict[str, Trace]:
    """The deterministic chunk rank ``rank`` feeds to gather round ``round_``.

    Record counts differ by rank, the last rank of a 4-rank world has nothing
    at all in round 0, ``odd`` exists on odd ranks only (so never on rank 0),
    ``empty`` has no records anywhere, ``stacked`` was stacked by a pre-gather
    callback with rank-dependent shapes, ``half`` is stacked on even ranks and
    a list on odd ones.
    """
    if world == 4 and rank == 3 and round_ == 0:
        return {}
    order = iter(range(1000 * round_ + 100 * rank, 1000 * round_ + 100 * rank + 100))
    chunk: dict[str, Trace] = {}

    counts = Trace()
    for i in range(rank + 1 + round_):
        value = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank + 10 * i
        counts.append(value, 1 + round_ * 4 + i, rank, next(order))
    chunk["layers.0.attn.forward.scores"] = counts

    mixed = Trace()
    for i, value in enumerate(_mixed_records(rank + round_)):
        mixed.append(value, 7 + i, rank, next(order))
    chunk["forward.mixed/key with spaces"] = mixed

    if rank % 2 == 1:
        odd = Trace()
        odd.append(torch.full((rank,), float(rank)), 3, rank, next(order))
        chunk["odd.forward"] = odd

    chunk["empty.forward"] = Trace()

    n = rank + 1
    stacked = Trace(
        torch.arange(n * 2 * (rank + 2), dtype=torch.float64).reshape(n, 2, rank + 2) + rank,
        torch.arange(n, dtype=torch.int64) + 10,
        torch.full((n,), rank, dtype=torch.int64),
        torch.tensor([next(order) for _ in range(n)], dtype=torch.int64),
    )
    chunk["stacked.forward"] = stacked

    if rank % 2 == 0:
        half = Trace(
            torch.zeros(2, 4, dtype=torch.int32) + rank,
            torch.tensor([1, 2]),
            torch.tensor([rank, rank]),
            torch.tensor([next(order), next(order)]),
            [(2,), (4,)],
        )
    else:
        half = Trace()
        half.append(torch.ones(3, dtype=torch.int32) * rank, 5, rank, next(order))
    chunk["half.forward"] = half
    return chunk


def _local_object() -> Any:
    """An object whose class lives in a module that only this process has."""
    module = types.ModuleType("only_on_this_rank")
    module.Local = type("Local", (), {"__module__": "only_on_this_rank"})
    sys.modules["only_on_this_rank"] = module
    return module.Local()


def _gather_direct(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Three gathers of hand-built chunks, one in several transfer rounds, then failures."""
    rounds = [distributed.gather_chunk(build_chunk(rank, world, r)) for r in range(3)]

    distributed._ROUND_BYTES = 1 << 18
    big = Trace()
    big.append(torch.arange(300_000, dtype=torch.float32) * (rank + 1), 1, rank, 0)
    chunked = distributed.gather_chunk({"big": big})

    errors = []
    cases: list[tuple[int, Callable[[], Trace]]] = [
        (1, lambda: Trace([lambda: 0], [1], [1], [0])),
        (0, lambda: Trace([1, 2], [1], [0], [0])),
        (1, lambda: Trace([_local_object(), big.values[0]], [1, 1], [1, 1], [0, 1])),
    ]
    for culprit, bad in cases:
        chunk = {"bad": bad()} if rank == culprit else {"fine": Trace([rank], [1], [rank], [0])}
        try:
            errors.append(distributed.gather_chunk(chunk))
        except RuntimeError as exc:
            errors.append(str(exc))
    after = distributed.gather_chunk({"after": Trace([rank * 2], [9], [rank], [0])})
    return {"rounds": rounds, "chunked": chunked, "errors": errors, "after": after}


# --- failure of one rank ---------------------------------------------------------------


def _rank1_raises(rank: int, world: int, out: Path, *, linger: bool) -> None:
    """Rank 1 raises instead of reaching the second gather; the others gather.

    With ``linger`` rank 1 stays alive (as if a handler caught the error) until
    every other rank has recorded how it ended, so only the process group's
    timeout can release them.
    """
    start = time.monotonic()
    trace = Trace([torch.ones(2) * rank], [1], [rank], [0])
    distributed.gather_chunk({"x": trace})
    try:
        if rank == 1:
            raise ValueError("rank 1 failed inside the traced step")
        distributed.gather_chunk({"x": trace})
    except BaseException as exc:
        _write_outcome(out, rank, exc, start)
        if rank == 1 and linger:
            others = [f"outcome{r}.json" for r in range(world) if r != 1]
            _wait_for_files(out, others, limit=90.0)
        raise


def _rank1_raises_and_exits(rank: int, world: int, out: Path) -> None:
    _rank1_raises(rank, world, out, linger=False)


def _rank1_raises_and_lingers(rank: int, world: int, out: Path) -> None:
    _rank1_raises(rank, world, out, linger=True)


# --- tracer end to end -----------------------------------------------------------------


class Block(nn.Module):
    """A layer with a helper method that rank 1 calls more often than the others."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, repeats: int) -> torch.Tensor:
        for _ in range(repeats):
            x = self.helper(x)
        return self.lin(x)

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2
        return doubled


class Net(nn.Module):
    """A tiny model whose traced values are exact functions of its input.

    A batch of ``FAILING_BATCH`` rows makes its forward raise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == FAILING_BATCH:
            raise ValueError("rank 1 failed inside the traced step")
        repeats = 2 if x[0, 0].item() >= 1000 else 1
        hidden = self.block(x, repeats)
        return self.head(hidden)


def rank_input(rank: int, step: int) -> torch.Tensor:
    """The known input rank ``rank`` feeds at 1-based iteration ``step``."""
    base = 1000.0 if rank == 1 else 0.0
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) + base + 100 * rank + step


PATHS = ["forward.x", "block.helper.doubled", "block.forward.repeats"]
STEPS = 5
FAILING_BATCH = 3


def _wrap(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    ddp = nn.parallel.DistributedDataParallel(model)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def _train(
    ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, *, fail_at: int | None = None
) -> None:
    for step in range(1, STEPS + 1):
        x = rank_input(rank, step)
        if step == fail_at and rank == 1:
            x = x[:1].expand(FAILING_BATCH, -1)
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()


def _new_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


class _ContextSpy:
    """A post-gather callback that only remembers the RunContext it was started with."""

    def __init__(self) -> None:
        self.context: Any = None

    def on_start(self, context: Any) -> None:
        self.context = context

    def __call__(self, name: str, trace: Trace) -> None:
        return None


def _results(tracer: Any) -> dict[str, Trace]:
    return {name: tracer.results[name] for name in tracer.results}


def _tracer_runs(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Traced DDP trainings: in memory (lists, and stacked before the gather), into one
    HDF5 file on rank 0, and into per-rank shard files with ``gather=False``."""
    from vartrace import H5PYSaverCallback, ModelTracer, stack_padded_tensors

    model = _new_model()
    ddp, opt = _wrap(model)
    found: dict[str, Any] = {}
    with ModelTracer(ddp, PATHS, gathering_interval=2) as tracer:
        _train(ddp, opt, rank)
    found["memory"] = _results(tracer)

    stacking = [stack_padded_tensors]
    with ModelTracer(
        ddp, ["block.helper.doubled"], pre_gather_callbacks=stacking, gathering_interval=2
    ) as tracer:
        _train(ddp, opt, rank)
    found["stacked"] = _results(tracer)

    (out / "gather").mkdir(exist_ok=True)
    saver = H5PYSaverCallback(out / "gather" / "run.h5", metadata=False)
    with ModelTracer(ddp, PATHS, post_gather_callbacks=[saver], gathering_interval=3) as tracer:
        _train(ddp, opt, rank)
    saver.close()
    found["left_after_saver"] = _results(tracer)

    (out / "shards").mkdir(exist_ok=True)
    spy = _ContextSpy()
    saver = H5PYSaverCallback(out / "shards" / "run.h5", metadata=False)
    with ModelTracer(
        ddp, PATHS, post_gather_callbacks=[spy, saver], gathering_interval=2, gather=False
    ) as tracer:
        _train(ddp, opt, rank)
    saver.close()
    found["left_after_shard_saver"] = _results(tracer)
    ctx = spy.context
    found["context"] = (ctx.rank, ctx.world_size, ctx.sharded)
    return found


def _tracer_rank1_raises(rank: int, world: int, out: Path) -> None:
    """Rank 1's traced forward raises in its third step while the others train on."""
    from vartrace import ModelTracer

    model = _new_model()
    ddp, opt = _wrap(model)
    start = time.monotonic()
    try:
        with ModelTracer(ddp, PATHS, gathering_interval=1):
            _train(ddp, opt, rank, fail_at=3)
    except BaseException as exc:
        _write_outcome(out, rank, exc, start)
        raise


# --- asynchronous staging on the stand-in accelerator -------------------------------------

STAGED_PATHS = ["layers.*", "layers.*.attn._scores", "layers.*@grad", "head.weight@grad"]


def _staged_run(rank: int, on_device: bool, out: Path) -> dict[str, Any]:
    """Three steps of a small transformer, traced and gathered every step, with a saver on
    rank 0 and a collective on the default group after every step (as DDP's would be)."""
    import vartrace
    from tests import simgpu
    from tests._models import TinyTransformer, tokens
    from vartrace import H5PYSaverCallback, ModelTracer

    torch.manual_seed(0)
    model = TinyTransformer()
    if on_device:
        model = simgpu.to_device_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = H5PYSaverCallback(out / f"staged-{on_device}.h5", metadata=False)
    simgpu.LOG.clear()
    with ModelTracer(model, STAGED_PATHS, post_gather_callbacks=[saver], staging="auto") as tracer:
        for step in range(3):
            batch = tokens(10 * rank + step)
            with simgpu.LOG.paused():
                batch = simgpu.to_device(batch) if on_device else batch
            model(batch).logits.logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(torch.ones(1))  # the training thread's own collective
    saver.close()
    records: dict[str, list[Any]] = {}
    if rank == 0:
        with vartrace.open(out / f"staged-{on_device}.h5") as run:
            for name in run.names:
                site = run[name]
                records[name] = [
                    (site.record(row).reshape(-1).view(torch.uint8).tolist(), *tags)
                    for row, tags in enumerate(
                        zip(site.iterations, site.ranks, site.order, strict=True)
                    )
                ]
    return {
        "staging": tracer.staging,
        "records": records,
        "syncs": [(e.op, e.thread, e.where) for e in simgpu.LOG.syncs()],
    }


def _staged_gathers(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The same training on the stand-in accelerator (asynchronous staging: gathers on the
    tracer's own group, from its staging thread) and on the CPU (the synchronous path)."""
    return {"device": _staged_run(rank, True, out), "cpu": _staged_run(rank, False, out)}


# --- ranks that run different numbers of iterations ---------------------------------------

UNEVEN_STEPS = (8, 10, 13)
UNEVEN_PATHS = ["forward.x", "forward.scores"]


class Evaluator(nn.Module):
    """A model evaluated on shards of different sizes: no collective of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x.sum(dim=1) * 2
        return self.head(x) + scores[:, None]


def uneven_steps(world: int, reverse: bool) -> list[int]:
    """How many iterations each rank runs: 8, 10 and 13 (8 and 13 on two ranks), the
    shortest rank first or (``reverse``) last."""
    steps = list(UNEVEN_STEPS if world == 3 else UNEVEN_STEPS[::2])
    return steps[::-1] if reverse else steps


def _site_records(traces: Any, names: list[str]) -> list[tuple[str, Any, int, int, int]]:
    """(site, value, iteration, rank, order) of every record of ``names`` in ``traces``
    (a tracer's results, or a run file read with ``vartrace.open``)."""
    records = []
    for name in sorted(names):
        site = traces[name]
        tags = (np.asarray(t).tolist() for t in (site.iterations, site.ranks, site.order))
        for i, (iteration, rank, order) in enumerate(zip(*tags, strict=True)):
            value = site.values[i] if isinstance(site, Trace) else site.record(i)
            records.append((name, value, iteration, rank, order))
    return records


def _imported(rank: int, world: int, out: Path) -> None:
    """A start line after the imports (``torch._dynamo`` too, which a tracer's start imports),
    outside the process group: a rank still importing must not make the others' first gather
    wait longer than a short group timeout."""
    importlib.import_module("torch._dynamo")
    _wait_for_files(out, [f"imported{r}" for r in range(world)], create=f"imported{rank}")


def _evaluate(model: nn.Module, rank: int, steps: int) -> None:
    with torch.no_grad():
        for step in range(1, steps + 1):
            model(rank_input(rank, step))


def _uneven_eval(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Evaluation on shards of 8/10/13 batches, traced into memory (gathered every 2
    iterations) and into a file on rank 0 (every 3, the shortest rank last), with the
    staging ``uneven.json`` names."""
    import vartrace
    from vartrace import H5PYSaverCallback, ModelTracer

    staging = json.loads((out / "uneven.json").read_text())["staging"]
    torch.manual_seed(0)
    model = Evaluator().eval()
    _imported(rank, world, out)
    found: dict[str, Any] = {}
    with ModelTracer(
        model, UNEVEN_PATHS, mode="eval", gathering_interval=2, staging=staging
    ) as tracer:
        _evaluate(model, rank, uneven_steps(world, False)[rank])
    found["memory"] = _site_records(tracer.results, list(tracer.results))

    saver = H5PYSaverCallback(out / "uneven.h5", metadata=False)
    with ModelTracer(
        model,
        UNEVEN_PATHS,
        mode="eval",
        gathering_interval=3,
        staging=staging,
        post_gather_callbacks=[saver],
    ) as tracer:
        _evaluate(model, rank, uneven_steps(world, True)[rank])
    saver.close()
    found["left_after_saver"] = _site_records(tracer.results, list(tracer.results))
    if rank == 0:
        with vartrace.open(out / "uneven.h5") as run:
            found["file"] = _site_records(run, run.names)
    return found


ABSENT_STEPS = 3


def _uneven_absent(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Rank 1 stays in its traced loop until rank 0 has left its tracer: rank 0 waits for
    it at exit no longer than the process group's timeout, then rank 1 finds rank 0 gone.

    Both run ``ABSENT_STEPS`` iterations gathered every 2 (the first two are gathered
    together); rank 0 writes a file.  Returns each rank's records left in memory, rank 0's
    file and the warnings each rank saw.
    """
    import warnings

    import vartrace
    from vartrace import H5PYSaverCallback, ModelTracer

    staging = json.loads((out / "uneven.json").read_text())["staging"]
    torch.manual_seed(0)
    model = Evaluator().eval()
    saver = H5PYSaverCallback(out / "absent.h5", metadata=False)
    _imported(rank, world, out)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ModelTracer(
            model,
            UNEVEN_PATHS,
            mode="eval",
            gathering_interval=2,
            staging=staging,
            post_gather_callbacks=[saver],
        ) as tracer:
            _evaluate(model, rank, ABSENT_STEPS)
            if rank == 1:
                _wait_for_files(out, ["left0"])
        (out / f"left{rank}").touch()
    saver.close()
    found: dict[str, Any] = {
        "memory": _site_records(tracer.results, list(tracer.results)),
        "warnings": [str(w.message) for w in seen],
        "seconds": time.monotonic() - start,
    }
    if rank == 0:
        with vartrace.open(out / "absent.h5") as run:
            found["file"] = _site_records(run, run.names)
    return found


class Sharded(nn.Module):
    """Values that differ by rank, as under tensor parallelism: each rank's shard of `x`
    has another width, and rank 1 alone binds `z` and hands `t` down to helpers."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 3.0
        t = x * 2.0
        if self.rank == 1:
            z = x.double()
            self.helper(t)
            return y.sum() + z.sum()
        return y.sum() + t.sum()

    def helper(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner(t)

    def inner(self, t: torch.Tensor) -> torch.Tensor:
        return t + 1.0


def _facts_of_every_rank(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Statistics of `forward.y` (a shard of another width on each rank) and
    `forward.z` (rank 1 only), `**.t` aliased on rank 1 only: three steps gathered
    every 2, into memory, then into a file on rank 0, with the warnings each rank saw."""
    import warnings

    import vartrace
    from vartrace import H5PYSaverCallback, ModelTracer

    model = Sharded(rank)
    found: dict[str, Any] = {}
    for saver in (None, H5PYSaverCallback(out / "facts.h5", metadata=False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with ModelTracer(
                model,
                ["forward.y", "forward.z", "**.t"],
                gathering_interval=2,
                pre_save_callbacks=[vartrace.stats(sites=["forward.y", "forward.z"])],
                post_gather_callbacks=[] if saver is None else [saver],
            ) as tracer:
                for step in range(1, 4):
                    model(torch.full((2, 4 + 2 * rank), float(step)))
        if saver is None:
            reductions = tracer.results.reductions
            found["reductions"] = {k: (v.dtype, v.shape) for k, v in reductions.items()}
            found["aliases"] = tracer.results.aliases
        else:
            saver.close()
        found[f"warnings{saver is not None:d}"] = [
            str(w.message) for w in seen if "another rank" in str(w.message)
        ]
    if rank == 0:
        with vartrace.open(out / "facts.h5") as run:
            found["file"] = {
                name: (run[name].reduced_from, sorted(set(run[name].ranks.tolist())))
                for name in run.names
            }
    return found


SCENARIOS: dict[str, Callable[[int, int, Path], Any]] = {
    "gather_direct": _gather_direct,
    "rank1_raises_and_exits": _rank1_raises_and_exits,
    "rank1_raises_and_lingers": _rank1_raises_and_lingers,
    "tracer_runs": _tracer_runs,
    "tracer_rank1_raises": _tracer_rank1_raises,
    "staged_gathers": _staged_gathers,
    "uneven_eval": _uneven_eval,
    "uneven_absent": _uneven_absent,
    "facts_of_every_rank": _facts_of_every_rank,
}

UNSYNCED = {"uneven_absent"}  # scenarios that end with the group broken: no closing barrier
