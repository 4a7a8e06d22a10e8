"""The references vartrace's record path is measured against: bare floors and a minimal tracer.

A *bare floor* captures the same variables of the same code objects through the same
mechanism as vartrace's frame core on this Python (``sys.monitoring`` ``PY_RETURN`` on 3.12+,
``sys.settrace`` return events before) and does nothing else.  The *minimal tracer* adds the
least of vartrace's record semantics; ``engine_only`` is vartrace's engine without a tracer.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from types import CodeType, FrameType
from typing import Any

# Variables a floor reads at return, by the name of the class whose forward holds them
# (None: every argument and local), mirroring TRACED_PATHS and ALL_LOCALS_PATHS.
FLOOR_READS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "traced": {"GPT": ("x",), "Attention": ("scores",), "MLP": ("h",)},
    "all locals": {"Attention": None},
    "loop": {"Block": ("h",)},
}

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
