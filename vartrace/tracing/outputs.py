"""A module's output as its caller receives it: after the forward hooks that replace it.

`forward()` returns a value that `module(...)` may still hand through forward hooks
(QAT's fake-quantizing observer, tensor parallel's output hooks) before the caller gets
it.  A tracer's `OutputWatch` registers a pre-hook and an always-called forward hook on
each module whose output it records; when its patched `forward` returns inside such a
call, the return-value selectors (`Deferred`) are held, and the forward hook, kept
last among the module's hooks (global ones run before), emits them on the output the
hooks left.  A `forward` called directly (`model.forward(x)`) runs no hooks: it emits
at once.

Example:
    ```python
    watch = OutputWatch()
    watch.attach(undo, model.fc1, trailing=lambda: ())
    probe = replace(probe, returns=tuple(watch.defer(model.fc1, s) for s in probe.returns))
    ```
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vartrace.engine.patching import Probe, Selector, Sink
from vartrace.tracing.counting import counting_hooks
from vartrace.tracing.eager import eager
from vartrace.tracing.sites import Target

__all__ = ["Deferred", "OutputWatch"]


@dataclass
class _Call:
    """One `module(...)` call in progress: the selectors its `forward` returned to."""

    module: nn.Module
    pending: list[tuple[Selector, Sink, set[str] | None]] = field(default_factory=list)


class OutputWatch:
    """The calls of the modules whose outputs a tracer records, per thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _calls(self) -> list[_Call]:
        calls: list[_Call] | None = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def attach(
        self,
        undo: contextlib.ExitStack,
        module: nn.Module,
        trailing: Callable[[], Sequence[int]],
    ) -> None:
        """Watch `module`'s calls (hooks left out of its copies, removed by `undo`);
        `trailing()` gives the ids of forward hooks that must still run after the output
        is emitted (the tracer's counting hook, which ends an iteration)."""
        last: list[int] = []  # the id of `after`, once registered

        def before(module: nn.Module, args: Any) -> None:
            hooks: Any = module._forward_hooks  # an OrderedDict
            for hook_id in (*last, *trailing()):
                if hook_id in hooks and next(reversed(hooks)) != hook_id:
                    hooks.move_to_end(hook_id)
            self._calls().append(_Call(module))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            calls = self._calls()
            if not calls or calls[-1].module is not module:
                return
            call = calls.pop()
            if sys.exc_info()[0] is not None:
                return  # forward or a hook raised: the caller receives nothing
            for selector, sink, seen in call.pending:
                selector.emit(output, sink, seen)

        last.append(counting_hooks(undo, module, self, eager(before), eager(after))[1])

    def probe(
        self, undo: contextlib.ExitStack, target: Target, counting: dict[int, list[int]]
    ) -> Probe:
        """What to capture from `target`; a module's output (the return value of its
        `forward`) as its caller receives it, after its forward hooks, which run before
        the `counting` hooks of the module that end an iteration."""
        probe = target.probe()
        module = target.module
        if target.method.name != "forward" or not probe.returns:
            return probe
        self.attach(undo, module, lambda: counting.get(id(module), []))
        returns = tuple(self.defer(module, s) for s in probe.returns)
        return dataclasses.replace(probe, returns=returns)

    def defer(self, module: nn.Module, selector: Selector) -> Selector:
        """`selector` (a return value of `module.forward`) emitting what `module(...)`
        hands its caller."""
        return Deferred(
            selector.variable,
            selector.site,
            selector.pattern,
            selector.states,
            grad=selector.grad,
            callee=selector.callee,
            tag=selector.tag,
            renamed=selector.renamed,
            inner=selector,
            watch=self,
            module=module,
        )

    def hold(
        self, module: nn.Module, selector: Selector, sink: Sink, seen: set[str] | None
    ) -> bool:
        """Hold `selector` until the forward hooks of `module`'s call in progress ran;
        `False` when `forward` was called directly (no such call)."""
        calls = self._calls()
        if not calls or calls[-1].module is not module:
            return False
        calls[-1].pending.append((selector, sink, seen))
        return True


@dataclass(frozen=True)
class Deferred(Selector):
    """A return value of a module's `forward`, emitted after the module's forward hooks
    (see `OutputWatch`); `inner` is the selector it stands for."""

    inner: Selector | None = None
    watch: OutputWatch | None = None
    module: nn.Module | None = None

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        assert self.inner is not None and self.watch is not None and self.module is not None
        if not self.watch.hold(self.module, self.inner, sink, seen):
            self.inner.emit(value, sink, seen)
