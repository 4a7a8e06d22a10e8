"""vartrace on a CUDA GPU: syncs in the step, overhead, exactness and memory, in one command.

Usage::

    python tools/gpu_check.py --out results            # one CUDA GPU: at most 6 min on an H100
    python tools/gpu_check.py --out results --quick    # fewer timing rounds: about 3 min
    python tools/gpu_check.py --out results --no-csan  # without the CUDA-sanitizer child
    python tools/gpu_check.py --out results --compile  # + records under reduce-overhead compile
    python tools/gpu_check.py --smoke-cpu --out /tmp/gpu_smoke  # the control flow, tiny CPU model

The step: training a GPT-2-small-size model (12 blocks, d 768, 12 heads, seq 1024, batch 8,
vocab 50304; bf16 autocast, SDPA, fused AdamW, a frozen ``wpe``).  The sites: every block
output (``blocks.*``: 12 fp32 residuals, 302 MB a step) and ``wpe.weight`` (unchanged every
step, so change detection keeps it once).  Contenders, in one process: the untraced step;
forward hooks cloning on the device (the floor) or copying with a blocking ``.cpu()`` (what
peers do); vartrace with ``staging="sync"``, ``staging="async"``, async + a background HDF5
saver, async ``blocks.*@grad``, async statistics mode and ``device="cuda"``.  Options this
vartrace lacks are feature-detected; their contenders are skipped with the reason.

Per contender:

1. the step time, mean and median, and the mean's ratio to the untraced step's, over
   interleaved rounds (order reversed every other round, each step timed to a device sync);
   the rounds stop when the timing budget would be exceeded;
2. the extra peak device memory over the untraced step, and the tracer's ``staging_stats``;
3. bit-exactness of every recorded block output (and ``@grad``) against forward and tensor
   hooks copying the same tensors with a blocking ``.cpu()``; the HDF5 contender is read
   back from its file;
4. whether two traced steps survive ``torch.cuda.set_sync_debug_mode("error")``, and where
   they raised;
5. host-device synchronisations per step inside the step, by thread and innermost vartrace
   frame (``torch.cuda._gpu_trace`` callbacks; counted last: that trace slows what follows).

Then a child process under ``TORCH_CUDA_SANITIZER=1`` runs a few async-staged steps, and the
bars of the issues are printed, pass or fail (:data:`RATIO_BARS`: async <= 1.05x the
untraced step, mean and median, + HDF5 <= 1.10x, ``@grad`` <= 1.05x, ``device="cuda"``
<= 1.03x, tiny records <= 1.02x, statistics mode <= 1.03x), resident memory growth within
``max_host_bytes``, no sync in the step on the training and autograd threads (``vartrace-*``
threads may wait), sync-debug mode passes, 0 mismatches, 0 sanitizer races.  Every number
goes to ``<out>/gpu_check.json``; the table comes last.

``--smoke-cpu`` runs the same control flow on a tiny CPU model: the CUDA-only parts are
skipped with the reason, the async contenders too unless the tracer accepts
``staging="async"`` on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

SITES = ["blocks.*", "wpe.weight"]  # every block output; a frozen parameter
GRAD_SITES = ["blocks.*@grad"]
TINY_SITES = ["blocks.*.ln1.weight"]  # a few KB each, changed by every optimizer step
GATHERING_INTERVAL = 8
BUDGET_S = 360.0  # the whole run on an H100, --compile aside
CSAN_RACE = "CSAN detected a possible data race"
VARTRACE_DIR = os.path.dirname(vartrace.__file__) + os.sep  # as its frames name their files
THIS_FILE = str(Path(__file__).resolve())
_START = time.perf_counter()

Records = dict[tuple[str, int], torch.Tensor]  # (site, iteration) -> a CPU copy


def log(text: str) -> None:
    print(f"[{time.perf_counter() - _START:5.0f}s] {text}", flush=True)


def describe(error: BaseException) -> str:
    """The error's type and first line, short enough for a table cell."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


# -- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    layers: int = 12
    d: int = 768
    heads: int = 12
    seq: int = 1024
    batch: int = 8
    vocab: int = 50304


@dataclass(frozen=True)
class Plan:
    """How much of each measurement a mode runs."""

    size: Size
    max_rounds: int
    steps: int  # timed steps per contender and round
    warm: int  # untimed steps after entering a contender
    timing_s: float  # the timing phase's budget
    exact_steps: int = 3
    sync_steps: int = 3


PLANS = {
    "full": Plan(Size(), max_rounds=6, steps=8, warm=2, timing_s=150.0),
    "quick": Plan(Size(), max_rounds=3, steps=6, warm=2, timing_s=70.0, sync_steps=2),
    "smoke": Plan(Size(2, 32, 2, 16, 2, 64), max_rounds=2, steps=3, warm=1, timing_s=60.0),
}
CSAN_SIZE = Size(layers=2, d=64, heads=2, seq=32, batch=2, vocab=128)


