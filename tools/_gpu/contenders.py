"""The contenders of ``gpu_check.py``: the untraced step, hooks copying block outputs (the
floor and what peers do), and vartrace's variants; options this vartrace lacks are detected
and their contenders carry the reason they are skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _harness import discard
from torch import nn

import vartrace
from _gpu.logs import describe
from _gpu.model import GPT, Trainer
from vartrace import H5PYSaverCallback, ModelTracer

SITES = ["blocks.*", "wpe.weight"]  # every block output; a frozen parameter
GRAD_SITES = ["blocks.*@grad"]
TINY_SITES = ["blocks.*.ln1.weight"]  # a few KB each, changed by every optimizer step
GATHERING_INTERVAL = 8

Records = dict[tuple[str, int], torch.Tensor]  # (site, iteration) -> a CPU copy


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
