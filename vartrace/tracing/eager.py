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

_compiler = torch.compiler
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def dynamo_context() -> type | None:
    """Dynamo's context class (what `torch.compile` wraps a function in), if imported."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return None if frames is None else frames._TorchDynamoContext


def _disabled(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """`torch._dynamo.disable(fn)`, once `torch._dynamo` is fully imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "disable"):
        return dynamo.disable(fn)  # type: ignore[no-any-return]
    return None


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` kept out of `torch.compile` graphs, importing nothing (see the module); called
    with positional arguments only."""
    disabled = _disabled(fn)

    # A closure, not an object with __call__: a call of each traced method goes through it.
    # Positional arguments only (what wrapt and torch's module hooks pass): no dict a call.
    def call(*args: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = _disabled(fn)
            if disabled is None:
                return fn(*args)
        # `torch.compiler.is_compiling()` without its `is_scripting()` call: dynamo reads
        # `is_dynamo_compiling()` as true while it traces, and export sets the flag.
        if (
            not (_is_dynamo_compiling() or _compiler._is_compiling_flag)
            and _frame_callback() is None
        ):
            return fn(*args)
        return disabled(*args)

    return call
