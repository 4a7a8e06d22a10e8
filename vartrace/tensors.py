"""Detached copies of captured leaves, and bit-exact change detection.

A record must not change when the live value does, must not keep an
autograd graph alive, and must live on the tracer's ``device``.  An object
that holds tensors in its attributes (a Hugging Face ``DynamicCache``) is
never recorded live: :func:`split_object` splits it into its tensors, and
an object that can be neither split nor copied is recorded as the string
``<vartrace: uncopyable TYPE>`` (with a warning).  Change
detection compares a new copy with the last one recorded for the site,
bit for bit: in-place writes that do not bump a tensor's version counter
(BatchNorm running statistics, writes through ``.data``) are still seen,
NaN equals NaN, and ``-0.0`` differs from ``0.0``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch

from vartrace.engine.structures import children

__all__ = ["copy_leaf", "same", "split_object", "uncopyable"]

_IMMUTABLE: frozenset[type] = frozenset(
    {int, float, bool, complex, str, bytes, type(None), type(Ellipsis)}
)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_uncopyable_warned: set[type] = set()
_MAX_STATE_DEPTH = 8
_MAX_STATE_OBJECTS = 4096  # an object reaching a whole program (a trainer) is not walked further


def uncopyable(value: Any) -> str:
    """The marker recorded in place of an object that can be neither copied nor split.

    Example::

        uncopyable(lock)   # '<vartrace: uncopyable lock>'
    """
    return f"<vartrace: uncopyable {type(value).__name__}>"


def _tensor_state(value: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """The tensors reachable from ``value`` through containers and attributes, with their paths."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= _MAX_STATE_DEPTH or type(value) in _IMMUTABLE:
        return
    if id(value) in seen or len(seen) >= _MAX_STATE_OBJECTS:
        return
    seen.add(id(value))
    kids = children(value)
    if kids is None:
        # Plain objects only: never walk the namespace of a class, module or function.
        plain = not isinstance(value, ModuleType) and not callable(value)
        kids = getattr(value, "__dict__", {}).items() if plain else ()
    for key, child in kids:
        yield from _tensor_state(child, f"{path}.{key}", depth + 1, seen)


def split_object(site: str, value: Any, warned: set[type]) -> Iterator[tuple[str, Any]]:
    """``(site, value)`` itself, or, for an object whose attributes hold tensors, those tensors.

    Recording such an object live (a ``DynamicCache`` refuses ``deepcopy``)
    would keep every tensor it holds, and their autograd graph, alive; its
    tensors are recorded instead, as leaves named by attribute path
    (``forward.past_key_values.layers.0.keys``).  Warns once per type
    (``warned`` holds the types already named).

    Example::

        list(split_object("forward.cache", cache, set()))
        # [('forward.cache.keys.0', tensor(...)), ('forward.cache.values.0', tensor(...))]
    """
    if type(value) in _IMMUTABLE or isinstance(value, (torch.Tensor, np.ndarray)):
        yield site, value
        return
    tensors = list(_tensor_state(value, site, 0, set()))
    if not tensors:
        yield site, value
        return
    if type(value) not in warned:
        warned.add(type(value))
        warnings.warn(
            f"vartrace: {site} is a {type(value).__name__} holding tensors; recording its "
            f"{len(tensors)} tensors ({tensors[0][0]}, ...) instead of the live object, "
            "which would keep their autograd graph alive",
            stacklevel=2,
        )
    yield from tensors


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
        marker = uncopyable(value)
        if type(value) not in _uncopyable_warned:
            _uncopyable_warned.add(type(value))
            warnings.warn(
                f"vartrace: cannot copy a {type(value).__name__} ({error}); recording the "
                f"marker {marker!r} instead of the live object",
                stacklevel=2,
            )
        return marker


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
