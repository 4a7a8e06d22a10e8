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
from collections.abc import Iterator

from _harness import Context, add_threads, fresh, last_int, parser, set_threads, traced
from _model import add_size, training_step
from _overhead.steps import step_table

SCORES_GRAD = "layers.*.attn.forward.scores@grad"
MEMORY_PATHS = [SCORES_GRAD, "layers.*@grad", "layers.*.forward.self@grad"]


def bench_overhead(size: str, rounds: int, block: int) -> str:
    """Median step time untraced and with ``@grad`` tracing, as a table of ratios."""
    import torch

    model, step = training_step(size)

    def tracer(paths: list[str]) -> Context:
        return lambda: traced(model, paths)

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
        "untraced": contextlib.nullcontext,
        "vartrace: layers.*.attn.forward.scores (values)": tracer(["layers.*.attn.forward.scores"]),
        f"vartrace: {SCORES_GRAD}": tracer([SCORES_GRAD]),
        "forward hooks + register_hook cloning block output grads": module_hooks,
        "vartrace: layers.*@grad (block output grads)": tracer(["layers.*@grad"]),
        "vartrace: layers.*.forward.self@grad (all block params)": tracer(
            ["layers.*.forward.self@grad"]
        ),
    }
    return step_table(size, contenders, step, rounds, block)


def _peak_rss_child(size: str, steps: int, traced_run: bool) -> None:
    """Train ``steps`` steps in this process and print the peak RSS in KiB."""
    model, step = training_step(size)
    with traced(model, MEMORY_PATHS) if traced_run else contextlib.nullcontext():
        for _ in range(steps):
            step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def bench_memory(size: str, threads: int) -> str:
    """Peak RSS of fresh processes after 100 and 1,000 steps, untraced and ``@grad``-traced."""
    rows = []
    for traced_run in (False, True):
        peaks = []
        for steps in (100, 1000):
            argv = [__file__, "--rss-child", str(steps), "--size", size]
            argv += ["--threads", str(threads)] + (["--traced"] if traced_run else [])
            peaks.append(last_int(fresh(argv)))
        rows.append(("@grad traced" if traced_run else "untraced", *peaks))
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
    arguments = parser(__doc__, rounds=30, block=10)
    add_size(arguments)
    add_threads(arguments)
    arguments.add_argument("--memory", action="store_true", help="peak RSS, 100 vs 1,000 steps")
    arguments.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    arguments.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = arguments.parse_args()
    set_threads(args.threads)
    if args.rss_child:
        _peak_rss_child(args.size, args.rss_child, args.traced)
    elif args.memory:
        print(bench_memory(args.size, args.threads))
    else:
        print(bench_overhead(args.size, args.rounds, args.block))


if __name__ == "__main__":
    main()
