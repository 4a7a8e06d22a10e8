"""Module outputs inside `torch.compile(fullgraph=True)` regions, recorded from the graph.

Nothing may leave a fullgraph region to run eagerly, so a patched method there would make
Dynamo raise inside the step.  A module's whole output needs no patch: a forward hook
that Dynamo traces into the graph hands each tensor of the output to the op
`vartrace::record_output`, which the graph keeps (it is marked side-effectful) and which
runs, at every call of the compiled code, with the tensor the graph computed.  The op's
implementation gives it to the tracer's record path, which tags it with the iteration
counted outside the graph.  Locals, arguments and keys below an output still need the
method's frame: `graph_recordable` says which targets can be recorded so.

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
from typing import Any

import torch
from torch import nn

from vartrace.engine.patching import Hook
from vartrace.tracing.counting import counting_hooks
from vartrace.tracing.modules import fullgraph_regions
from vartrace.tracing.sites import Target

__all__ = ["GraphOutputs", "graph_recordable", "in_fullgraph"]

_RECORDERS: dict[int, tuple[Hook, str]] = {}  # key -> the hook and site it records for
_KEYS = itertools.count()


@torch.library.custom_op("vartrace::record_output", mutates_args=())
def _record_output(value: torch.Tensor, key: int, index: int) -> None:
    """Hand `value`, the `index`-th tensor of a module's output (-1: the output itself),
    to the hook registered under `key`."""
    found = _RECORDERS.get(key)
    if found is None:
        return  # the tracer stopped; a graph compiled while it ran may still call this
    hook, site = found
    if index <= 0:
        hook.calls += 1
    if hook.enabled:
        hook.sink(site if index < 0 else f"{site}.{index}", value, False)


@_record_output.register_fake
def _(value: torch.Tensor, key: int, index: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.vartrace.record_output.default)


def graph_recordable(target: Target) -> bool:
    """Whether `target` only reads its module's whole output (no local, no argument, no
    key below the output, no gradient): what a forward hook in the graph can record."""
    probe = target.probe()
    return (
        target.method.name == "forward"
        and not (probe.entry or probe.exit or probe.every or probe.calls)
        and all(s.whole and not s.grad and s.callee is None for s in probe.returns)
    )


def in_fullgraph(
    model: nn.Module, seen: Sequence[tuple[str, nn.Module]], targets: Sequence[Target]
) -> set[int]:
    """The ids of the `targets` inside `model`'s fullgraph regions (those `seen` on a
    compile wrapper before unwrapping, and those found now), each a module output
    recorded from the graph.

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
            "(a module's whole output is recorded from inside the graph: name the module)"
        )
    return {id(t) for t in in_graph}


class GraphOutputs:
    """The forward hooks of one tracer that record module outputs from inside graphs."""

    def attach(self, undo: contextlib.ExitStack, target: Target, hook: Hook) -> None:
        """Record the output of `target`'s module through `hook` (its sink and its
        `enabled`, `calls`) until `undo` closes."""
        key = next(_KEYS)
        _RECORDERS[key] = (hook, target.probe().returns[0].site)
        undo.callback(_RECORDERS.pop, key, None)

        def before(module: nn.Module, args: Any) -> None:
            return None

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                torch.ops.vartrace.record_output(output, key, -1)
            elif isinstance(output, (tuple, list)):
                for index, part in enumerate(output):
                    if isinstance(part, torch.Tensor):
                        torch.ops.vartrace.record_output(part, key, index)

        counting_hooks(undo, target.module, self, before, after)
