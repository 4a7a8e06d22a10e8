"""Which values the asynchronous path stages: dense tensors of a device whose torch module has
streams and events (`stageable`), and that module (`stream_module`).

Example:
    ```python
    if stageable(value):
        stager.admit(site, value, iteration)
    ```
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["stageable", "stream_module"]

_STREAM_API = ("Stream", "Event", "current_stream", "stream")


_stream_modules: dict[str, ModuleType | None] = {}


def stream_module(device: torch.device) -> ModuleType | None:
    """The device's torch module (`torch.cuda`...) when it has streams and events."""
    kind = device.type
    if kind not in _stream_modules:
        try:
            module = torch.get_device_module(kind)
        except (RuntimeError, AttributeError):
            module = None
        usable = module is not None and all(hasattr(module, n) for n in _STREAM_API)
        _stream_modules[kind] = module if usable else None
    return _stream_modules[kind]


def stageable(value: Any) -> bool:
    """Whether `value` is a dense accelerator tensor that a `Stager` copies asynchronously.

    CPU and meta tensors, sparse, quantized and nested tensors, tensor
    subclasses that flatten into other tensors (`DTensor`, float8
    wrappers) and functorch wrappers are copied at admission instead.
    """
    return (
        isinstance(value, torch.Tensor)
        and not value.is_cpu
        and not value.is_meta
        and value.layout is torch.strided
        and not value.is_quantized
        and not value.is_nested
        and not is_traceable_wrapper_subclass(value)
        and not torch._C._functorch.is_functorch_wrapped_tensor(value)
        and stream_module(value.device) is not None
    )
