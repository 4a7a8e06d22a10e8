"""Overhead of tracing a training step, as ratios to an untraced step in the same process.

Usage::

    python tools/bench_overhead.py --size tiny      # Python-bound step (stands in for a GPU step)
    python tools/bench_overhead.py --size small     # compute-bound step
    python tools/bench_overhead.py --engine         # torch-free: settrace vs sys.monitoring core
    python tools/bench_overhead.py --hf             # tiny HF GPT-2: ** against an explicit path
    python tools/bench_overhead.py --markdown       # the table as Markdown, for the README
    python tools/bench_overhead.py --profile 2000   # cProfile of 2000 traced tiny steps
    python tools/bench_overhead.py --breakdown      # vartrace's cost above the floor, by layer
    python tools/bench_overhead.py --loop           # the same in a tight loop, for A/B tests
    python tools/bench_overhead.py --instructions   # instructions per tiny step, under callgrind

Contenders run round-robin (a block of steps each, many rounds) so that
machine noise hits them alike; the table shows the median step time and
its ratio to the untraced median.  Traced contenders discard each chunk
after the gather (as the HDF5 saver does), so memory stays flat.

Each vartrace contender has a *bare floor* beside it: a hand-written
capture through the same mechanism as vartrace's frame core on this Python
(a ``sys.monitoring`` ``PY_RETURN`` callback on 3.12+, ``sys.settrace``
return events before) that clones the same variables of the same code
objects and does nothing else.  The floor is what the mechanism itself
costs; the column "extra per record" is vartrace's time above its floor,
per record it keeps in a step.

``--instructions`` counts instead of timing: each contender runs in its own
process under ``valgrind --tool=callgrind`` (one torch thread,
``PYTHONHASHSEED=0``) with instrumentation off through start-up and warm-up;
the parent switches it on (``callgrind_control``) for the measured steps
only, and reads the instructions executed (Ir) from callgrind's output.
The counts do not depend on machine noise, so they show small changes to
the record path that timings cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {
    "tiny": {"blocks": 4, "d_model": 64, "heads": 4, "seq": 32, "batch": 2},
    "small": {"blocks": 4, "d_model": 256, "heads": 4, "seq": 128, "batch": 8},
}
TRACED_PATHS = ["forward.x", "layers.*.attn.forward.scores", "layers.*.mlp.forward.h"]
ALL_LOCALS_PATHS = ["layers.*.attn.forward.*"]
IDLE_PATHS = ["generate.prompt"]
Context = Callable[[], contextlib.AbstractContextManager[None]]
# Variables a floor reads at return, by the name of the class whose forward holds them
# (None: every argument and local), mirroring TRACED_PATHS and ALL_LOCALS_PATHS.
FLOOR_READS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "traced": {"GPT": ("x",), "Attention": ("scores",), "MLP": ("h",)},
    "all locals": {"Attention": None},
    "loop": {"Block": ("h",)},
}
LOOP_PATHS = ["blocks.*.forward.h"]
LOOP_CALLS = 8  # traced calls in one call of the loop model
LOOP_STEP_CALLS = 20  # calls of the loop model in one timed step
INSTRUCTION_STEPS = 12  # steps counted by --instructions (the floor empties its list every 12)
# What an --instructions child runs under: instrumentation off until the parent turns it on.
CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]


def build_model(size: str, seed: int = 0):  # type: ignore[no-untyped-def]
    """The GPT-style benchmark model and a batch of token ids for it."""
    import torch
    from torch import nn

    cfg = SIZES[size]
    d, heads = cfg["d_model"], cfg["heads"]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            attn = scores.softmax(dim=-1)
            return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = nn.functional.gelu(self.fc(x))
            return self.out(h)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn, self.mlp = Attention(), MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, vocab: int = 256) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(cfg["seq"], d))
            self.layers = nn.ModuleList(Block() for _ in range(cfg["blocks"]))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos[: x.shape[1]]
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

        def generate(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
            for _ in range(steps):
                prompt = torch.cat([prompt, self(prompt)[:, -1:].argmax(-1)], dim=1)
            return prompt

    torch.manual_seed(seed)
    model = GPT()
    tokens = torch.randint(0, 256, (cfg["batch"], cfg["seq"]))
    return model, tokens


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} us"


def _instructions(count: float) -> str:
    return f"{count / 1e6:.3f} M instr"


def table(
    title: str,
    rows: list[tuple[str, float]],
    base: float,
    extra: dict[str, str] | None = None,
    markdown: bool = False,
    unit: Callable[[float], str] = _duration,
) -> str:
    """Format ``(contender, cost of a step)`` rows with their ratio to ``base``.

    The cost is in seconds, or what ``unit`` formats.  ``extra`` maps a
    contender to the text of a last column (blank for others).
    """
    extra = extra or {}
    header = ["contender", "step", "ratio", *(["extra per record"] if extra else [])]
    cells = [
        [
            name,
            unit(cost),
            f"{cost / base:.3f}x",
            *([extra.get(name, "")] if extra else []),
        ]
        for name, cost in rows
    ]
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join(["---", *["---:"] * (len(header) - 1)]) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        first = f"{row[0]:<{widths[0]}}"
        return "  ".join(
            [first, *(f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True))]
        )

    return "\n".join([title, line(header), *(line(row) for row in cells)])


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


def round_robin(
    contenders: dict[str, Context],
    step: Callable[[], None],
    rounds: int,
    block: int,
    summary: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Seconds of ``step`` under each contender's context (the ``summary`` of all samples,
    by default their median), interleaved round-robin.

    The order of the contenders is shuffled every round, so that none always
    runs first after the untraced step (or last before it), and the first step
    after entering a context is a warm-up, not timed.
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            with contenders[name]():
                step()
                for _ in range(block):
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)
    return {name: summary(samples) for name, samples in times.items()}


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
    import torch

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
    title = (
        f"{what}; Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {rounds} interleaved rounds of {block} steps"
    )
    return table(title, list(times.items()), times["untraced"], extra, markdown)


def training_step(size: str):  # type: ignore[no-untyped-def]
    """The benchmark model and a function running one full training step on it."""
    import torch

    model, tokens = build_model(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()

    return model, step


Reads = dict[CodeType, tuple[str, ...]]


def _clone_locals(frame: FrameType, names: tuple[str, ...], kept: list[object]) -> None:
    import torch

    values = frame.f_locals
    for name in names:
        if name != "self":
            value = values[name]
            kept.append(value.detach().clone() if isinstance(value, torch.Tensor) else value)
    if len(kept) > 100:  # about what vartrace holds: a step's records and the last ones
        kept.clear()


@contextlib.contextmanager
def monitoring_floor(reads: Reads, kept: list[object]) -> Iterator[None]:
    """A bare ``sys.monitoring`` capture: ``PY_RETURN`` on exactly the ``reads`` code objects."""

    def on_return(code: CodeType, offset: int, value: object) -> None:
        _clone_locals(sys._getframe(1), reads[code], kept)

    with _on_returns(reads, on_return, "bench floor"):
        yield


@contextlib.contextmanager
def _on_returns(
    codes: Iterable[CodeType], callback: Callable[[CodeType, int, object], object], name: str
) -> Iterator[None]:
    """``callback`` on ``PY_RETURN`` of exactly ``codes``, as a free ``sys.monitoring`` tool."""
    monitoring = sys.monitoring  # type: ignore[attr-defined]
    tool = next(t for t in (4, 3) if monitoring.get_tool(t) is None)
    monitoring.use_tool_id(tool, name)
    monitoring.register_callback(tool, monitoring.events.PY_RETURN, callback)
    for code in codes:
        monitoring.set_local_events(tool, code, monitoring.events.PY_RETURN)
    try:
        yield
    finally:
        for code in codes:
            monitoring.set_local_events(tool, code, 0)
        monitoring.register_callback(tool, monitoring.events.PY_RETURN, None)
        monitoring.free_tool_id(tool)


@contextlib.contextmanager
def settrace_floor(reads: Reads, kept: list[object]) -> Iterator[None]:
    """A bare ``sys.settrace`` capture: return events of frames of the ``reads`` code objects."""

    def local(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        if event == "return":
            _clone_locals(frame, reads[frame.f_code], kept)
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if frame.f_code in reads:
            frame.f_trace_lines = False
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)


def bare_floor(
    model: object, which: str
) -> tuple[str, Callable[[list[object]], contextlib.AbstractContextManager[None]]]:
    """This Python's bare floor for one set of :data:`FLOOR_READS`: its name and context.

    The context takes the list that the cloned values go to.
    """
    classes = {type(m).__name__: type(m) for m in model.modules()}  # type: ignore[attr-defined]
    codes = {classes[c].forward.__code__: names for c, names in FLOOR_READS[which].items()}
    reads = {code: names or code.co_varnames for code, names in codes.items()}
    if hasattr(sys, "monitoring"):
        return f"bare sys.monitoring floor ({which})", lambda kept: monitoring_floor(reads, kept)
    return f"bare settrace floor ({which})", lambda kept: settrace_floor(reads, kept)


def _discard(name: str, trace: object) -> None:
    trace.clear()  # type: ignore[attr-defined]


@contextlib.contextmanager
def traced(model: object, paths: list[str], **options: Any) -> Iterator[None]:
    """A tracer that discards each chunk after the gather (as the HDF5 saver does).

    Patterns that record nothing on purpose (the idle contender's, or a method
    the model never calls) are not reported.
    """
    from vartrace import ModelTracer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*recorded nothing")
        with ModelTracer(model, paths, post_gather_callbacks=[_discard], **options):  # type: ignore[arg-type]
            yield


def bench_model(size: str, rounds: int, block: int, markdown: bool = False) -> str:
    import torch

    model, step = training_step(size)

    @contextlib.contextmanager
    def untraced() -> Iterator[None]:
        yield

    def tracer(paths: list[str]) -> contextlib.AbstractContextManager[None]:
        return traced(model, paths)

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
        "untraced": untraced,
        "idle tracer (never-called method)": lambda: tracer(IDLE_PATHS),
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

    def traced(core_factory: Callable[[], object]) -> Context:
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
        "settrace core (locals at return)": traced(SettraceCore),
    }
    if hasattr(sys, "monitoring"):
        contenders["sys.monitoring core (locals at return)"] = traced(MonitoringCore)
    medians = round_robin(contenders, calls, rounds, block)
    title = (
        "--engine: 100 calls of a pure-Python method (a 100-step loop) with locals, "
        f"Python {sys.version.split()[0]}"
    )
    return table(title, list(medians.items()), medians["untraced"])


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
        f"(eager attention), Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"medians of {rounds} interleaved rounds of {block} steps"
    )
    return table(title, list(medians.items()), medians["untraced"], markdown=markdown)


@contextlib.contextmanager
def engine_only(model: object, paths: list[str], read: bool) -> Iterator[None]:
    """vartrace's engine alone on the sites of ``paths``: its patches, reading each site's
    leaves (``read``) or nothing, and sending them nowhere (no tracer, no copy)."""
    import torch

    from vartrace.engine import Hook, Probe, attach, detach
    from vartrace.tracing.sites import resolve

    def discard(site: str, value: object, grad: bool) -> None:
        pass

    hooks = []
    for target in resolve(model, paths):  # type: ignore[arg-type]
        hook = Hook(target.probe() if read else Probe(), discard)
        method = target.method
        attach(target.module, method.name, method.code, hook, torch._dynamo.disable)
        hooks.append((target, hook))
    try:
        yield
    finally:
        for target, hook in hooks:
            detach(target.module, target.method.name, hook)


@contextlib.contextmanager
def minimal_tracer(model: Any, which: str, patch: bool) -> Iterator[None]:
    """The least a tracer with vartrace's record semantics does, on ``sys.monitoring``.

    The bare floor's ``PY_RETURN`` callback on the :data:`FLOOR_READS` of
    ``which``, plus what every record needs:
    the traced instances told apart (by ``self``), an iteration tag (counted
    by module hooks on the root), bit-exact change detection and a chunk per
    site, handed over (dropped) when the root returns.  ``patch`` adds the
    least a per-object patch does: a ``wrapt`` wrapper, excluded from
    ``torch.compile``, counting nested calls (what keeps traced methods eager
    in a compiled model).  Not a tracer: no callbacks, no threads, no
    ``@entry``, no copies of odd values.
    """
    import torch
    import wrapt

    from vartrace.tensors import same

    reads = FLOOR_READS[which]
    sites: dict[int, tuple[tuple[str, str], ...]] = {}
    for path, module in model.named_modules():
        for name in reads.get(type(module).__name__) or ():
            site = f"{path}.forward.{name}" if path else f"forward.{name}"
            sites[id(module)] = (*sites.get(id(module), ()), (name, site))
    iteration = [0]
    chunk: dict[str, list[tuple[torch.Tensor, int]]] = {}
    last: dict[str, torch.Tensor] = {}
    contiguous = torch.contiguous_format

    def on_return(code: CodeType, offset: int, value: object) -> None:
        values = sys._getframe(1).f_locals
        for name, site in sites.get(id(values["self"]), ()):
            record = values[name].detach().clone(memory_format=contiguous)
            previous = last.get(site)
            if previous is None or not same(record, previous):
                last[site] = record
                chunk.setdefault(site, []).append((record, iteration[0]))

    def count(module: object, args: object) -> None:
        iteration[0] += 1

    def hand_over(module: object, args: object, output: object) -> None:
        chunk.clear()

    depth = [0]

    def through(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        depth[0] += 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            depth[0] -= 1

    patched = [m for m in model.modules() if id(m) in sites] if patch else []
    for module in patched:
        vars(module)["forward"] = wrapt.FunctionWrapper(
            module.forward, torch._dynamo.disable(through)
        )
    handles = [model.register_forward_pre_hook(count), model.register_forward_hook(hand_over)]
    codes = {type(m).forward.__code__ for m in model.modules() if id(m) in sites}
    try:
        with _on_returns(codes, on_return, "bench minimal tracer"):
            yield
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del vars(module)["forward"]


def loop_model():  # type: ignore[no-untyped-def]
    """A chain of :data:`LOOP_CALLS` blocks of two tiny tensor ops, and its input.

    Nearly all of its time is Python, so a tracer's cost per call shows
    with little noise: the loop for A/B-ing changes to the record path.
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            return h - x

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LOOP_CALLS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    return Chain(), torch.ones(4)


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


