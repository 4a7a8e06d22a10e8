"""The timed tables of ``bench_overhead.py``: a training step per contender, the engine, GPT-2.

Each table comes from :func:`_harness.round_robin` over contexts: the untraced step, the bare
floor, vartrace on the same sites, and what peers do; the "extra per record" column is a
contender's time above its floor per value both read.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

from _harness import Context, ratio_table, round_robin, traced, versions
from _model import (
    ALL_LOCALS_PATHS,
    IDLE_PATHS,
    LOOP_CALLS,
    LOOP_STEP_CALLS,
    TRACED_PATHS,
    training_step,
)

from _overhead.floors import bare_floor


def above_floors(
    costs: dict[str, float], floors: dict[str, tuple[str, int]], scale: float, unit: str
) -> dict[str, str]:
    """The "extra per record" column: each contender's cost above its floor, per value read.

    ``floors`` maps a contender to its floor contender and the number of values
    both read per step; costs are multiplied by ``scale`` and shown in ``unit``.
    """
    return {
        name: f"{(costs[name] - costs[floor]) / reads * scale:+.1f} {unit} ({reads}/step)"
        for name, (floor, reads) in floors.items()
    }


def step_table(
    size: str,
    contenders: dict[str, Context],
    step: Callable[[], None],
    rounds: int,
    block: int,
    floors: dict[str, tuple[str, int]] | None = None,
    markdown: bool = False,
    loop: bool = False,
) -> str:
    """Warm up, time ``step`` under each contender, and format the table of ratios.

    ``floors`` maps a contender to its floor contender and the number of
    values both read per step: the table then shows the contender's time
    above its floor per value.  ``loop``: ``step`` is the :func:`loop_model`
    loop, summarised by the fastest step, not the median.
    """
    for _ in range(3):
        step()
    summary = min if loop else statistics.median
    times = round_robin(contenders, step, rounds, block, summary)
    extra = above_floors(times, floors or {}, 1e6, "us")
    what = (
        f"--loop: {LOOP_STEP_CALLS} calls of an {LOOP_CALLS}-block chain of tiny tensor ops, "
        "fastest step"
        if loop
        else f"--size {size}: full training step (forward + backward + SGD), median step"
    )
    title = f"{what}; {versions(threads=True)}, {rounds} interleaved rounds of {block} steps"
    return ratio_table(title, times, extra=extra, markdown=markdown)


def bench_model(size: str, rounds: int, block: int, markdown: bool = False) -> str:
    import torch

    model, step = training_step(size)

    @contextlib.contextmanager
    def forward_hooks() -> Iterator[None]:
        kept: list[torch.Tensor] = []
        handles = [
            layer.register_forward_hook(lambda m, i, o: kept.append(o.detach().clone()))
            for layer in model.layers
        ]
        yield
        for handle in handles:
            handle.remove()

    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "idle tracer (never-called method)": lambda: traced(model, IDLE_PATHS),
        "forward hooks cloning block outputs": forward_hooks,
    }
    floors: dict[str, tuple[str, int]] = {}
    for which, paths in (("traced", TRACED_PATHS), ("all locals", ALL_LOCALS_PATHS)):
        pair, floor = floor_and_vartrace(model, step, which, paths)
        contenders.update(pair)
        floors.update(floor)
    contenders.update(statistics_contender(model))
    # What asynchronous staging would cost a CPU model (staging="auto" keeps it synchronous).
    contenders["vartrace, staging='async': " + ", ".join(TRACED_PATHS)] = lambda: traced(
        model, TRACED_PATHS, staging="async"
    )
    return step_table(size, contenders, step, rounds, block, floors, markdown)


def statistics_contender(model: Any) -> dict[str, Context]:
    """Statistics mode on :data:`TRACED_PATHS`: each record reduced by ``vartrace.stats()``
    (float64 statistics, no copy of the tensor kept), to set against recording them whole."""
    from vartrace import stats

    name = "vartrace statistics (vartrace.stats()): " + ", ".join(TRACED_PATHS)
    return {name: lambda: traced(model, TRACED_PATHS, pre_save_callbacks=[stats()])}


def floor_and_vartrace(
    model: Any, step: Callable[[], None], which: str, paths: list[str]
) -> tuple[dict[str, Context], dict[str, tuple[str, int]]]:
    """The bare floor for ``FLOOR_READS[which]`` and vartrace on ``paths``, as contenders,
    and vartrace's floor with the number of values both read per step (one floor step
    counts them)."""
    floor_name, floor = bare_floor(model, which)
    cloned: list[object] = []
    with floor(cloned):
        step()
    name = "vartrace: " + ", ".join(paths)
    contenders: dict[str, Context] = {
        floor_name: lambda: floor([]),
        name: lambda: traced(model, paths),
    }
    return contenders, {name: (floor_name, len(cloned))}


class _Workload:
    def compute(self, n: int) -> int:
        total = 0
        for i in range(n):
            total += i * i
        squared = total * total
        return squared % 7


def bench_engine(rounds: int, block: int) -> str:
    from vartrace.engine import Hook, Probe, Selector, attach, detach, methods_of, parse, set_core
    from vartrace.engine.frames import MonitoringCore, SettraceCore

    work = _Workload()
    info = methods_of(_Workload)["compute"]
    pattern = parse("compute.squared")
    states = pattern.step(pattern.step(pattern.start, "compute"), "squared")
    probe = Probe(exit=(Selector("squared", "compute.squared", pattern, states),))
    captured: list[object] = []

    def sink(site: str, value: object, grad: bool) -> None:
        captured.append(value)
        if len(captured) > 1000:
            captured.clear()

    def calls() -> None:
        for _ in range(100):
            work.compute(100)

    def under(core_factory: Callable[[], object]) -> Context:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            set_core(core_factory())  # type: ignore[arg-type]
            hook = Hook(probe, sink)
            attach(work, "compute", info.code, hook)
            yield
            detach(work, "compute", hook)

        return context

    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "settrace core (locals at return)": under(SettraceCore),
    }
    if hasattr(sys, "monitoring"):
        contenders["sys.monitoring core (locals at return)"] = under(MonitoringCore)
    medians = round_robin(contenders, calls, rounds, block)
    title = (
        "--engine: 100 calls of a pure-Python method (a 100-step loop) with locals, "
        f"Python {sys.version.split()[0]}"
    )
    return ratio_table(title, medians)


HF_EXPLICIT = ["transformer.h.*.attn.forward.attn_weights"]
HF_STAR_STAR = ["**.attn_weights"]
# What ``**.attn_weights`` stands for in GPT-2: the local of attention's forward, and the same
# name in the function it calls (``_upcast_and_reordered_attn`` is patched, never called).
HF_STAR_STAR_MEANS = [
    *HF_EXPLICIT,
    "transformer.h.*.attn.forward>eager_attention_forward.attn_weights",
    "transformer.h.*.attn._upcast_and_reordered_attn.attn_weights",
]


def bench_hf(rounds: int, block: int, markdown: bool = False) -> str:
    """A training step of a tiny GPT-2 (random weights, eager attention) from transformers.

    ``**.attn_weights`` patches only the methods that can bind the name, so it
    should cost what the explicit path it stands for costs.
    """
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # its notes on this config, on stderr
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64, bos_token_id=0
    )
    config.eos_token_id = 0
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 256, (2, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()

    def tracer(paths: list[str]) -> Context:
        return lambda: traced(model, paths)

    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "vartrace: " + ", ".join(HF_EXPLICIT): tracer(HF_EXPLICIT),
        "vartrace: the 3 explicit paths that ** stands for": tracer(HF_STAR_STAR_MEANS),
        "vartrace: " + ", ".join(HF_STAR_STAR): tracer(HF_STAR_STAR),
    }
    for _ in range(3):
        step()
    medians = round_robin(contenders, step, rounds, block)
    title = (
        f"--hf: training step of a 4-layer GPT-2 from transformers {transformers.__version__} "
        f"(eager attention), {versions()}, medians of {rounds} interleaved rounds of {block} steps"
    )
    return ratio_table(title, medians, markdown=markdown)


def profile(size: str, steps: int, paths: list[str]) -> str:
    """cProfile of ``steps`` training steps traced with ``paths``: where the record path goes.

    Sorted by own time; the profiler's per-call cost inflates short functions, so
    read it for proportions and call counts, and the benchmark for the cost.
    """
    import cProfile
    import io
    import pstats

    model, step = training_step(size)
    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    with traced(model, paths):
        step()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    return f"--profile: {steps} {size} steps traced with {', '.join(paths)}\n{out.getvalue()}"
