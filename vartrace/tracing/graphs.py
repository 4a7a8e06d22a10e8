"""Module outputs and parameters inside `torch.compile(fullgraph=True)` regions, recorded
from the graph.

Nothing may leave a fullgraph region to run eagerly, so a patched method there would make
Dynamo raise inside the step.  A module's whole output and the parameters and buffers
its `forward` reads through `self` need no patch: forward hooks that Dynamo traces into
the graph hand each tensor of the output to the op `vartrace::record_output`, and each
parameter to `vartrace::record_read` when the module is entered.  The graph keeps both
(they are marked side-effectful) and runs them at every call of the compiled code; their
implementations give the tensor the graph computed (for a parameter, the parameter
itself, whose `.grad` a `@grad` site watches) to the tracer's record path, which tags it
with the iteration counted outside the graph.  Locals, arguments, keys below an output
and an output's gradient still need the method's frame or the autograd tensor:
`graph_recordable` says which targets can be recorded so.

Example:
    ```python
    outputs = GraphOutputs()
    if graph_recordable(target):
        outputs.attach(undo, target, hook)   # hook.sink receives the block's output
    ```
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vartrace._support.warnings import warn
from vartrace.engine.patching import Hook
from vartrace.engine.structures import select
from vartrace.tracing.counting import counting_hooks
from vartrace.tracing.modules import fullgraph_regions
from vartrace.tracing.sites import Target

__all__ = ["GraphOutputs", "graph_recordable", "in_fullgraph", "warn_compiled"]


@dataclass(frozen=True)
class _Recorder:
    """What one traced module records from its graph: its output under `output` (`None`:
    not traced), and the parameters and buffers it reads, `(site, tensor, grad)`."""

    hook: Hook
    output: str | None
    reads: tuple[tuple[str, torch.Tensor, bool], ...]


_RECORDERS: dict[int, _Recorder] = {}  # by key, the constant a graph passes to the ops
_KEYS = itertools.count()


@torch.library.custom_op("vartrace::record_output", mutates_args=())
def _record_output(value: torch.Tensor, key: int, below: str) -> None:
    """Hand `value`, a tensor of a module's output, to the hook registered under `key`;
    `below` is its key in the output (`.0`, `.logits`; empty: the output itself)."""
    recorder = _RECORDERS.get(key)
    if recorder is None or recorder.output is None:
        return  # the tracer stopped; a graph compiled while it ran may still call this
    hook = recorder.hook
    hook.calls += 1
    if hook.enabled:
        hook.sink(recorder.output + below, value, False)


@torch.library.custom_op("vartrace::record_read", mutates_args=())
def _record_read(value: torch.Tensor, key: int, index: int, grad_mode: bool) -> None:
    """The module registered under `key` is entered: record its `index`-th read (a
    parameter, a buffer: the tensor itself, so that `@grad` watches its `.grad`), in the
    caller's `grad_mode` (the op itself runs below autograd)."""
    recorder = _RECORDERS.get(key)
    if recorder is None:
        return
    hook = recorder.hook
    hook.calls += index == 0
    if hook.enabled:
        site, tensor, grad = recorder.reads[index]
        with torch.set_grad_enabled(grad_mode):
            hook.sink(site, tensor, grad)


@_record_output.register_fake
def _(value: torch.Tensor, key: int, below: str) -> None:
    return None


@_record_read.register_fake
def _(value: torch.Tensor, key: int, index: int, grad_mode: bool) -> None:
    return None


for _op in (torch.ops.vartrace.record_output.default, torch.ops.vartrace.record_read.default):
    torch.fx.node.has_side_effect(_op)


def _reads(target: Target) -> list[tuple[str, torch.Tensor, bool]] | None:
    """The tensors `target` reads through `self` at entry (`fc.weight`, `head.forward.self.
    weight@grad`), found now; `None` if it reads anything else there (an argument), or
    a value that is not a tensor."""
    found: list[tuple[str, torch.Tensor, bool]] = []
    for selector in target.probe().entry:
        if selector.variable != "self":
            return None
        for site, leaf in select(target.module, selector.pattern, selector.states, selector.site):
            if not isinstance(leaf, torch.Tensor):
                return None
            found.append((site + selector.suffix, leaf, selector.grad))
    return found


