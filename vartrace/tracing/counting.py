"""The forward hooks a tracer puts on a model's modules to count their calls.

`counting_hooks` registers a pre-hook and an always-called hook on a module,
leaves them out of the module's copies and pickles (`copy.deepcopy`,
`torch.save`, averaged models), and puts their removal on the tracer's undo
stack.  `CallsBeforeStart` counts the calls of a model whose tracer was built
and never started, for the warning `never_started` gives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from vartrace._support import warnings as _warnings
from vartrace.engine.patching import filter_state

__all__ = ["CallsBeforeStart", "counting_hooks", "never_started"]

_MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _without_hooks(ids: set[int], state: dict[str, Any]) -> dict[str, Any]:
    """A module's state without the forward hooks registered under `ids`."""
    for name in _MODULE_HOOKS:
        hooks = state.get(name)
        if hooks and not ids.isdisjoint(hooks):
            state[name] = type(hooks)((key, v) for key, v in hooks.items() if key not in ids)
    return state


class CallsBeforeStart:
    """Counts the calls of a model whose tracer is not started yet (a forward pre-hook;
    a class of its own, so that a model saved with it still pickles)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.calls += 1


def never_started(handle: RemovableHandle, counter: CallsBeforeStart, model: str) -> None:
    """A tracer is collected (or the interpreter exits) without having started."""
    handle.remove()
    if counter.calls:
        _warnings.warn(
            f"vartrace: a ModelTracer of {model} was never started while the model ran "
            f"{counter.calls} time(s): nothing was recorded; use `with ModelTracer(...) as "
            "tracer:` around the steps, or tracer.start() before them and tracer.stop() after",
            UserWarning,
        )


def counting_hooks(
    undo: contextlib.ExitStack,
    module: nn.Module,
    key: object,
    before: Callable[..., None],
    after: Callable[..., None],
) -> list[int]:
    """Register `before` and `after` as `module`'s forward pre-hook and (always called)
    forward hook, left out of its copies and pickles under `key` (the tracer), and
    their removal on `undo`; return the two hooks' ids."""
    handles = [
        module.register_forward_pre_hook(before),
        module.register_forward_hook(after, always_call=True),
    ]
    filter_state(module, key, functools.partial(_without_hooks, {h.id for h in handles}))
    undo.callback(filter_state, module, key, None)
    for handle in handles:
        undo.callback(handle.remove)
    return [handle.id for handle in handles]
