"""Detached copies of captured leaves, and bit-exact change detection.

A record must not change when the live value does, must not keep an
autograd graph alive, and must live on the tracer's ``device``.  Change
detection compares a new copy with the last one recorded for the site,
bit for bit: in-place writes that do not bump a tensor's version counter
(BatchNorm running statistics, writes through ``.data``) are still seen,
NaN equals NaN, and ``-0.0`` differs from ``0.0``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["copy_leaf", "same"]

_IMMUTABLE: frozenset[type] = frozenset(
    {int, float, bool, complex, str, bytes, type(None), type(Ellipsis)}
)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_uncopyable_warned: set[type] = set()


def copy_leaf(value: Any, device: torch.device) -> Any:
    """A detached, independent copy of ``value``; tensors land on ``device``.

    Example::

        record = copy_leaf(hidden, torch.device("cpu"))
    """
    if isinstance(value, torch.Tensor):
        detached = value.detach()
        if detached.device == device:
            return detached.clone(memory_format=torch.contiguous_format)
        return detached.to(device, copy=True, memory_format=torch.contiguous_format)
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, np.ndarray):
        return value.copy()
    try:
        return copy.deepcopy(value)
    except Exception as error:  # an object that refuses to be copied is kept as is
        if type(value) not in _uncopyable_warned:
            _uncopyable_warned.add(type(value))
            warnings.warn(
                f"vartrace: cannot copy a {type(value).__name__} ({error}); recording the live "
                "object, which later changes will alter",
                stacklevel=2,
            )
        return value


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool or tensor.is_quantized or tensor.layout != torch.strided:
        return tensor
    if tensor.dtype == torch.complex128:
        tensor = tensor.view(torch.float64)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


def same(a: Any, b: Any) -> bool:
    """Whether two recorded copies are identical, bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        try:
            return torch.equal(_bits(a), _bits(b))
        except RuntimeError:
            return False
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is float or type(a) is complex:
        return repr(a) == repr(b)
    try:
        return bool(a == b)
    except Exception:
        return False
