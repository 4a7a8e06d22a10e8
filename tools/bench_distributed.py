"""Overhead of tracing a DDP training step on gloo ranks, as ratios to the untraced DDP step.

Usage::

    python tools/bench_distributed.py                  # 2 and 4 ranks
    python tools/bench_distributed.py --worlds 2 --rounds 4

Each rank trains the ``small`` GPT-style model of ``tools/bench_overhead.py``
(4 blocks, d_model 256, 4 heads, seq 128, batch 8; rank-specific tokens)
wrapped in ``DistributedDataParallel`` on a gloo group over 127.0.0.1, with
one torch thread per rank (more ranks than cores are oversubscribed: the
ratios stay meaningful because every contender runs under the same load).
Contenders, run round-robin so that machine noise hits them alike:

- ``untraced``: the plain DDP step;
- ``gather``: ``layers.*.attn.forward.scores`` traced, gathered to rank 0
  every 8 iterations and streamed into one HDF5 file by rank 0 (``metadata=False``:
  metadata is written when the file opens, outside the timed windows anyway);
- ``gather-bg``: as ``gather``, with ``H5PYSaverCallback(background=True)``: rank 0
  writes on a thread while the ranks train on;
- ``shards``: the same with ``gather=False``: every rank writes its own shard.

``--no-save`` replaces the saver by a callback that empties each chunk, to
separate the cost of the gather from the cost of writing.

A gather runs once every 8 steps, so a per-step median would miss it: each
sample is a window of 16 consecutive steps (holding two gathers) that ends
when rank 0's saver has written everything (so a background writer gets
credit only for the writes it overlaps with training), and every round runs
one window of each contender, in a rotating order, each in a fresh tracer
and file (deleted afterwards).  The table shows rank 0's median
wall time per step and its ratio to the untraced one (the bars of the issue
apply to it), and, as a figure that shared or oversubscribed machines disturb
less, the median CPU time per step summed over all ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import free_port, parser, rotated, versions
from _model import build_model

from vartrace import H5PYSaverCallback, ModelTracer, Trace

PATHS = ["layers.*.attn.forward.scores"]
INTERVAL = 8
WINDOW = 2 * INTERVAL
CONTENDERS = ("untraced", "gather", "gather-bg", "shards")


def _worker(rank: int, world: int, port: int, out: str, rounds: int, save: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    try:
        wall, cpu = _measure(rank, Path(out), rounds, save)
        cpus: list[Any] = [None] * world
        dist.all_gather_object(cpus, cpu)
        if rank == 0:
            medians = {
                name: {
                    "wall": statistics.median(wall[name]),
                    "cpu": statistics.median(
                        sum(per_rank) for per_rank in zip(*(c[name] for c in cpus), strict=True)
                    ),
                }
                for name in CONTENDERS
            }
            (Path(out) / "medians.json").write_text(json.dumps(medians))
        # Every rank is done with its collectives before any tears its connections down:
        # gloo aborts a process whose peer closes a connection under a pending operation.
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Discard:
    """Stands in for the saver with ``--no-save``: empties each chunk, writes nothing."""

    path = Path(os.devnull)

    def __call__(self, name: str, trace: Trace) -> None:
        trace.clear()

    def flush(self, *, wait: bool = False) -> None:
        return None

    def close(self) -> None:
        return None


def _measure(
    rank: int, out: Path, rounds: int, save: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per contender: wall seconds per step of each window, and this rank's CPU seconds."""
    model, _ = build_model("small")
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(rank))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()

    @contextlib.contextmanager
    def traced(stem: str, gather: bool, background: bool = False) -> Iterator[Callable[[], None]]:
        saver: Any = (
            H5PYSaverCallback(out / f"{stem}.h5", metadata=False, background=background)
            if save
            else _Discard()
        )
        try:
            with ModelTracer(
                ddp,
                PATHS,
                post_gather_callbacks=[saver],
                gathering_interval=INTERVAL,
                gather=gather,
            ):
                yield lambda: saver.flush(wait=True)
        finally:
            saver.close()
            if rank == 0 or not gather:
                Path(saver.path).unlink(missing_ok=True)

    contexts: dict[str, Callable[[int], contextlib.AbstractContextManager[Any]]] = {
        "untraced": lambda _: contextlib.nullcontext(lambda: None),
        "gather": lambda i: traced(f"gather{i}", True),
        "gather-bg": lambda i: traced(f"gatherbg{i}", True, background=True),
        "shards": lambda i: traced(f"shards{i}", False),
    }
    for _ in range(2):
        step()
    wall: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for index in range(rounds):
        for name in rotated(CONTENDERS, index):
            with contexts[name](index) as drain:
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(WINDOW):
                    step()
                drain()
                wall[name].append((time.perf_counter() - start) / WINDOW)
                cpu[name].append((time.process_time() - start_cpu) / WINDOW)
    return wall, cpu


def bench(world: int, rounds: int, save: bool = True) -> dict[str, dict[str, float]]:
    """Per contender, on a ``world``-rank group: rank 0's median wall time per step
    (``"wall"``) and the median CPU time per step summed over all ranks (``"cpu"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, free_port(), tmp, rounds, save)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return json.loads((Path(tmp) / "medians.json").read_text())


def _table(results: dict[int, dict[str, dict[str, float]]], save: bool) -> str:
    sink = "HDF5 saver" if save else "chunks discarded (--no-save)"
    lines = [
        f"DDP step of the 'small' model, gloo, 1 torch thread per rank, {os.cpu_count()} cores, "
        f"{versions()}",
        f"tracing {', '.join(PATHS)}, gathering_interval={INTERVAL}, {sink}",
        f"{'ranks':>5}  {'contender':<9}  {'wall/step':>10}  {'ratio':>6}  {'bar':<8}"
        f"  {'CPU/step, all ranks':>19}  {'ratio':>6}",
    ]
    bars = {"untraced": None, "gather": 1.15, "gather-bg": 1.15, "shards": 1.08}
    for world, medians in results.items():
        base = medians["untraced"]
        for name in CONTENDERS:
            wall, cpu = medians[name]["wall"], medians[name]["cpu"]
            ratio = wall / base["wall"]
            bar = bars[name]
            verdict = "" if bar is None else f"{bar:.2f} {'ok' if ratio <= bar else 'OVER'}"
            lines.append(
                f"{world:>5}  {name:<9}  {wall * 1e3:7.1f} ms  {ratio:5.3f}x  {verdict:<8}"
                f"  {cpu * 1e3:16.1f} ms  {cpu / base['cpu']:5.3f}x"
            )
    return "\n".join(lines)


def main() -> None:
    arguments = parser(__doc__, rounds=8)
    arguments.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    arguments.add_argument(
        "--no-save", action="store_true", help="discard gathered chunks: isolates the gather"
    )
    args = arguments.parse_args()
    save = not args.no_save
    results = {world: bench(world, args.rounds, save) for world in args.worlds}
    print(_table(results, save))


if __name__ == "__main__":
    main()
