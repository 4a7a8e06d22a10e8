"""Statistics of record values: the named reducers and the numeric view of one value.

Example::

    stat_function("std")(np.ones((2, 3)))      # array([0., 0.]): one float per record
    value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "COUNTS",
    "STATS",
    "SUMMARY_FIELDS",
    "reduce_block",
    "stat_function",
    "statistic_of",
    "value_as_array",
    "value_dtype_name",
]

#: Largest block (bytes per read, as float64) read or converted in one go.
BLOCK_BYTES = 64 << 20


def _magnitude(block: np.ndarray) -> np.ndarray:
    return np.abs(block) if block.dtype.kind == "c" else block


def _finite(block: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(finite mask, finite count per row, block with non-finite values set to 0)."""
    finite = np.isfinite(block)
    return finite, finite.sum(axis=1), np.where(finite, block, 0.0)


def _none_finite(count: np.ndarray, values: np.ndarray) -> np.ndarray:
    return np.where(count > 0, values, math.nan)


def _mean(block: np.ndarray) -> np.ndarray:
    _, count, zeroed = _finite(block)
    return zeroed.sum(axis=1) / count


def _var(block: np.ndarray) -> np.ndarray:
    """Population variance over the finite values, two-pass (as the device reducer)."""
    finite, count, zeroed = _finite(block)
    centred = np.where(finite, block - (zeroed.sum(axis=1) / count)[:, None], 0.0)
    return np.einsum("ij,ij->i", centred, centred) / count


def _extreme(block: np.ndarray, fill: float, reduce: Callable[..., np.ndarray]) -> np.ndarray:
    finite = np.isfinite(block)
    return _none_finite(
        finite.sum(axis=1), reduce(np.where(finite, block, fill), axis=1, initial=fill)
    )


def _absmax(block: np.ndarray) -> np.ndarray:
    _, count, zeroed = _finite(block)
    return _none_finite(count, np.abs(zeroed).max(axis=1, initial=0.0))


def _norm(block: np.ndarray) -> np.ndarray:
    _, _, zeroed = _finite(block)
    return np.sqrt(np.einsum("ij,ij->i", zeroed, zeroed))


def _counter(test: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    return lambda block: test(block).sum(axis=1).astype(np.float64)


#: Statistics a frame or plot can carry, by name; each reduces a (records, elements) float64
#: array (complex values by magnitude) to one float per record.  One definition everywhere
#: (``Run.to_frame``, ``vartrace show``/``plot``/``compare`` and the device reducer
#: :func:`vartrace.stats`): ``mean``, ``std``, ``var`` (population), ``min``, ``max``,
#: ``absmax`` and ``norm`` are taken over the *finite* values only (NaN when there is none;
#: ``norm`` is then 0), and ``nan``, ``posinf``, ``neginf`` count the values left out;
#: ``zeros`` counts exact zeros and ``count`` every element.
STATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "count": lambda b: np.full(b.shape[0], float(b.shape[1])),
    "mean": _mean,
    "std": lambda b: np.sqrt(_var(b)),
    "var": _var,
    "min": lambda b: _extreme(b, math.inf, np.min),
    "max": lambda b: _extreme(b, -math.inf, np.max),
    "absmax": _absmax,
    "norm": _norm,
    "nan": _counter(np.isnan),
    "posinf": _counter(lambda b: b == math.inf),
    "neginf": _counter(lambda b: b == -math.inf),
    "zeros": _counter(lambda b: b == 0),
}

#: The statistics that count values (whole numbers), stored as integers by statistics mode.
COUNTS = ("count", "nan", "posinf", "neginf", "zeros")

#: The fields of every statistics-mode record (:func:`vartrace.stats`), in stored order.
SUMMARY_FIELDS = ("count", "mean", "std", "min", "max", "absmax", "norm", *COUNTS[1:])


def stat_function(stat: str) -> Callable[[np.ndarray], np.ndarray]:
    """The vectorised reducer of a statistic name from :data:`STATS`.

    Example::

        stat_function("std")(np.ones((2, 3)))   # array([0., 0.])
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose one of {', '.join(STATS)}")
    return STATS[stat]


def reduce_block(fn: Callable[[np.ndarray], Any], block: np.ndarray) -> np.ndarray:
    """Apply a statistic to a (k, *shape) numeric block: float64, magnitudes for complex.

    Example::

        reduce_block(STATS["max"], np.array([[1.0, -np.inf, 3.0]]))   # array([3.])
    """
    k = block.shape[0]
    flat = _magnitude(block.reshape(k, -1)).astype(np.float64, copy=False)
    with np.errstate(all="ignore"):
        return np.asarray(fn(flat), dtype=np.float64).reshape(k)


def value_as_array(value: Any) -> np.ndarray | None:
    """A numpy view of a numeric record value, or ``None`` for anything else.

    Tensors are detached and moved to the CPU; bfloat16 and float8 become
    float32 (exactly).  Python and numpy scalars become 0-d arrays.

    Example::

        value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
    """
    if _statistics(value) is not None:
        return None  # a statistics record is not an array of values: see statistic_of
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
    if _statistics(value) is not None:
        return "statistics"
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


def _statistics(value: Any) -> Any:
    """``value`` as a :class:`vartrace.Statistics` when it is a statistics record, else ``None``."""
    if not isinstance(value, (np.ndarray, Mapping)) and "torch" not in sys.modules:
        return None
    from vartrace.stat_records import as_statistics

    return as_statistics(value)


def statistic_of(value: Any, stat: str) -> float:
    """One statistic (a :data:`STATS` name, or a field of a statistics record) of one record.

    A statistics record (:func:`vartrace.stats`) gives its stored field, a numeric
    value is reduced by :data:`STATS`, anything else gives NaN.

    Example::

        statistic_of(np.array([1.0, -np.inf]), "neginf")   # 1.0
    """
    statistics = _statistics(value)
    if statistics is not None:
        return statistics.statistic(stat)
    array = value_as_array(value)
    if array is None or stat not in STATS:
        return math.nan
    return float(reduce_block(STATS[stat], array[None])[0])
