"""Keeping the tracer's code out of `torch.compile` without importing `torch._dynamo` first.

`torch._dynamo` costs seconds of CPU to import, and a model can only be compiled once it
is imported (`torch.compile` imports it).  `eager(fn)` is `fn` while it is not imported,
and `torch._dynamo.disable(fn)` from the first call after it is: a model compiled after
the tracer started still runs the tracer's code eagerly, outside the graph.  The disabled
wrapper is taken only where compiled code could see the call (dynamo traces it, or a
compiled frame's evaluation hook is installed): an eager model calls `fn` directly, which
spares every record the wrapper's few microseconds (`torch.optim` imports dynamo, so a
training script has it imported whether or not it compiles).

Example:
    ```python
    enter = eager(tracer_enter)   # no torch._dynamo import
    enter(module)                 # plain call, or the disabled one under a compiled model
    ```
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["dynamo_context", "eager"]

_is_compiling = torch.compiler.is_compiling
_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def dynamo_context() -> type | None:
    """Dynamo's context class (what `torch.compile` wraps a function in), if imported."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return None if frames is None else frames._TorchDynamoContext


class _Eager:
    """`fn`, run under `torch._dynamo.disable` once `torch._dynamo` is imported."""

    __slots__ = ("_disabled", "_fn")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._disabled: Callable[..., Any] | None = None
        self._prepare()

    def _prepare(self) -> Callable[..., Any] | None:
        if self._disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is not None and hasattr(dynamo, "disable"):  # fully imported
                self._disabled = dynamo.disable(self._fn)
        return self._disabled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        disabled = self._disabled or self._prepare()
        if disabled is None or (not _is_compiling() and _frame_callback() is None):
            return self._fn(*args, **kwargs)
        return disabled(*args, **kwargs)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` kept out of `torch.compile` graphs, importing nothing (see the module)."""
    return _Eager(fn)
