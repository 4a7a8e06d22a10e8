"""Every step's time, one tracer per contender: where the first gathering interval and the
steady state part (a CUDA GPU, about 40 s on an H200).

Usage::

    python tools/gpu_steps.py                  # the GPT-2-small-size step of gpu_check.py
    python tools/gpu_steps.py --sync stream    # each step timed to its own stream's sync
    python tools/gpu_steps.py --smoke-cpu      # the control flow, tiny CPU model

`tools/gpu_check.py` judges the bars over a few steps of a fresh tracer per round, so a
tracer's one-time costs (its ring of pinned host memory grows during the first gathering
interval) weigh on its means.  This prints each step's wall time, so the first interval
and the steps after it can be told apart: per contender, two rounds (the order reversed in
the second) of 4 warm-up steps and 16 timed ones, a gather every 8 steps, each step timed to
a device sync; then the median over all timed steps, and over the steps after the first
gathering interval (``steady``), as ratios to the untraced step's median.

A device sync (the default, as in `gpu_check.py`) also waits for the staging thread's
copies on its side stream, so a staging thread that falls behind shows as step time
although the training thread never waited for it.  ``--sync stream`` waits only for the
training stream, as ``loss.item()`` does in a training loop: the step then pays for
staging only where it waits at admission (records in flight past ``max_inflight_bytes``).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _gpu.contenders import block_hooks
from _gpu.model import Size, Trainer
from _harness import alternated, discard, parser

from vartrace import ModelTracer

WARM, STEPS, INTERVAL = 4, 16, 8


def contenders(trainer: Trainer, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Context managers, by name: the untraced step, the floor, and vartrace's variants."""

    def tracer(paths: list[str], *, kept: bool = False, **options: Any) -> ModelTracer:
        emptied = [] if kept else [discard]
        return ModelTracer(
            trainer.model,
            paths,
            staging=options.pop("staging", "async"),
            post_gather_callbacks=emptied,
            gathering_interval=INTERVAL,
            **options,
        )

    blocks, tiny = ["blocks.*"], ["blocks.*.ln1.weight"]
    return {
        "untraced": contextlib.nullcontext,
        "hooks: device clone": lambda: block_hooks(trainer.model, False, None),
        "async 12 blocks": lambda: tracer(blocks),
        "async 12 blocks, ring of 2 GiB": lambda: tracer(blocks, max_host_bytes=2 << 30),
        "async 12 blocks kept in results": lambda: tracer(blocks, kept=True),
        "async 12 blocks, no change detection": lambda: tracer(blocks, change_detection=False),
        "async 12 blocks, device=cuda": lambda: tracer(blocks, device=str(device)),
        "async 12 tiny": lambda: tracer(tiny),
        "sync 12 tiny": lambda: tracer(tiny, staging="sync"),
        "async statistics, 12 blocks": lambda: tracer(blocks, statistics=True),
        "async statistics, 12 blocks + @grad": lambda: tracer(
            [*blocks, "blocks.*@grad"], statistics=True
        ),
    }


def timed_steps(trainer: Trainer, make: Callable[[], Any], sync: Callable[[], None]) -> list[float]:
    """The wall time of each timed step, in ms, under a fresh context from `make`."""
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with make():
            for _ in range(WARM):
                trainer.step()
            sync()
            for _ in range(STEPS):
                start = time.perf_counter()
                trainer.step()
                sync()
                times.append(1e3 * (time.perf_counter() - start))
    return times


def _stream_sync() -> None:
    """Wait for the training stream alone, as a `.item()` in the loop would."""
    torch.cuda.current_stream().synchronize()


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--smoke-cpu", action="store_true", help="a tiny model on the CPU")
    arguments.add_argument(
        "--sync", choices=["device", "stream"], default="device", help="what a step waits for"
    )
    args = arguments.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke_cpu
    if not cuda and not args.smoke_cpu:
        sys.exit("gpu_steps.py needs a CUDA GPU (or --smoke-cpu)")
    device = torch.device("cuda" if cuda else "cpu")
    size = Size() if cuda else Size(2, 32, 2, 16, 2, 64)
    trainer = Trainer(size, device)
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if cuda:
        sync = torch.cuda.synchronize if args.sync == "device" else _stream_sync
    for _ in range(3):
        trainer.step()
    sync()
    table = contenders(trainer, device)
    if not cuda:
        del table["async 12 blocks, device=cuda"]
    runs: dict[str, list[list[float]]] = {name: [] for name in table}
    for round_ in range(2 if cuda else 1):  # the smoke run checks the control flow
        for name in alternated(list(table), round_):
            try:
                runs[name].append(timed_steps(trainer, table[name], sync))
            except Exception as error:  # a contender that fails is a row of its own
                print(f"{name}: {type(error).__name__}: {error}"[:400], flush=True)
    base = statistics.median(t for steps in runs["untraced"] for t in steps)
    where = torch.cuda.get_device_name() if cuda else "cpu (--smoke-cpu)"
    print(f"\n{where}; torch {torch.__version__}; steps timed to a {args.sync} sync")
    print("per contender: every timed step, ms")
    for name, rounds in runs.items():
        for steps in rounds:
            print(f"  {name:38s} " + " ".join(f"{t:.0f}" for t in steps))
    print(f"\n{'contender':38s} {'median':>8s} {'ratio':>7s} {'steady':>7s} {'mean':>8s}")
    for name, rounds in runs.items():
        if not rounds:
            continue
        every = [t for steps in rounds for t in steps]
        steady = [t for steps in rounds for t in steps[INTERVAL - WARM :]]
        print(
            f"{name:38s} {statistics.median(every):6.1f}ms "
            f"{statistics.median(every) / base:6.3f}x {statistics.median(steady) / base:6.3f}x "
            f"{statistics.fmean(every):6.1f}ms"
        )


if __name__ == "__main__":
    main()