def graph_recordable(target: Target) -> bool:
    """Whether what `target` reads can be recorded from a graph: its module's whole output
    (no key below it, no gradient) and the parameters and buffers it reads through `self`
    (with `@grad`), but no local, no argument."""
    probe = target.probe()
    return (
        target.method.name == "forward"
        and not (probe.exit or probe.every or probe.calls)
        and all(s.whole and not s.grad and s.callee is None for s in probe.returns)
        and _reads(target) is not None
    )


def in_fullgraph(
    model: nn.Module, seen: Sequence[tuple[str, nn.Module]], targets: Sequence[Target]
) -> set[int]:
    """The ids of the `targets` inside `model`'s fullgraph regions (those `seen` on a
    compile wrapper before unwrapping, and those found now), each recorded from the
    graph (see `graph_recordable`).

    Raises `ValueError` before the step for any other target inside one, where Dynamo
    would raise at the first traced method, and for a model compiled whole so, whose
    calls count iterations.
    """
    found = [*seen, *fullgraph_regions(model)]
    regions = list({id(module): (path, module) for path, module in found}.values())
    inside = {id(module) for _, region in regions for module in region.modules()}
    in_graph = [t for t in targets if id(t.module) in inside]
    # A model compiled whole: nothing counts its calls, nothing inside is recorded.
    blocked = in_graph if id(model) in inside else [t for t in in_graph if not graph_recordable(t)]
    if blocked or id(model) in inside:
        names = ", ".join(f"{t.path or '<root>'}.{t.method.name}" for t in blocked)
        if id(model) in inside:  # then every traced method is inside too
            names += " and the model, whose calls count iterations"
        raise ValueError(
            f"cannot trace under torch.compile(fullgraph=True): "
            f"{', '.join(path or '<root>' for path, _ in regions)} compiled with "
            f"fullgraph=True hold the traced methods {names}, which must "
            "run eagerly, outside the graph; compile without fullgraph=True while tracing "
            "(only the traced methods leave the graph), or trace sites outside those modules "
            "(a module's whole output is recorded from inside the graph, and so are its "
            "parameters and their @grad: name the module or the parameter)"
        )
    return {id(t) for t in in_graph}


_MAX_DEPTH = 4


def _record_tensors(value: Any, key: int, below: str, depth: int) -> None:
    """Record the tensors of a module's output from the graph: a tensor, and those in
    tuples, lists and dicts (a `ModelOutput`), named by their keys as in eager mode;
    Dynamo unrolls the walk when it traces the hook."""
    if isinstance(value, torch.Tensor):
        torch.ops.vartrace.record_output(value, key, below)
    elif depth < _MAX_DEPTH and isinstance(value, (tuple, list)):
        for index, part in enumerate(value):
            _record_tensors(part, key, f"{below}.{index}", depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, dict):
        for name, part in value.items():
            _record_tensors(part, key, f"{below}.{name}", depth + 1)


class GraphOutputs:
    """The forward hooks of one tracer that record from inside graphs."""

    def attach(self, undo: contextlib.ExitStack, target: Target, hook: Hook) -> None:
        """Record what `target` reads (see `graph_recordable`) through `hook` (its sink,
        `enabled` and `calls`) until `undo` closes."""
        key = next(_KEYS)
        returns = target.probe().returns
        reads = tuple(_reads(target) or ())
        tensors = [tensor for _, tensor, _ in reads]
        _RECORDERS[key] = _Recorder(hook, returns[0].site if returns else None, reads)
        undo.callback(_RECORDERS.pop, key, None)

        def before(module: nn.Module, args: Any) -> None:
            for index, tensor in enumerate(tensors):
                torch.ops.vartrace.record_read(tensor, key, index, torch.is_grad_enabled())

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if returns:
                _record_tensors(output, key, "", 0)

        counting_hooks(undo, target.module, self, before, after)


def warn_compiled(targets: Sequence[Target], in_graph: set[int]) -> None:
    """Warn that a compiled model runs the traced methods of `targets` eagerly (all but
    those recorded from inside a fullgraph region, `in_graph` by id)."""
    names = ", ".join(
        f"{t.path or '<root>'}.{t.method.name}" for t in targets if id(t) not in in_graph
    )
    if names:  # else every traced site is a module output recorded from a graph
        warn(
            "vartrace: the model is compiled; these traced methods run eagerly while "
            f"tracing (excluded from torch.compile): {names}"
        )