def bench_breakdown(size: str, rounds: int, block: int, markdown: bool = False) -> str:
    """Where vartrace's time above the untraced step goes, one layer at a time.

    Each row adds one layer to the one above it; the last column is that
    layer's cost per traced call (one record per call with :data:`TRACED_PATHS`).
    On Python >= 3.12, :func:`minimal_tracer` rows show what the bare floor
    plus the least of vartrace's record semantics costs, without and with a
    per-object patch, above the floor per record.
    """
    from vartrace import ModelTracer

    model, step = training_step(size)
    calls: list[object] = []
    with ModelTracer(model, TRACED_PATHS, pre_save_callbacks=[lambda *a: calls.append(a)]):  # type: ignore[arg-type]
        step()
    layers, references = breakdown_layers(model, TRACED_PATHS, "traced")
    floors = _breakdown_floors(layers, references, len(calls))
    return step_table(size, {**layers, **references}, step, rounds, block, floors, markdown)


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


def instruction_contenders(
    size: str,
) -> tuple[Callable[[], None], dict[str, Context], dict[str, tuple[str, int]]]:
    """A fresh training step, the contenders of ``--instructions`` on it (the main rows
    of the ``--size`` table: untraced, the bare floor, vartrace on :data:`TRACED_PATHS`
    and statistics mode on them) and vartrace's floor."""
    model, step = training_step(size)
    pair, floors = floor_and_vartrace(model, step, "traced", TRACED_PATHS)
    contenders = {"untraced": contextlib.nullcontext, **pair, **statistics_contender(model)}
    return step, contenders, floors


