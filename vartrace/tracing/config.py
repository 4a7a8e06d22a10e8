"""A tracer's options, validated once into a frozen `TracerConfig`.

`TracerConfig.from_options` takes what `ModelTracer(...)` was given, raises the
`TypeError` or `ValueError` that names a wrong option (in the order the arguments
are listed), and resolves the defaults that depend on the machine or the model
(the record device's index, `staging="auto"`, `max_host_bytes`).  Nothing in the
config changes afterwards: the tracer reads it, never writes it.
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from vartrace._support import warnings as _warnings
from vartrace.distributed.groups import gather_group
from vartrace.staging import OnFull, check_device_bytes
from vartrace.statistics.records import stats
from vartrace.trace import Trace
from vartrace.tracing.modules import fullgraph_regions, is_compiled, unwrap

__all__ = [
    "Gather",
    "GatherCallback",
    "Mode",
    "PreSave",
    "StagingMode",
    "TracerConfig",
    "callback_name",
    "warn_unused_savers",
]

PreSave = Callable[[str, Any, int], Any]
GatherCallback = Callable[[str, Trace], None]
Mode = Literal["train", "eval", "any"]
StagingMode = Literal["auto", "async", "sync"]
Gather = bool | Literal["node"]


@dataclass(frozen=True)
class TracerConfig:
    """What a `ModelTracer` was asked to do, checked and with its defaults resolved.

    `model` is the unwrapped model (no DDP / compile wrapper); `fullgraph` the
    `fullgraph=True` regions seen on the wrapper before unwrapping; `staging` is
    `"async"` or `"sync"` (never `"auto"`); `pre_save_callbacks` begins with the
    reducer that `statistics=` asked for; `group` is the process group the gathers
    use (`group=`, or the DDP wrapper's; `None`: every rank); `joinable` the wrapper
    a `torch.distributed.algorithms.Join` may take (DDP), else `None`.
    """

    model: nn.Module
    fullgraph: tuple[tuple[str, nn.Module], ...]
    compiled: bool
    optimizer: torch.optim.Optimizer | None
    pre_save_callbacks: tuple[PreSave, ...]
    pre_gather_callbacks: tuple[GatherCallback, ...]
    post_gather_callbacks: tuple[GatherCallback, ...]
    post_trace_callbacks: tuple[GatherCallback, ...]
    gathering_interval: int
    trace_interval: int
    mode: Mode
    change_detection: bool
    device: torch.device
    gather: Gather
    strict: bool
    staging: Literal["async", "sync"]
    max_inflight_bytes: int
    on_full: OnFull
    max_host_bytes: int
    max_device_bytes: int | None
    group: Any = None
    joinable: Any = None

    @classmethod
    def from_options(
        cls,
        model: nn.Module,
        *,
        pre_save_callbacks: Iterable[PreSave],
        pre_gather_callbacks: Iterable[GatherCallback],
        post_gather_callbacks: Iterable[GatherCallback],
        post_trace_callbacks: Iterable[GatherCallback],
        gathering_interval: int,
        trace_interval: int,
        mode: Mode,
        change_detection: bool,
        device: str | torch.device,
        gather: Gather,
        strict: bool,
        optimizer: Any,
        staging: StagingMode,
        max_inflight_bytes: int,
        on_full: OnFull,
        max_host_bytes: int | None,
        max_device_bytes: int | None,
        statistics: bool | PreSave,
        group: Any = None,
    ) -> TracerConfig:
        """Check every option of `ModelTracer(...)` (see its docstring) and resolve the
        defaults; raise `TypeError` or `ValueError` naming the first wrong one."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        optimizer = None if optimizer is None else _torch_optimizer(optimizer)
        if mode not in ("train", "eval", "any"):
            raise ValueError(f"mode must be 'train', 'eval' or 'any', not {mode!r}")
        if staging not in ("auto", "async", "sync"):
            raise ValueError(f"staging must be 'auto', 'async' or 'sync', not {staging!r}")
        if on_full not in ("wait", "drop"):
            raise ValueError(f"on_full must be 'wait' or 'drop', not {on_full!r}")
        for name, flag in (
            ("change_detection", change_detection),
            ("gather", gather),
            ("strict", strict),
        ):
            if name == "gather" and not isinstance(flag, bool):
                if not (isinstance(flag, str) and flag == "node"):
                    raise _ChoiceError(
                        f"gather must be True or False, not {flag!r} (or 'node': one shard "
                        "per node)"
                    )
            elif not isinstance(flag, bool):  # "no" would be true
                raise TypeError(f"{name} must be True or False, not {flag!r}")
        max_inflight_bytes = _positive("max_inflight_bytes", max_inflight_bytes)
        max_host_bytes = (
            _default_host_bytes()
            if max_host_bytes is None
            else _positive("max_host_bytes", max_host_bytes)
        )
        max_device_bytes = check_device_bytes(max_device_bytes)
        if group is not None and gather == "node":
            raise ValueError(
                "gather='node' gathers within each node's ranks; it takes no group=: pass "
                "gather=True to gather within the group"
            )
        # The DDP wrapper's group, seen before unwrap; gather="node" makes groups of its own.
        group = None if gather == "node" else gather_group(model, group)
        fullgraph = tuple(fullgraph_regions(model))  # seen on the wrapper, before unwrap
        unwrapped = unwrap(model)
        pre_save = (*_statistics_reducer(statistics), *pre_save_callbacks)
        gather_stages = {
            "pre_gather_callbacks": tuple(pre_gather_callbacks),
            "post_gather_callbacks": tuple(post_gather_callbacks),
            "post_trace_callbacks": tuple(post_trace_callbacks),
        }
        _check_callbacks("pre_save_callbacks", pre_save, ("name", "value", "iteration"))
        for stage, callbacks in gather_stages.items():
            _check_callbacks(stage, callbacks, ("name", "trace"))
        gathering_interval = _positive("gathering_interval", gathering_interval)
        trace_interval = _positive("trace_interval", trace_interval)
        record_device = _record_device(device)
        if staging == "auto":
            on_device = record_device.type != "cpu" or _on_accelerator(model)
            staging = "async" if on_device else "sync"
        return cls(
            model=unwrapped,
            fullgraph=fullgraph,
            compiled=is_compiled(model),
            optimizer=optimizer,
            pre_save_callbacks=pre_save,
            **gather_stages,
            gathering_interval=gathering_interval,
            trace_interval=trace_interval,
            mode=mode,
            change_detection=change_detection,
            device=record_device,
            gather=gather,
            strict=strict,
            staging=staging,
            max_inflight_bytes=max_inflight_bytes,
            on_full=on_full,
            max_host_bytes=max_host_bytes,
            max_device_bytes=max_device_bytes,
            group=group,
            joinable=model if hasattr(model, "_join_config") else None,
        )

    @property
    def callbacks(self) -> tuple[object, ...]:
        """Every callback of every stage, in the order of the stages."""
        return (
            *self.pre_save_callbacks,
            *self.pre_gather_callbacks,
            *self.post_gather_callbacks,
            *self.post_trace_callbacks,
        )


class _ChoiceError(TypeError, ValueError):
    """An option that is neither of the flags nor a word it takes (`gather="nodes"`): a
    `ValueError` naming the choices, and the `TypeError` a flag of the wrong type raises."""


def callback_name(callback: object) -> str:
    """How messages name `callback`: its qualified name, else its repr."""
    return getattr(callback, "__qualname__", None) or repr(callback)


def _check_callbacks(stage: str, callbacks: Sequence[Any], arguments: tuple[str, ...]) -> None:
    """Raise `TypeError` naming a callback that cannot be called with `arguments`."""
    for index, callback in enumerate(callbacks):
        if not callable(callback):
            raise TypeError(f"{stage}[{index}] is a {type(callback).__name__}, not callable")
        try:
            signature = inspect.signature(callback)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            wanted = f"cb({', '.join(arguments)})"
            hint = ""
            if stage == "pre_save_callbacks" and _binds(signature, 2):
                hint = _two_arguments_hint(signature)
            elif stage != "pre_save_callbacks" and _binds(signature, 3):
                hint = "; it takes (name, value, iteration): pass it in pre_save_callbacks"
            raise TypeError(
                f"{stage}[{index}] {callback_name(callback)} cannot be called as {wanted}{hint}"
            ) from None


def _two_arguments_hint(signature: inspect.Signature) -> str:
    """Advice for a pre-save callback that takes two arguments: a gather callback misplaced
    (its second parameter is a trace), or a pre-save callback without `iteration`."""
    second = list(signature.parameters.values())[1:2]
    if second and (
        second[0].name in ("trace", "chunk") or second[0].annotation in (Trace, "Trace")
    ):
        return "; it takes (name, trace): pass it in post_gather_callbacks"
    return (
        "; a pre-save callback is called with the iteration too: add a third parameter,"
        " def cb(name, value, iteration)"
    )


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def warn_unused_savers(callbacks: Sequence[object]) -> None:
    """Warn about savers created but given to no tracer, when this tracer has none: they
    would write nothing.  (A tracer given a saver may leave others to later tracers.)"""
    writer = sys.modules.get("vartrace.storage.writer")
    if writer is None:
        return
    if any(isinstance(callback, writer.H5PYSaverCallback) for callback in callbacks):
        return
    for saver in writer.unused_savers():
        if not any(saver is callback for callback in callbacks):
            _warnings.warn(
                f"vartrace: {saver!r} is not among this tracer's callbacks, so it will write "
                "nothing; pass it as ModelTracer(..., post_gather_callbacks=[saver])",
                stacklevel=3,
            )


def _record_device(device: str | torch.device) -> torch.device:
    """`device` with its index (`"cuda"` is the current CUDA device), or a clear error.

    Devices compare by type and index: `torch.device("cuda") != torch.device("cuda", 0)`,
    so an index left out would send every record through a copy.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "device='meta' would keep only shapes and dtypes, no values: record on 'cpu' "
            "or an accelerator"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise ValueError(
                f"device={str(device)!r}: this torch ({torch.__version__}) has {build}; "
                "record on device='cpu'"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={str(device)!r}: only {count} CUDA device(s) are visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps': MPS is not available in this torch")
    if device.type != "cpu" and device.index is None:
        current = getattr(torch.get_device_module(device.type), "current_device", None)
        if current is not None:
            device = torch.device(device.type, current())
    return device


def _on_accelerator(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` lives on an accelerator."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return any(not (t.is_cpu or t.is_meta) for t in tensors)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that `optimizer` is or wraps (accelerate's `AcceleratedOptimizer`
    in `.optimizer`, Lightning's `LightningOptimizer` in `._optimizer`), or `TypeError`.

    Its step post-hooks run once per step that really updates the parameters: a
    wrapper's `step` that skips the update (a gradient-accumulation micro-batch)
    counts no step.
    """
    current, seen = optimizer, set()
    while id(current) not in seen:
        seen.add(id(current))
        # A wrapper subclassing Optimizer without calling its __init__ lacks the hooks' dicts.
        if isinstance(current, torch.optim.Optimizer) and hasattr(
            current, "_optimizer_step_post_hooks"
        ):
            return current
        inner = getattr(current, "optimizer", None) or getattr(current, "_optimizer", None)
        if inner is None:
            break
        current = inner
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a wrapper holding one in .optimizer "
        f"or ._optimizer, not {type(optimizer).__name__}"
    )


def _statistics_reducer(statistics: bool | PreSave) -> list[PreSave]:
    """The pre-save reducer `ModelTracer(statistics=...)` asks for, as a list."""
    if statistics is False:
        return []
    if statistics is True:
        return [stats()]
    if callable(statistics) and not isinstance(statistics, bool):
        return [statistics]
    raise TypeError(
        f"statistics must be True, False or a reducer made by vartrace.stats(...), "
        f"not {statistics!r}"
    )


def _default_host_bytes() -> int:
    """A tenth of the machine's memory, at most 8 GiB (8 GiB where it cannot be read)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
    return min(8 << 30, memory // 10)


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value
