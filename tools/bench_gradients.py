"""Cost of ``@grad`` tracing: step-time ratios to an untraced step, and memory over long runs.

Usage::

    python tools/bench_gradients.py --size tiny       # overhead, Python-bound step
    python tools/bench_gradients.py --size small      # overhead, compute-bound step
    python tools/bench_gradients.py --memory          # peak RSS after 100 vs 1,000 steps

Overhead: contenders run round-robin (a block of steps each, many rounds)
on the model of ``tools/bench_overhead.py``, so machine noise hits them
alike; the table shows the median full training step (forward, backward,
SGD) and its ratio to the untraced median.  Traced contenders discard each
chunk after the gather (as the HDF5 saver does).  The bar is
``layers.*.attn.forward.scores@grad`` at 1.2x or less.

Memory: each run is a fresh subprocess that trains for N steps with
``@grad`` tracing (locals, block outputs, every parameter) and a
discarding callback, then reports its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``); 1,000 steps must not
peak higher than 100 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

_TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(_TOOLS))
sys.path.insert(0, str(_TOOLS.parent))

from bench_overhead import SIZES, step_table, training_step  # noqa: E402

from vartrace.trace import Trace  # noqa: E402

SCORES_GRAD = "layers.*.attn.forward.scores@grad"
MEMORY_PATHS = [SCORES_GRAD, "layers.*@grad", "layers.*.forward.self@grad"]

Context = Callable[[], contextlib.AbstractContextManager[None]]


def _discard(name: str, trace: Trace) -> None:
    trace.clear()


def bench_overhead(size: str, rounds: int, block: int) -> str:
    """Median step time untraced and with ``@grad`` tracing, as a table of ratios."""
    import torch

    from vartrace.tracing.tracer import ModelTracer

    model, step = training_step(size)

    @contextlib.contextmanager
    def untraced() -> Iterator[None]:
        yield

    def tracer(paths: list[str]) -> Context:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            with ModelTracer(model, paths, post_gather_callbacks=[_discard]):
                yield

        return context

    @contextlib.contextmanager
    def module_hooks() -> Iterator[None]:
        kept: list[torch.Tensor] = []

        def on_output(module: object, args: object, output: torch.Tensor) -> None:
            output.register_hook(lambda grad: kept.append(grad.detach().clone()))

        handles = [layer.register_forward_hook(on_output) for layer in model.layers]
        yield
        for handle in handles:
            handle.remove()

    contenders: dict[str, Context] = {
        "untraced": untraced,
        "vartrace: layers.*.attn.forward.scores (values)": tracer(["layers.*.attn.forward.scores"]),
        f"vartrace: {SCORES_GRAD}": tracer([SCORES_GRAD]),
        "forward hooks + register_hook cloning block output grads": module_hooks,
        "vartrace: layers.*@grad (block output grads)": tracer(["layers.*@grad"]),
        "vartrace: layers.*.forward.self@grad (all block params)": tracer(
            ["layers.*.forward.self@grad"]
        ),
    }
    return step_table(size, contenders, step, rounds, block)


def _peak_rss_child(size: str, steps: int, traced: bool) -> None:
    """Train ``steps`` steps in this process and print the peak RSS in KiB."""
    from vartrace.tracing.tracer import ModelTracer

    model, step = training_step(size)
    tracing = (
        ModelTracer(model, MEMORY_PATHS, post_gather_callbacks=[_discard])
        if traced
        else contextlib.nullcontext()
    )
    with tracing:
        for _ in range(steps):
            step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def bench_memory(size: str, threads: int) -> str:
    """Peak RSS of fresh processes after 100 and 1,000 steps, untraced and ``@grad``-traced."""
    rows = []
    for traced in (False, True):
        peaks = []
        for steps in (100, 1000):
            command = [sys.executable, __file__, "--rss-child", str(steps), "--size", size]
            command += ["--threads", str(threads)] + (["--traced"] if traced else [])
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            peaks.append(int(output.split()[-1]))
        rows.append(("@grad traced" if traced else "untraced", *peaks))
    lines = [
        f"--memory --size {size}: peak RSS (ru_maxrss) of a fresh process after N training steps",
        f"traced paths: {', '.join(MEMORY_PATHS)}; chunks discarded after each gather",
        f"{'run':<13}  {'100 steps':>12}  {'1000 steps':>12}  {'growth':>10}",
    ]
    for name, short, long in rows:
        growth = f"{(long - short) / 1024:+.1f} MiB"
        lines.append(f"{name:<13}  {short / 1024:8.1f} MiB  {long / 1024:8.1f} MiB  {growth:>10}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--memory", action="store_true", help="peak RSS, 100 vs 1,000 steps")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.rss_child:
        _peak_rss_child(args.size, args.rss_child, args.traced)
    elif args.memory:
        print(bench_memory(args.size, args.threads))
    else:
        print(bench_overhead(args.size, args.rounds, args.block))


if __name__ == "__main__":
    main()