def _handshake() -> None:
    """Tell the parent that this child is at an edge of the measured steps; wait for it."""
    print("ready", flush=True)
    sys.stdin.readline()


def instructions_child(size: str, name: str, steps: int) -> None:
    """A contender's side of :func:`bench_instructions`, under callgrind: warm up, then
    ``steps`` steps between two handshakes, at which the parent switches callgrind's
    instrumentation on and off."""
    import torch

    torch.set_num_threads(1)
    step, contenders, _ = instruction_contenders(size)
    for _ in range(3):
        step()
    with contenders[name]():
        step()
        # The young generations empty and their counters at zero: the collections inside
        # the counted steps then fall at the same points whatever ran before (an import
        # more or less would otherwise move them, and their cost, in or out of the count).
        gc.collect()
        _handshake()
        for _ in range(steps):
            step()
        _handshake()


def count_instructions(size: str, name: str, steps: int, directory: Path) -> int:
    """Instructions (callgrind's Ir) of ``steps`` steps under contender ``name``, counted
    in a child process under callgrind that writes its output to ``directory``."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    script = str(Path(__file__).resolve())
    command = [*CALLGRIND, f"--callgrind-out-file={directory}/callgrind.%p", sys.executable]
    command += [script, "--size", size, "--_instructions-child", name, str(steps)]
    with (
        tempfile.TemporaryFile("w+") as log,
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        ) as child,
    ):
        assert child.stdin and child.stdout
        for switch in ("on", "off"):
            if child.stdout.readline() != "ready\n":
                break
            control = ["callgrind_control", f"--instr={switch}", str(child.pid)]
            subprocess.run(control, check=True, capture_output=True)
            child.stdin.write("go\n")
            child.stdin.flush()
        if child.wait():
            log.seek(0)
            raise RuntimeError(f"{name}: the callgrind child failed\n{log.read()[-4000:]}")
    # "totals:", not "summary:", which callgrind leaves at 0 when instrumentation starts off.
    lines = (directory / f"callgrind.{child.pid}").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith("totals:")))


def bench_instructions(size: str, steps: int, markdown: bool = False) -> str:
    """Instructions a training step of each :func:`instruction_contenders` contender executes.

    Each contender runs in a process of its own under callgrind, instrumented
    for its ``steps`` measured steps only (not start-up, warm-up or exit);
    the processes run side by side, which changes no count.
    """
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("--instructions needs valgrind's callgrind and callgrind_control")
    import torch

    _, contenders, floors = instruction_contenders(size)
    with tempfile.TemporaryDirectory() as directory, ThreadPoolExecutor(len(contenders)) as pool:
        counts = pool.map(
            lambda name: count_instructions(size, name, steps, Path(directory)) / steps,
            contenders,
        )
        per_step = dict(zip(contenders, counts, strict=True))
    title = (
        f"--instructions --size {size}: full training step (forward + backward + SGD), "
        f"instructions (callgrind Ir) per step over {steps} steps after warm-up; "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, 1 thread"
    )
    extra = above_floors(per_step, floors, 1e-3, "k instr")
    rows = list(per_step.items())
    return table(title, rows, per_step["untraced"], extra, markdown, _instructions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--engine", action="store_true", help="torch-free engine comparison")
    parser.add_argument("--hf", action="store_true", help="tiny transformers GPT-2: ** vs explicit")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--breakdown", action="store_true", help="vartrace's cost above the floor, by layer"
    )
    parser.add_argument(
        "--loop", action="store_true", help="the breakdown in a tight loop of traced calls"
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS", help="cProfile STEPS traced steps"
    )
    parser.add_argument(
        "--instructions",
        type=int,
        nargs="?",
        const=INSTRUCTION_STEPS,
        default=0,
        metavar="STEPS",
        help=f"count the instructions of STEPS steps under callgrind ({INSTRUCTION_STEPS})",
    )
    parser.add_argument(
        "--_instructions-child", nargs=2, metavar=("CONTENDER", "STEPS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.engine:
        print(bench_engine(args.rounds, args.block))
        return
    if args._instructions_child:
        name, steps = args._instructions_child
        instructions_child(args.size, name, int(steps))
        return
    if args.instructions:
        print(bench_instructions(args.size, args.instructions, args.markdown))
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.hf:
        print(bench_hf(args.rounds, args.block, args.markdown))
        return
    if args.breakdown:
        print(bench_breakdown(args.size, args.rounds, args.block, args.markdown))
        return
    if args.loop:
        print(bench_loop(args.rounds, args.block, args.markdown))
        return
    if args.profile:
        print(profile(args.size, args.profile, TRACED_PATHS))
        return
    print(bench_model(args.size, args.rounds, args.block, args.markdown))


if __name__ == "__main__":
    main()
