"""``bench_overhead.py --instructions``: the instructions of a training step, under callgrind.

Each contender runs in a child process of its own (``bench_overhead.py --_instructions-child``,
one torch thread, ``PYTHONHASHSEED=0``), instrumented for its measured steps only: the
harness switches callgrind on and off at the child's two handshakes.  With ``--breakdown``
the contenders are the layers of :func:`_overhead.breakdown.breakdown_layers`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import Context, handshake, instructions, need_callgrind, ratio_table, versions
from _model import TRACED_PATHS, training_step

from _overhead.breakdown import breakdown_contenders
from _overhead.steps import above_floors, floor_and_vartrace, statistics_contender

INSTRUCTION_STEPS = 12  # steps counted by --instructions (the floor empties its list every 12)
COMMAND = Path(__file__).resolve().parent.parent / "bench_overhead.py"


def _millions(count: float) -> str:
    return f"{count / 1e6:.3f} M instr"


def instruction_contenders(
    size: str, breakdown: bool = False
) -> tuple[Callable[[], None], dict[str, Context], dict[str, tuple[str, int]]]:
    """A fresh training step, the contenders of ``--instructions`` on it (the main rows
    of the ``--size`` table: untraced, the bare floor, vartrace on :data:`TRACED_PATHS`
    and statistics mode on them) and vartrace's floor; with ``breakdown``, the layers
    of ``--breakdown`` and each one's floor."""
    model, step = training_step(size)
    if breakdown:
        return step, *breakdown_contenders(model, step)
    pair, floors = floor_and_vartrace(model, step, "traced", TRACED_PATHS)
    contenders = {"untraced": contextlib.nullcontext, **pair, **statistics_contender(model)}
    return step, contenders, floors


def instructions_child(size: str, name: str, steps: int, breakdown: bool) -> None:
    """A contender's side of :func:`bench_instructions`, under callgrind: warm up, then
    ``steps`` steps between two handshakes, at which the parent switches callgrind's
    instrumentation on and off."""
    import torch

    torch.set_num_threads(1)
    step, contenders, _ = instruction_contenders(size, breakdown)
    for _ in range(3):
        step()
    with contenders[name]():
        step()
        # The young generations empty and their counters at zero: the collections inside
        # the counted steps then fall at the same points whatever ran before (an import
        # more or less would otherwise move them, and their cost, in or out of the count).
        gc.collect()
        handshake()
        for _ in range(steps):
            step()
        handshake()


def count_instructions(size: str, name: str, steps: int, out: Path, breakdown: bool = False) -> int:
    """Instructions (callgrind's Ir) of ``steps`` steps under contender ``name`` (of the
    breakdown's, with ``breakdown``), counted in a child process under callgrind that
    writes its output to ``out``."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    argv = [str(COMMAND), "--size", size, "--_instructions-child", name, str(steps)]
    argv += ["--breakdown"] if breakdown else []
    return instructions(argv, out, env, switched=True)


def bench_instructions(
    size: str, steps: int, markdown: bool = False, breakdown: bool = False
) -> str:
    """Instructions a training step of each :func:`instruction_contenders` contender executes.

    Each contender runs in a process of its own under callgrind, instrumented
    for its ``steps`` measured steps only (not start-up, warm-up or exit);
    the processes run side by side, which changes no count.
    """
    need_callgrind(control=True)
    _, contenders, floors = instruction_contenders(size, breakdown)
    with tempfile.TemporaryDirectory() as directory, ThreadPoolExecutor(len(contenders)) as pool:

        def counted(index: int, name: str) -> float:
            out = Path(directory) / f"callgrind.{index}"
            return count_instructions(size, name, steps, out, breakdown) / steps

        counts = pool.map(counted, range(len(contenders)), contenders)
        per_step = dict(zip(contenders, counts, strict=True))
    what = " --breakdown" if breakdown else ""
    title = (
        f"--instructions{what} --size {size}: full training step (forward + backward + SGD), "
        f"instructions (callgrind Ir) per step over {steps} steps after warm-up; "
        f"{versions()}, 1 thread"
    )
    extra = above_floors(per_step, floors, 1e-3, "k instr")
    return ratio_table(title, per_step, extra=extra, markdown=markdown, unit=_millions)
