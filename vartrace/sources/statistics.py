"""Statistics of record values: the named reducers and the numeric view of one value.

Example::

    stat_function("std")(np.ones((2, 3)))      # array([0., 0.]): one float per record
    value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "STATS",
    "reduce_block",
    "stat_function",
    "value_as_array",
    "value_dtype_name",
]

#: Largest block (bytes per read, as float64) read or converted in one go.
BLOCK_BYTES = 64 << 20


def _magnitude(block: np.ndarray) -> np.ndarray:
    return np.abs(block) if block.dtype.kind == "c" else block


def _rows_norm(block: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("ij,ij->i", block, block))


#: Statistics a frame or plot can carry, by name (those of ``Run.to_frame``, plus ``var``);
#: each reduces a (records, elements) float64 array (complex values by magnitude) to one
#: float per record.  ``std`` and ``var`` are the population ones.
STATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda b: b.mean(axis=1),
    "std": lambda b: b.std(axis=1),
    "var": lambda b: b.var(axis=1),
    "min": lambda b: b.min(axis=1),
    "max": lambda b: b.max(axis=1),
    "norm": _rows_norm,
    "absmax": lambda b: np.abs(b).max(axis=1),
}


def stat_function(stat: str) -> Callable[[np.ndarray], np.ndarray]:
    """The vectorised reducer of a statistic name from :data:`STATS`.

    Example::

        stat_function("std")(np.ones((2, 3)))   # array([0., 0.])
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose one of {', '.join(STATS)}")
    return STATS[stat]


def reduce_block(fn: Callable[[np.ndarray], Any], block: np.ndarray) -> np.ndarray:
    """Apply a statistic to a (k, *shape) numeric block: float64, magnitudes for complex."""
    k = block.shape[0]
    flat = _magnitude(block.reshape(k, -1)).astype(np.float64, copy=False)
    if flat.shape[1] == 0:
        return np.full(k, math.nan)
    with np.errstate(all="ignore"):
        return np.asarray(fn(flat), dtype=np.float64).reshape(k)


def value_as_array(value: Any) -> np.ndarray | None:
    """A numpy view of a numeric record value, or ``None`` for anything else.

    Tensors are detached and moved to the CPU; bfloat16 and float8 become
    float32 (exactly).  Python and numpy scalars become 0-d arrays.

    Example::

        value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in "biufc" else None
    if isinstance(value, (bool, int, float, complex, np.generic)):
        try:
            array = np.asarray(value)
        except OverflowError:
            return None
        return array if array.dtype.kind in "biufc" else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.is_floating_point() and tensor.dtype not in (
            torch.float16,
            torch.float32,
            torch.float64,
        ):
            tensor = tensor.float()
        return tensor.cpu().resolve_conj().resolve_neg().numpy()
    return None


def value_dtype_name(value: Any) -> str:
    """The dtype of a record value, named as ``Run.to_frame`` names it.

    Tensors and numpy values give their dtype (``"float32"``, ``"bfloat16"``);
    Python scalars their type (``"int"``, ``"float"``); ``"str"``, ``"bytes"``,
    ``"none"``; any other object ``"pickle"`` (how a file stores it).

    Example::

        value_dtype_name(torch.zeros(1))   # "float32"
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.name
    if value is None:
        return "none"
    if isinstance(value, (bool, int, float, complex, str, bytes)):
        return type(value).__name__
    return "pickle"
