"""``bench_overhead.py --breakdown`` and ``--loop``: vartrace built up one layer at a time.

From the untraced run, each contender adds one layer of vartrace (its patches, the frame
capture, the tracer, the copy and chunk, change detection) to the one before it, beside the
references of :mod:`_overhead.floors`; the last column is each layer's cost per record.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable
from typing import Any

from _harness import Context, traced
from _model import LOOP_CALLS, LOOP_PATHS, LOOP_STEP_CALLS, TRACED_PATHS, loop_model, training_step

from _overhead.floors import bare_floor, engine_only, minimal_tracer
from _overhead.steps import step_table


def breakdown_layers(
    model: Any, paths: list[str], which: str
) -> tuple[dict[str, Context], dict[str, Context]]:
    """The contenders of a breakdown: vartrace built up one layer at a time from the
    untraced run, and the references (the bare floor, and on Python >= 3.12 the
    :func:`minimal_tracer` without and with a per-object patch) for ``paths``, whose
    floor reads are ``FLOOR_READS[which]``."""
    from vartrace import DROP

    layers: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "patches only (nothing read)": lambda: engine_only(model, paths, read=False),
        "+ frame capture (leaves discarded)": lambda: engine_only(model, paths, read=True),
        "+ tracer: iterations, callbacks (pre-save DROP)": lambda: traced(
            model, paths, pre_save_callbacks=[lambda *_: DROP]
        ),
        "+ copy and chunk (change_detection=False)": lambda: traced(
            model, paths, change_detection=False
        ),
        "+ change detection (vartrace)": lambda: traced(model, paths),
    }
    floor_name, floor = bare_floor(model, which)
    references: dict[str, Context] = {floor_name: lambda: floor([])}
    if hasattr(sys, "monitoring"):
        references["minimal tracer: floor + iteration tag, change detection, chunk"] = lambda: (
            minimal_tracer(model, which, patch=False)
        )
        references["minimal tracer + per-object patch (eager under compile)"] = lambda: (
            minimal_tracer(model, which, patch=True)
        )
    return layers, references


def _breakdown_floors(
    layers: dict[str, Context], references: dict[str, Context], records: int
) -> dict[str, tuple[str, int]]:
    """Each layer above the one before it; each minimal tracer above the bare floor."""
    floors = {name: (below, records) for below, name in itertools.pairwise(layers)}
    floor, *minimal = references
    floors.update({name: (floor, records) for name in minimal})
    return floors


def breakdown_contenders(
    model: Any, step: Callable[[], None]
) -> tuple[dict[str, Context], dict[str, tuple[str, int]]]:
    """The layers and references of a breakdown on :data:`TRACED_PATHS`, and each one's
    floor with the records a ``step`` keeps (one traced step counts them)."""
    from vartrace import ModelTracer

    calls: list[object] = []
    with ModelTracer(model, TRACED_PATHS, pre_save_callbacks=[lambda *a: calls.append(a)]):  # type: ignore[arg-type]
        step()
    layers, references = breakdown_layers(model, TRACED_PATHS, "traced")
    return {**layers, **references}, _breakdown_floors(layers, references, len(calls))


def bench_breakdown(size: str, rounds: int, block: int, markdown: bool = False) -> str:
    """Where vartrace's time above the untraced step goes, one layer at a time.

    Each row adds one layer to the one above it; the last column is that
    layer's cost per traced call (one record per call with :data:`TRACED_PATHS`).
    On Python >= 3.12, :func:`minimal_tracer` rows show what the bare floor
    plus the least of vartrace's record semantics costs, without and with a
    per-object patch, above the floor per record.
    """
    model, step = training_step(size)
    contenders, floors = breakdown_contenders(model, step)
    return step_table(size, contenders, step, rounds, block, floors, markdown)


def bench_loop(rounds: int, block: int, markdown: bool = False) -> str:
    """The breakdown on :func:`loop_model`, each contender's fastest step.

    In-step costs are two to five times these; what the loop resolves is a
    change of a microsecond a call, which the noise of a training step hides.
    """
    model, x = loop_model()

    def step() -> None:
        for _ in range(LOOP_STEP_CALLS):
            model(x)

    layers, references = breakdown_layers(model, LOOP_PATHS, "loop")
    floors = _breakdown_floors(layers, references, LOOP_CALLS * LOOP_STEP_CALLS)
    contenders = {**layers, **references}
    return step_table("", contenders, step, rounds, block, floors, markdown, loop=True)