class Attention(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.d, 3 * size.d)
        self.proj = nn.Linear(size.d, size.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(size.d), nn.LayerNorm(size.d)
        self.attn = Attention(size)
        self.fc = nn.Linear(size.d, 4 * size.d)
        self.out = nn.Linear(4 * size.d, size.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.wte = nn.Embedding(size.vocab, size.d)
        self.wpe = nn.Embedding(size.seq, size.d)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.d)
        self.head = nn.Linear(size.d, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(positions)  # fp32 residual stream under autocast
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Trainer:
    """The model, its optimizer and four batches; :meth:`step` runs one training step."""

    def __init__(self, size: Size, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.size, self.device = size, device
        self.model = GPT(size).to(device)
        self.model.wpe.weight.requires_grad_(False)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
        generator = torch.Generator().manual_seed(seed + 1)
        shape = (size.batch, size.seq + 1)
        self.batches = [
            torch.randint(0, size.vocab, shape, generator=generator).to(device) for _ in range(4)
        ]
        self.positions = torch.arange(size.seq, device=device)
        self.steps = 0

    def step(self) -> None:
        batch = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(batch[:, :-1], self.positions)
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        self.optimizer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


# -- contenders -----------------------------------------------------------------------------


@dataclass
class Capture:
    """One run of a contender: the records it keeps (``keep``, for exactness) and its stats."""

    trainer: Trainer
    keep: bool = False
    records: Records = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


Enter = Callable[[Capture], contextlib.AbstractContextManager[Any]]


@dataclass
class Contender:
    name: str
    enter: Enter
    note: str = ""
    grad: bool = False  # records block output gradients
    exact: bool = True  # records the block outputs (or gradients) themselves, bit for bit
    staged: bool = False  # async staging: held to the no-sync bars
    skip: str = ""  # why it does not run here


@contextlib.contextmanager
def untraced(capture: Capture) -> Iterator[None]:
    yield


@contextlib.contextmanager
def block_hooks(
    model: GPT, blocking: bool, into: Records | None, grad: bool = False
) -> Iterator[None]:
    """Forward hooks copying every block's output: a blocking ``.cpu()`` or a device clone.

    ``into`` keeps the copies by (site, step), steps counted from 1 as vartrace's
    iterations; ``grad`` also copies each output's gradient (a blocking ``.cpu()``).
    """
    step = [0]

    def count(module: nn.Module, args: Any) -> None:
        step[0] += 1

    def copier(site: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            value = output.detach()
            record = value.to("cpu", copy=True) if blocking else value.clone()
            if into is not None:
                into[(site, step[0])] = record
            if grad and output.requires_grad and into is not None:
                key = (f"{site}@grad", step[0])
                output.register_hook(lambda g: into.__setitem__(key, g.detach().to("cpu")))

        return hook

    handles = [model.register_forward_pre_hook(count)]
    for index, block in enumerate(model.blocks):
        handles.append(block.register_forward_hook(copier(f"blocks.{index}.forward")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def discard(name: str, trace: Any) -> None:
    trace.clear()  # as a saver empties the chunk after writing it


def read_h5(path: Path) -> Records:
    with vartrace.open(path) as run:
        return {
            (name, int(site.iterations[index])): torch.as_tensor(site.record(index))
            for name in run.names
            for site in (run[name],)
            for index in range(len(site))
        }


@contextlib.contextmanager
def traced(
    capture: Capture, paths: list[str], saver: bool = False, **options: Any
) -> Iterator[None]:
    """vartrace on ``paths``.  Each chunk is dropped after its gather, or written by a
    background HDF5 saver (``saver``, read back for exactness), or kept (``capture.keep``)."""
    callbacks: list[Any] = [] if capture.keep else [discard]
    with contextlib.ExitStack() as stack:
        h5: H5PYSaverCallback | None = None
        path = Path()
        if saver:
            handle, name = tempfile.mkstemp(suffix=".h5", prefix="gpu_check_")
            os.close(handle)
            path = Path(name)
            stack.callback(path.unlink, missing_ok=True)
            h5 = H5PYSaverCallback(path, overwrite=True, background=True, metadata=False)
            stack.callback(h5.close)  # after the tracer's last flush
            callbacks = [h5]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracer = ModelTracer(
                capture.trainer.model,
                paths,
                post_gather_callbacks=callbacks,
                gathering_interval=GATHERING_INTERVAL,
                **options,
            )
            with tracer:
                yield
        stats = getattr(tracer, "staging_stats", None)
        if stats is not None:
            capture.stats["staging"] = (
                dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else vars(stats)
            )
        if h5 is not None:
            h5.close()
            capture.stats["h5_mib"] = path.stat().st_size / 2**20 if path.exists() else 0.0
            if capture.keep and path.exists():
                capture.records.update(read_h5(path))
        elif capture.keep:
            for site, trace in tracer.results.items():
                for value, iteration in zip(trace.values, trace.iterations, strict=True):
                    capture.records[(site, int(iteration))] = value.cpu()


def device_stats(name: str, value: Any, iteration: int) -> Any:
    """Statistics mode without ``vartrace.stats``: float64 numbers computed on the device.

    Sum, sum of squares, min, max, non-finite count and size: no ``.item()``, no sync.
    """
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.numel():
        return value
    with torch.autocast(value.device.type, enabled=False):
        x = value.detach()
        if x.element_size() == 1:
            x = x.to(torch.bfloat16)  # fp8: exact, and what aminmax / isfinite accept
        low, high = torch.aminmax(x)
        size = torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)
        return torch.stack(
            [
                x.sum(dtype=torch.float64),
                torch.linalg.vector_norm(x, dtype=torch.float64).square(),
                low.double(),
                high.double(),
                (~torch.isfinite(x)).sum().double(),
                size,
            ]
        )


def stats_reducer() -> tuple[Callable[[str, Any, int], Any], str]:
    """``vartrace.stats`` where this vartrace has it (the reducer, or a factory of one)."""
    builtin = getattr(vartrace, "stats", None)
    if builtin is None:
        return device_stats, "local device_stats (no vartrace.stats)"
    try:
        positional = [
            p
            for p in inspect.signature(builtin).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return (builtin if len(positional) >= 3 else builtin()), "vartrace.stats"
    except (TypeError, ValueError) as error:
        return device_stats, f"local device_stats (vartrace.stats: {describe(error)})"


def async_unsupported(trainer: Trainer) -> str:
    """Why the async contenders are skipped here ("" if they run).

    On a GPU they run whenever the tracer has the option (a failure is theirs to report); on
    the CPU only if the tracer accepts ``staging="async"`` there.
    """
    if "staging" not in inspect.signature(ModelTracer).parameters:
        return "this vartrace's ModelTracer has no staging option"
    if trainer.device.type == "cuda":
        return ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ModelTracer(trainer.model, ["wpe.weight"], staging="async"):
                pass
    except Exception as error:
        return f'staging="async" does not run on {trainer.device.type}: {describe(error)}'
    return ""


def contenders(trainer: Trainer) -> list[Contender]:
    """Every contender, in table order; those this vartrace or device cannot run carry a skip."""
    has_staging = "staging" in inspect.signature(ModelTracer).parameters
    sync = {"staging": "sync"} if has_staging else {}
    reducer, reducer_name = stats_reducer()
    device = trainer.device
    no_async = async_unsupported(trainer)
    return [
        Contender("untraced", untraced),
        Contender(
            "hooks: device clone",
            lambda c: block_hooks(c.trainer.model, False, c.records if c.keep else None),
            note="the floor",
        ),
        Contender(
            "hooks: blocking .cpu()",
            lambda c: block_hooks(c.trainer.model, True, c.records if c.keep else None),
            note="what peers do",
        ),
        Contender(
            "vartrace sync",
            lambda c: traced(c, SITES, **sync),
            note='staging="sync"' if sync else "no staging option: today's path",
        ),
        Contender(
            "vartrace async",
            lambda c: traced(c, SITES, staging="async"),
            staged=True,
            skip=no_async,
        ),
        Contender(
            "vartrace async + HDF5",
            lambda c: traced(c, SITES, saver=True, staging="async"),
            note="background H5PYSaverCallback",
            staged=True,
            skip=no_async,
        ),
        Contender(
            "vartrace async tiny",
            lambda c: traced(c, TINY_SITES, staging="async"),
            note="one LayerNorm weight a block (KB): the per-record cost",
            exact=False,
            staged=True,
            skip=no_async,
        ),
        Contender(
            "vartrace async @grad",
            lambda c: traced(c, GRAD_SITES, staging="async"),
            grad=True,
            staged=True,
            skip=no_async,
        ),
        Contender(
            "vartrace async stats",
            lambda c: traced(c, SITES, staging="async", pre_save_callbacks=[reducer]),
            note=reducer_name,
            exact=False,
            staged=True,
            skip=no_async,
        ),
        Contender(
            "vartrace device=cuda",
            lambda c: traced(c, SITES, device=str(device)),
            note="records kept on the GPU",
            skip="" if device.type == "cuda" else "CUDA only (records kept on a CUDA device)",
        ),
    ]


# -- measurements ---------------------------------------------------------------------------


def merge_stats(total: dict[str, Any], new: dict[str, Any]) -> None:
    """Add one run's ``staging_stats`` to ``total`` (counts summed, high-water marks maxed)."""
    for key, value in new.items():
        if isinstance(value, dict):
            merge_stats(total.setdefault(key, {}), value)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            total[key] = value
        elif key.startswith("max"):
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0) + value


def time_contenders(trainer: Trainer, items: list[Contender], plan: Plan) -> dict[str, Any]:
    """Step times, exit (drain) times, extra peak memory and staging stats of each contender."""
    device = trainer.device
    times: dict[str, list[float]] = {c.name: [] for c in items}
    main_cpu: dict[str, list[float]] = {c.name: [] for c in items}  # the training thread's
    other_cpu: dict[str, list[float]] = {c.name: [] for c in items}  # every other thread's
    rss_growth = dict.fromkeys(times, 0)
    exits: dict[str, list[float]] = {c.name: [] for c in items}
    peaks = dict.fromkeys(times, 0)
    rows: dict[str, dict[str, Any]] = {c.name: {} for c in items}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    rounds = 0
    while rounds < plan.max_rounds:
        for c in items if rounds % 2 == 0 else items[::-1]:
            if "error" in rows[c.name]:
                continue
            capture = Capture(trainer)
            synchronize(device)
            base = allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            resident = resident_bytes()
            try:
                with c.enter(capture):
                    for _ in range(plan.warm):
                        trainer.step()
                    synchronize(device)
                    for _ in range(plan.steps):
                        start = time.perf_counter()
                        thread, process = time.thread_time(), time.process_time()
                        trainer.step()
                        synchronize(device)
                        times[c.name].append(time.perf_counter() - start)
                        mine = time.thread_time() - thread
                        main_cpu[c.name].append(mine)
                        other_cpu[c.name].append(time.process_time() - process - mine)
                    rss_growth[c.name] = max(rss_growth[c.name], resident_bytes() - resident)
                    leaving = time.perf_counter()
                synchronize(device)
                exits[c.name].append(time.perf_counter() - leaving)
            except Exception as error:  # one broken contender must not stop the others
                rows[c.name]["error"] = describe(error)
                log(f"  {c.name}: {rows[c.name]['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            peaks[c.name] = max(peaks[c.name], peak(device) - base)
            merge_stats(rows[c.name], capture.stats)
        rounds += 1
        spent = time.perf_counter() - began
        log(f"  round {rounds}/{plan.max_rounds}: {spent:.0f}s of {plan.timing_s:.0f}s")
        if spent * (rounds + 1) / rounds > plan.timing_s and rounds < plan.max_rounds:
            log(f"  stopping after {rounds} rounds: another would exceed the timing budget")
            break
    if not times["untraced"]:
        sys.exit(f"the untraced step failed: {rows['untraced'].get('error')}")
    base_mean = statistics.fmean(times["untraced"])
    base_median = statistics.median(times["untraced"])
    for name, samples in times.items():
        if samples:
            rows[name].update(
                mean_ms=1e3 * statistics.fmean(samples),
                median_ms=1e3 * statistics.median(samples),
                max_ms=1e3 * max(samples),
                steps=len(samples),
                ratio=statistics.fmean(samples) / base_mean,
                ratio_median=statistics.median(samples) / base_median,
                exit_ms=1e3 * statistics.fmean(exits[name]),
                main_cpu_ms=1e3 * statistics.fmean(main_cpu[name]),
                other_cpu_ms=1e3 * statistics.fmean(other_cpu[name]),
                rss_growth_mib=rss_growth[name] / 2**20,
                peak_extra_mib=(peaks[name] - peaks["untraced"]) / 2**20,
            )
        if "h5_mib" in rows[name]:  # every step of every run wrote to a file
            written = len(exits[name]) * (plan.warm + plan.steps)
            rows[name]["h5_mib_per_step"] = rows[name]["h5_mib"] / max(1, written)
    host: dict[str, Any] = {
        "rounds": rounds,
        "max_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024,
    }
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            host["pinned_mib"] = (
                torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**20
            )
    return {"contenders": rows, "host": host}


def resident_bytes() -> int:
    """The process's resident memory now (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def exactness(trainer: Trainer, items: list[Contender], steps: int) -> dict[str, Any]:
    """Each contender's records against hooks' blocking copies of the same tensors."""
    out: dict[str, Any] = {}
    for c in items:
        if c.name == "untraced":
            continue
        capture = Capture(trainer, keep=True)
        reference: Records = {}
        try:
            with block_hooks(trainer.model, True, reference, grad=True), c.enter(capture):
                for _ in range(steps):
                    trainer.step()
            synchronize(trainer.device)
        except Exception as error:
            out[c.name] = {"error": describe(error)}
            continue
        row: dict[str, Any] = {"records": len(capture.records)}
        if c.exact:
            wanted = {k: v for k, v in reference.items() if k[0].endswith("@grad") == c.grad}
            compared = [key for key in wanted if key in capture.records]
            bad = [key for key in compared if not same_bits(capture.records[key], wanted[key])]
            row.update(
                compared=len(compared),
                mismatched=len(bad),
                missing=len(wanted) - len(compared),
                first_mismatch=f"{bad[0][0]} @ {bad[0][1]}" if bad else None,
            )
        if c.name.startswith("vartrace") and not c.grad:
            row["wpe_records"] = sum(1 for site, _ in capture.records if site == "wpe.weight")
        out[c.name] = row
    return out


def _frames(frame: FrameType | None) -> Iterator[tuple[str, int, str]]:
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


def innermost(frames: Iterable[tuple[str, int, str]]) -> str:
    """The innermost vartrace frame of ``frames`` (innermost first), else this file's."""
    mine = None
    for filename, line, function in frames:
        if filename.startswith(VARTRACE_DIR):
            return f"{filename[len(VARTRACE_DIR) :]}:{line} {function}"
        if mine is None and filename == __file__:
            mine = f"gpu_check.py:{line} {function}"
    return mine or "(outside vartrace)"


def raised_at(error: BaseException) -> str:
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    frames = [
        (f.filename, f.lineno or 0, f.name)
        for e in reversed(chain)  # the original error first
        for f in reversed(traceback.extract_tb(e.__traceback__))
    ]
    return innermost(frames)


def sync_debug(trainer: Trainer, items: list[Contender]) -> dict[str, Any]:
    """Whether two traced steps run under ``set_sync_debug_mode("error")``, else where not."""
    device = trainer.device
    out: dict[str, Any] = {}
    for c in items:
        try:
            with c.enter(Capture(trainer)):
                trainer.step()
                trainer.step()
                synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    trainer.step()
                    trainer.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            synchronize(device)
            out[c.name] = {"raised": False}
        except Exception as error:
            torch.cuda.set_sync_debug_mode("default")
            out[c.name] = {"raised": True, "where": raised_at(error), "error": describe(error)}
            synchronize(device)
    return out


class SyncCounter:
    """Host-device synchronisations by kind, thread and innermost vartrace frame, while ``on``.

    Stream, device and event synchronisations as ``torch.cuda._gpu_trace`` reports them (a
    blocking copy is a stream synchronisation).  Once on, the trace stays on in this process.
    """

    def __init__(self) -> None:
        from torch.cuda import _gpu_trace

        self.on = False
        self.counts: Counter[tuple[str, str, str]] = Counter()
        torch._C._activate_gpu_trace()
        _gpu_trace.register_callback_for_stream_synchronization(lambda s: self._hit("stream"))
        _gpu_trace.register_callback_for_device_synchronization(lambda: self._hit("device"))
        _gpu_trace.register_callback_for_event_synchronization(lambda e: self._hit("event"))

    def _hit(self, kind: str) -> None:
        if self.on:
            where = innermost(_frames(sys._getframe(2)))
            self.counts[(kind, threading.current_thread().name, where)] += 1


def in_step(thread: str) -> bool:
    """The training thread, or an autograd device thread (made in C++: Python says Dummy-N)."""
    return thread == "MainThread" or thread.startswith("Dummy")


def count_syncs(trainer: Trainer, items: list[Contender], steps: int) -> dict[str, Any]:
    counter = SyncCounter()
    device = trainer.device
    out: dict[str, Any] = {}
    for c in items:
        counter.counts.clear()
        try:
            with c.enter(Capture(trainer)):
                trainer.step()
                trainer.step()
                synchronize(device)
                counter.on = True
                for _ in range(steps):
                    trainer.step()
                counter.on = False
            synchronize(device)
        except Exception as error:
            counter.on = False
            out[c.name] = {"error": describe(error)}
            continue
        by_site = [
            {"kind": kind, "thread": thread, "where": where, "per_step": n / steps}
            for (kind, thread, where), n in counter.counts.most_common()
        ]
        per_step = sum(row["per_step"] for row in by_site if in_step(row["thread"]))
        other = sum(
            row["per_step"]
            for row in by_site
            if not in_step(row["thread"]) and not row["thread"].startswith("vartrace-")
        )
        out[c.name] = {"in_step_per_step": per_step, "other_threads_per_step": other}
        out[c.name]["by_site"] = by_site
    return out


def bandwidth(device: torch.device) -> dict[str, float]:
    """Device-to-device and device-to-host copy rates of a 151 MiB tensor, GB/s."""
    source = torch.randn(151 << 18, device=device)
    pageable, pinned = torch.empty(151 << 18), torch.empty(151 << 18, pin_memory=True)
    copies = {
        "d2d_clone": lambda: source.clone(),
        "d2h_pageable": lambda: pageable.copy_(source),
        "d2h_pinned": lambda: pinned.copy_(source, non_blocking=True),
    }
    out = {}
    for name, copy in copies.items():
        copy()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(5):
            copy()
        synchronize(device)
        out[f"{name}_GBps"] = round(5 * (151 << 20) / (time.perf_counter() - start) / 1e9, 1)
    return out


def csan(timeout: float) -> dict[str, Any]:
    """A few async-staged steps (values and ``@grad``) in a child under the CUDA sanitizer."""
    command = [sys.executable, THIS_FILE, "--csan-child"]
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    text = done.stdout + done.stderr
    return {"rc": done.returncode, "races": text.count(CSAN_RACE), "tail": text[-2000:]}


def csan_child() -> None:
    trainer = Trainer(CSAN_SIZE, torch.device("cuda"))
    capture = Capture(trainer, keep=True)
    with traced(capture, [*SITES, *GRAD_SITES], staging="async"):
        for _ in range(4):
            trainer.step()
    torch.cuda.synchronize()
    print(f"csan child: {len(capture.records)} records")


def compiled_check(size: Size, device: torch.device, steps: int, async_ok: bool) -> dict[str, Any]:
    """Under ``torch.compile(mode="reduce-overhead")`` the last block's input is the output
    of a compiled (cudagraph) region that the next replay overwrites: its records must equal
    a pre-hook's blocking copy of the same tensor, step by step."""
    trainer = Trainer(size, device)
    last = size.layers - 1
    site = f"blocks.{last}.forward.x"
    reference: Records = {}
    step = [0]

    def count(module: nn.Module, args: Any) -> None:
        step[0] += 1

    def keep(module: nn.Module, args: Any) -> None:
        reference[(site, step[0])] = args[0].detach().to("cpu", copy=True)

    handles = [
        trainer.model.register_forward_pre_hook(count),
        trainer.model.blocks[last].register_forward_pre_hook(keep),
    ]
    trainer.model = torch.compile(trainer.model, mode="reduce-overhead")  # type: ignore[assignment]
    capture = Capture(trainer, keep=True)
    try:
        with traced(capture, [site], **({"staging": "async"} if async_ok else {})):
            for _ in range(steps):
                trainer.step()
        synchronize(device)
    except Exception as error:
        return {"error": describe(error)}
    finally:
        for handle in handles:
            handle.remove()
    compared = [key for key in reference if key in capture.records]
    bad = [key for key in compared if not same_bits(capture.records[key], reference[key])]
    return {"records": len(capture.records), "compared": len(compared), "mismatched": len(bad)}


# -- report ---------------------------------------------------------------------------------


# The step-time bars of the issues (mean and median ratio to the untraced step).
RATIO_BARS = {
    "vartrace async": 1.05,
    "vartrace async + HDF5": 1.10,
    "vartrace async @grad": 1.05,
    "vartrace device=cuda": 1.03,
    "vartrace async tiny": 1.02,
    "vartrace async stats": 1.03,
}


def default_host_bytes() -> int:
    """``ModelTracer``'s default ``max_host_bytes``: a tenth of the memory, at most 8 GiB."""
    return min(8 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 10)


def bars(result: dict[str, Any], items: list[Contender]) -> list[tuple[str, str, str]]:
    """The issue's bars: (bar, what was measured, PASS / FAIL / SKIP)."""
    skips = {c.name: c.skip for c in items if c.skip}
    staged = [c.name for c in items if c.staged and not c.skip]
    timing = result["timing"]["contenders"]
    out = []

    def ratio_bar(name: str, limit: float) -> None:
        bar = f"{name}: step <= {limit:.2f}x untraced (mean and median)"
        row = timing.get(name)
        if row is None:
            out.append((bar, f"skipped: {skips.get(name, '?')}", "SKIP"))
        elif "ratio" not in row:
            out.append((bar, row.get("error", "no steps"), "FAIL"))
        else:
            worst = max(row["ratio"], row["ratio_median"])
            measured = f"{row['ratio']:.3f}x / {row['ratio_median']:.3f}x"
            if result["env"]["device_type"] != "cuda":
                out.append((bar, f"{measured} (CPU smoke: not judged)", "SKIP"))
            else:
                out.append((bar, measured, "PASS" if worst <= limit else "FAIL"))

    def all_bar(bar: str, rows: dict[str, Any] | None, ok: Callable[[Any], bool]) -> None:
        if rows is None:
            out.append((bar, "CUDA only", "SKIP"))
            return
        if not staged:
            out.append((bar, f"no async contender: {skips.get('vartrace async', '?')}", "SKIP"))
            return
        failed = [n for n in staged if "error" in rows.get(n, {"error": 1}) or not ok(rows[n])]
        measured = f"failed: {', '.join(failed)}" if failed else f"{len(staged)} contender(s)"
        out.append((bar, measured, "FAIL" if failed else "PASS"))

    for name, limit in RATIO_BARS.items():
        ratio_bar(name, limit)
    row = timing.get("vartrace async", {})
    bound = default_host_bytes()
    if "rss_growth_mib" in row:
        grown = row["rss_growth_mib"] * 2**20
        out.append(
            (
                f"async: resident memory growth <= max_host_bytes ({bound / 2**30:.1f} GiB)",
                f"{row['rss_growth_mib']:.0f} MiB",
                "PASS" if grown <= bound else "FAIL",
            )
        )
    all_bar(
        "async: 0 syncs in the step (training + autograd threads)",
        result.get("syncs"),
        lambda row: row["in_step_per_step"] == 0,
    )
    all_bar(
        "async: two steps pass sync-debug mode 'error'",
        result.get("sync_debug"),
        lambda row: not row["raised"],
    )
    exact = {c.name: result["exactness"].get(c.name, {}) for c in items if c.exact and not c.skip}
    exact.pop("untraced", None)
    failed = [
        name
        for name, row in exact.items()
        if "error" in row or row.get("mismatched") or row.get("missing")
    ]
    checked = sum(row.get("compared", 0) for row in exact.values())
    out.append(
        (
            "0 mismatches against blocking copies",
            f"failed: {', '.join(failed)}" if failed else f"{checked} records compared",
            "FAIL" if failed or not checked else "PASS",
        )
    )
    sanitizer = result.get("csan")
    if not isinstance(sanitizer, dict) or "skipped" in (sanitizer or {}):
        why = sanitizer["skipped"] if isinstance(sanitizer, dict) else "not run"
        out.append(("CUDA sanitizer: 0 races", why, "SKIP"))
    elif "error" in sanitizer:
        out.append(("CUDA sanitizer: 0 races", sanitizer["error"], "FAIL"))
    else:
        ok = sanitizer["races"] == 0 and sanitizer["rc"] == 0
        measured = f"{sanitizer['races']} races, exit {sanitizer['rc']}"
        out.append(("CUDA sanitizer: 0 races", measured, "PASS" if ok else "FAIL"))
    return out


def format_table(
    title: str, header: list[str], rows: list[list[str]], left: Iterable[int] = (0, -1)
) -> str:
    """Columns aligned as the other tools' tables: the ``left`` ones left, the others right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    aligned_left = {i % len(header) for i in left}

    def line(row: list[str]) -> str:
        cells = [
            f"{cell:<{w}}" if i in aligned_left else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([title, line(header), *(line(row) for row in rows)])


def _cpu_cell(row: dict[str, Any]) -> str:
    """CPU per step of the training thread / of every other thread (staging, OpenMP...)."""
    if "main_cpu_ms" not in row:
        return "-"
    return f"{row['main_cpu_ms']:.1f}/{row['other_cpu_ms']:.1f} ms"


def _cell(row: dict[str, Any], key: str, form: str, unit: str = "") -> str:
    return format(row[key], form) + unit if key in row else "-"


def _debug_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return f"raised at {row['where']}" if row["raised"] else "ok"


def _exact_cell(row: dict[str, Any]) -> str:
    if "compared" not in row:
        return "-"
    cell = f"{row['mismatched']}/{row['compared']}"
    if row["missing"]:
        cell += f" ({row['missing']} missing)"
    return cell + (f", wpe x{row['wpe_records']}" if "wpe_records" in row else "")


def _staging_cell(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    fields = ("staged", "kept", "unchanged", "dropped", "waits")
    return "/".join(str(stats.get(k, "?")) for k in fields)


def report(result: dict[str, Any], items: list[Contender]) -> str:
    """The final table: one row per contender, skipped ones with the reason."""
    timing = result["timing"]["contenders"]
    header = ["contender", "mean", "median", "ratio", "peak +MiB", "main/other CPU", "RSS +MiB"]
    header += ["syncs/step", "sync-debug", "exact", "staging staged/kept/unch/drop/waits", "note"]
    rows = []
    for c in items:
        if c.skip:
            rows.append([c.name, *["-"] * 10, f"skipped: {c.skip}"])
            continue
        row = timing.get(c.name, {})
        syncs = result.get("syncs", {}).get(c.name, {})
        exact = result["exactness"].get(c.name, {})
        notes = [n for n in (row.get("error"), c.note) if n]
        if "h5_mib_per_step" in row:
            notes.append(f"{row['h5_mib_per_step']:.1f} MiB h5/step")
        notes += [
            f"{what}: {r['error']}"
            for what, r in (("exact", exact), ("syncs", syncs))
            if "error" in r
        ]
        rows.append(
            [
                c.name,
                _cell(row, "mean_ms", ".1f", " ms"),
                _cell(row, "median_ms", ".1f", " ms"),
                _cell(row, "ratio", ".3f", "x"),
                _cell(row, "peak_extra_mib", ".0f"),
                _cpu_cell(row),
                _cell(row, "rss_growth_mib", ".0f"),
                _cell(syncs, "in_step_per_step", ".2f"),
                _debug_cell(result.get("sync_debug", {}).get(c.name)),
                _exact_cell(exact),
                _staging_cell(row.get("staging")),
                "; ".join(notes),
            ]
        )
    env = result["env"]
    plan = env["plan"]
    title = (
        f"{env['device']}: {plan['size']['layers']}-block d{plan['size']['d']} training step, "
        f"{result['timing']['host']['rounds']} interleaved rounds of {plan['steps']} steps; "
        "mean step, its ratio to the untraced mean; syncs per step on the training and "
        "autograd threads; exact = mismatched/compared"
    )
    return format_table(title, header, rows)


def print_report(result: dict[str, Any], items: list[Contender], out: Path) -> None:
    """Where the syncs are, the bars, and the table, last."""
    print()
    for name, row in result.get("syncs", {}).items():
        for site in row.get("by_site", [])[:4]:
            print(
                f"sync  {name:<24} {site['per_step']:6.2f}/step  {site['kind']:<6} "
                f"[{site['thread']}] {site['where']}"
            )
    print()
    bar_rows = [[b["bar"], b["measured"], b["verdict"]] for b in result["bars"]]
    header = ["bar", "measured", "verdict"]
    print(format_table("bars (from the issue)", header, bar_rows, (0, 1, 2)))
    print()
    print(report(result, items))
    elapsed = result["seconds"]
    cuda = result["env"]["device_type"] == "cuda"
    over = f" (over the {BUDGET_S:.0f}s budget)" if cuda and elapsed > BUDGET_S else ""
    print(f"\n{elapsed:.0f}s elapsed{over}; every number in {out}")


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="where gpu_check.json goes")
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds and steps")
    parser.add_argument("--no-csan", action="store_true", help="skip the CUDA-sanitizer child")
    parser.add_argument(
        "--compile", action="store_true", help="also check records under reduce-overhead"
    )
    parser.add_argument("--smoke-cpu", action="store_true", help="the control flow on a CPU")
    parser.add_argument("--csan-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.csan_child:
        csan_child()
        return
    if args.smoke_cpu:
        device, plan = torch.device("cpu"), PLANS["smoke"]
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: --smoke-cpu checks the script on a CPU")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        plan = PLANS["quick" if args.quick else "full"]
    cuda = device.type == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    size = plan.size
    env = {
        "torch": torch.__version__,
        "device_type": device.type,
        "cuda": torch.version.cuda if cuda else None,
        "python": sys.version.split()[0],
        "vartrace": vartrace.__version__,
        "vartrace_path": str(Path(vartrace.__file__).parent),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (--smoke-cpu)",
        "tracer_options": list(inspect.signature(ModelTracer).parameters),
        "plan": dataclasses.asdict(plan),
        "record_mb_per_step": size.layers * size.batch * size.seq * size.d * 4 / 1e6,
    }
    log(json.dumps(env))
    trainer = Trainer(size, device)
    for _ in range(3):
        trainer.step()
    synchronize(device)
    items = contenders(trainer)
    for c in items:
        if c.skip:
            log(f"skipping {c.name}: {c.skip}")
    env["stats_reducer"] = next(c.note for c in items if c.name == "vartrace async stats")
    running = [c for c in items if not c.skip]
    no_async = next(c.skip for c in items if c.name == "vartrace async")
    result: dict[str, Any] = {"env": env, "skipped": {c.name: c.skip for c in items if c.skip}}
    if cuda:
        result["bandwidth"] = bandwidth(device)
        log(f"bandwidth {result['bandwidth']}")
    else:
        log("skipping bandwidth, sync-debug mode, sync counts: CUDA only")
    log(f"timing {len(running)} contenders ...")
    result["timing"] = time_contenders(trainer, running, plan)
    log("exactness ...")
    result["exactness"] = exactness(trainer, running, plan.exact_steps)
    if cuda:
        log("sync-debug mode 'error' ...")
        result["sync_debug"] = sync_debug(trainer, running)
    if args.compile:
        log("torch.compile(mode='reduce-overhead') ...")
        result["compiled"] = compiled_check(size, device, 6, async_ok=not no_async)
        log(f"  {result['compiled']}")
    if cuda:
        log("sync counts ...")  # last in this process: the GPU trace stays on
        result["syncs"] = count_syncs(trainer, running, plan.sync_steps)
    if args.no_csan:
        result["csan"] = {"skipped": "--no-csan"}
    elif not cuda:
        result["csan"] = {"skipped": "CUDA only"}
    elif no_async:
        result["csan"] = {"skipped": f"nothing async to sanitize: {no_async}"}
    else:
        timeout = max(60.0, BUDGET_S - (time.perf_counter() - _START) - 10)
        log(f"CUDA sanitizer child (timeout {timeout:.0f}s) ...")
        result["csan"] = csan(timeout)
    if "skipped" in result["csan"]:
        log(f"skipping the CUDA sanitizer: {result['csan']['skipped']}")
    result["bars"] = [
        {"bar": bar, "measured": measured, "verdict": verdict}
        for bar, measured, verdict in bars(result, items)
    ]
    result["seconds"] = time.perf_counter() - _START
    out = args.out / "gpu_check.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print_report(result, items, out)


if __name__ == "__main__":
    main()
