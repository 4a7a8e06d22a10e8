"""Statistics mode on the CPU: the eager formulation against the fused op, per record and per step.

Usage::

    python tools/bench_stats.py                          # both tables
    python tools/bench_stats.py --sizes 4096 65536 --rounds 3 --block 3
    python tools/bench_stats.py --instructions           # statistics vs clone, under callgrind

Per record, for each size and dtype (float32, bfloat16), in one process:

* **eager**: :func:`vartrace.statistics.kernels.eager_summary` and the header joined on,
  the torch formulation ``StatsReducer._device`` ran per record before the fused op (and
  what a device without a kernel of the op still runs): a float64 copy and ~45 ops;
* **fused**: ``vartrace.stats()`` on the tensor: ``torch.ops.vartrace.summary``, which
  writes the header too (numpy blocks on the CPU);
* **clone**: ``x.clone()``, what keeping the record whole costs at least;

with the ops each dispatches on the calling thread (a ``TorchDispatchMode``), the median
time of a record (the contenders' calls interleaved) and its time per element.

Per step: the ``small`` model of ``tools/bench_overhead.py`` (forward, backward and SGD),
untraced, recording ``layers.*`` and ``layers.*@grad`` whole, and reducing them with
``vartrace.stats()``, round-robin; each chunk is discarded after the gather.

``--instructions`` counts instead of timing (time is noise on a loaded machine, instructions
are not): the statistics record ``vartrace.stats()`` makes of a float32 tensor, and the
clone that records it whole, for a 1 MiB record (262,144 values) and a tiny one (64), in
one child process under callgrind (one torch thread), instrumented for each contender's
``CALLS`` calls only; then the same statistics timed per value in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import (
    Context,
    add_threads,
    handshake,
    instructions_by_window,
    need_callgrind,
    parser,
    round_robin,
    set_threads,
    table,
    timed_calls,
    traced,
)
from _model import training_step
from torch.utils._python_dispatch import TorchDispatchMode

import vartrace
from vartrace.statistics.kernels import eager_summary

SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
INSTRUCTION_SIZES = {1 << 18: 20, 64: 2000}  # float32 values of a record: calls counted
DTYPES = [torch.float32, torch.bfloat16]
STEP_PATHS = ["layers.*", "layers.*@grad"]


class _Count(TorchDispatchMode):
    """Counts the ops dispatched on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def record_table(sizes: list[int], budget: float) -> str:
    reducer = vartrace.stats()
    header = torch.tensor([reducer.layout.header], dtype=torch.float64)
    contenders: dict[str, Callable[[torch.Tensor], object]] = {
        "eager": lambda x: torch.cat([header, eager_summary(x)]),
        "fused": lambda x: reducer("site", x, 1),
        "clone": lambda x: x.clone(),
    }
    lines = [
        f"{'elements':>10} {'dtype':>9} | "
        + " | ".join(f"{name:>5} ops {'time':>9} {'ns/el':>6}" for name in contenders)
        + " | eager/fused"
    ]
    for size in sizes:
        for dtype in DTYPES:
            x = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(dtype)
            ops = {}
            for name, fn in contenders.items():
                fn(x)  # the op registered, constants made: not counted
                with _Count() as count:
                    fn(x)
                ops[name] = count.ops
            calls = {name: (lambda fn=fn, x=x: fn(x)) for name, fn in contenders.items()}
            times = timed_calls(calls, budget)
            cells = [
                f"{ops[name]:>9} {times[name] * 1e3:>7.3f}ms {times[name] / size * 1e9:>6.2f}"
                for name in contenders
            ]
            name = str(dtype).removeprefix("torch.")
            ratio = times["eager"] / times["fused"]
            lines.append(f"{size:>10} {name:>9} | " + " | ".join(cells) + f" | {ratio:>10.2f}x")
    return "\n".join(lines)


def step_table(rounds: int, block: int) -> str:
    model, step = training_step("small")
    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "whole records": lambda: traced(model, STEP_PATHS),
        "vartrace.stats()": lambda: traced(
            model, STEP_PATHS, pre_save_callbacks=[vartrace.stats()]
        ),
    }
    times = round_robin(contenders, step, rounds, block)
    base = times["untraced"]
    lines = [f"small model step, {', '.join(STEP_PATHS)} ({rounds} rounds x {block} steps):"]
    for name, seconds in times.items():
        lines.append(f"  {name:<18} {seconds * 1e3:8.2f} ms  {seconds / base:6.3f}x")
    return "\n".join(lines)


def _record_calls(size: int) -> dict[str, Callable[[], object]]:
    """``--instructions``' contenders on a float32 record of ``size`` values."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(0))
    reducer = vartrace.stats()
    return {"statistics": lambda: reducer("site", x, 1), "clone": x.clone}


def instructions_child() -> None:
    """:func:`instruction_table`'s side under callgrind: for each size and contender, warm
    up, then its calls between two handshakes (instrumentation on, then off)."""
    torch.set_num_threads(1)
    for size, calls in INSTRUCTION_SIZES.items():
        for call in _record_calls(size).values():
            for _ in range(3):
                call()
            handshake()
            for _ in range(calls):
                call()
            handshake()


def instruction_table(budget: float) -> str:
    """Instructions a call of each contender, per value, and statistics over clone; then
    the statistics' time per value (median of interleaved calls, this process)."""
    need_callgrind(control=True)
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        argv = [__file__, "--_instructions-child"]
        names = tuple(_record_calls(1))  # the contenders, in the order the child runs them
        windows = iter(
            instructions_by_window(
                argv, Path(folder) / "callgrind.out", env, len(INSTRUCTION_SIZES) * len(names)
            )
        )
        for size, calls in INSTRUCTION_SIZES.items():
            counts = {name: next(windows) / calls for name in names}
            seconds = timed_calls(_record_calls(size), budget)["statistics"]
            rows.append(
                [
                    f"{size:,}",
                    *(f"{counts[name]:,.0f} ({counts[name] / size:.2f}/value)" for name in counts),
                    f"{counts['statistics'] / counts['clone']:.2f}x",
                    f"{seconds / size * 1e9:.2f} ns",
                ]
            )
    header = ["float32 values", "statistics Ir", "clone Ir", "ratio", "statistics time/value"]
    title = "a record's instructions under callgrind (one torch thread), and its time per value"
    return "\n".join([title, *table(header, rows)])


def main(argv: list[str] | None = None) -> int:
    arguments = parser(__doc__, rounds=5, block=4)
    add_threads(arguments, default=1)
    arguments.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="elements a record")
    arguments.add_argument("--budget", type=float, default=2.0, help="seconds per record row")
    arguments.add_argument(
        "--instructions", action="store_true", help="count instructions under callgrind"
    )
    arguments.add_argument("--_instructions-child", action="store_true", help=argparse.SUPPRESS)
    args = arguments.parse_args(argv)
    set_threads(args.threads)
    if args._instructions_child:
        instructions_child()
        return 0
    if args.instructions:
        print(f"torch {torch.__version__}, {args.threads} intra-op thread(s); CPU")
        print(instruction_table(args.budget))
        return 0
    print(f"torch {torch.__version__}, {args.threads} intra-op thread(s); CPU")
    print(record_table(args.sizes, args.budget))
    print(step_table(args.rounds, args.block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
