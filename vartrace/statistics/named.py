"""Statistics of record values: the named reducers and the numeric view of one value.

Example:
    ```python
    stat_function("std")(np.ones((2, 3)))      # array([0., 0.]): one float per record
    value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
    ```
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vartrace.statistics.fields import COUNTS, SUMMARY_FIELDS
from vartrace.statistics.records import as_statistics

__all__ = [
    "BLOCK_BYTES",
    "COUNTS",
    "STATS",
    "SUMMARY_FIELDS",
    "reduce_block",
    "stat_function",
    "statistic_of",
    "summarize",
    "summarize_block",
    "value_as_array",
    "value_dtype_name",
]

#: Largest block (bytes per read, as float64) read or converted in one go.
BLOCK_BYTES = 64 << 20


def _magnitude(block: np.ndarray) -> np.ndarray:
    return np.abs(block) if block.dtype.kind == "c" else block


class _Finite:
    """What the statistics of a (records, elements) float64 block share: its finite values.

    Every statistic is taken over the finite values; a block without NaN or
    infinities (the usual case) skips the masking.  Intermediate results are
    kept, so that `summarize` computes each once.
    """

    def __init__(self, block: np.ndarray) -> None:
        self.block = block
        rows, size = block.shape
        # A NaN or an infinity makes its row's sum non-finite: only such blocks are masked.
        self.total = block.sum(axis=1)
        self.clean = size > 0 and bool(np.isfinite(self.total).all())
        self.mask = np.ones((0, 0), bool)
        self.count = np.full(rows, size)
        self.zeroed = block
        if not self.clean:
            self.mask = np.isfinite(block)
            self.count = self.mask.sum(axis=1)
            self.zeroed = np.where(self.mask, block, 0.0)
            self.total = self.zeroed.sum(axis=1)
        self._mean: np.ndarray | None = None
        self._var: np.ndarray | None = None
        self._min: np.ndarray | None = None
        self._max: np.ndarray | None = None

    def _none_left(self, values: np.ndarray) -> np.ndarray:
        return values if self.clean else np.where(self.count > 0, values, math.nan)

    def mean(self) -> np.ndarray:
        if self._mean is None:
            self._mean = self.total / self.count
        return self._mean

    def var(self) -> np.ndarray:
        """Population variance, two-pass (the device reducer's too)."""
        if self._var is None:
            centred = self.zeroed - self.mean()[:, None]
            if not self.clean:
                centred = np.where(self.mask, centred, 0.0)
            self._var = np.einsum("ij,ij->i", centred, centred) / self.count
        return self._var

    def min(self) -> np.ndarray:
        if self._min is None:
            kept = self.block if self.clean else np.where(self.mask, self.block, math.inf)
            self._min = self._none_left(kept.min(axis=1, initial=math.inf))
        return self._min

    def max(self) -> np.ndarray:
        if self._max is None:
            kept = self.block if self.clean else np.where(self.mask, self.block, -math.inf)
            self._max = self._none_left(kept.max(axis=1, initial=-math.inf))
        return self._max

    def absmax(self) -> np.ndarray:
        return np.maximum(-self.min(), self.max())  # exact: the largest |x| is -min or max

    def norm(self) -> np.ndarray:
        """sqrt(sum x**2) = sqrt(count * (var + mean**2)): no pass of its own over the data."""
        mean = self.mean()
        return np.where(self.count > 0, np.sqrt(self.count * (self.var() + mean * mean)), 0.0)

    def nonfinite(self, test: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        if self.clean:
            return np.zeros(self.block.shape[0])
        return test(self.block).sum(axis=1).astype(np.float64)

    def zeros(self) -> np.ndarray:
        rows, size = self.block.shape
        if rows == 1:  # one record (the reducer's case): numpy's one-pass count
            return np.array([float(size - np.count_nonzero(self.block))])
        return (self.block == 0).sum(axis=1).astype(np.float64)


_FIELDS: dict[str, Callable[[_Finite], np.ndarray]] = {
    "count": lambda f: f.block.shape[1] + np.zeros(f.block.shape[0]),
    "mean": _Finite.mean,
    "std": lambda f: np.sqrt(f.var()),
    "var": _Finite.var,
    "min": _Finite.min,
    "max": _Finite.max,
    "absmax": _Finite.absmax,
    "norm": _Finite.norm,
    "nan": lambda f: f.nonfinite(np.isnan),
    "posinf": lambda f: f.nonfinite(lambda b: b == math.inf),
    "neginf": lambda f: f.nonfinite(lambda b: b == -math.inf),
    "zeros": _Finite.zeros,
}


def _statistic(name: str) -> Callable[[np.ndarray], np.ndarray]:
    field = _FIELDS[name]
    return lambda block: field(_Finite(block))


#: Statistics a frame or plot can carry, by name; each reduces a (records, elements) float64
#: array (complex values by magnitude) to one float per record.  One definition everywhere
#: (``Run.to_frame``, ``vartrace show``/``plot``/``compare`` and the reducer
#: :func:`vartrace.stats`): ``mean``, ``std``, ``var`` (population), ``min``, ``max``,
#: ``absmax`` and ``norm`` are taken over the *finite* values only (NaN when there is none;
#: ``norm`` is then 0), and ``nan``, ``posinf``, ``neginf`` count the values left out;
#: ``zeros`` counts exact zeros and ``count`` every element.
STATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {name: _statistic(name) for name in _FIELDS}


def summarize(block: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Several `STATS` of a (records, elements) float64 block, sharing the work.

    Example:
        ```python
        summarize(np.array([[1.0, np.nan, 3.0]]), ["mean", "nan"])   # mean 2, nan 1
        ```
    """
    with np.errstate(all="ignore"):
        finite = _Finite(block)
        return {name: _FIELDS[name](finite) for name in names}


def stat_function(stat: str) -> Callable[[np.ndarray], np.ndarray]:
    """The vectorised reducer of a statistic name from `STATS`.

    Example:
        ```python
        stat_function("std")(np.ones((2, 3)))   # array([0., 0.])
        ```
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose one of {', '.join(STATS)}")
    return STATS[stat]


def reduce_block(fn: Callable[[np.ndarray], Any], block: np.ndarray) -> np.ndarray:
    """Apply a statistic to a (k, *shape) numeric block: float64, magnitudes for complex.

    Example:
        ```python
        reduce_block(STATS["max"], np.array([[1.0, -np.inf, 3.0]]))   # array([3.])
        ```
    """
    k = block.shape[0]
    with np.errstate(all="ignore"):
        return np.asarray(fn(_float_rows(block)), dtype=np.float64).reshape(k)


def _float_rows(block: np.ndarray) -> np.ndarray:
    """A (k, *shape) numeric block as (k, elements) float64 (complex values by magnitude)."""
    return _magnitude(block.reshape(block.shape[0], -1)).astype(np.float64, copy=False)


def summarize_block(block: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
    """`summarize` of a (k, *shape) numeric block, as `reduce_block` takes it.

    Example:
        ```python
        summarize_block(np.ones((2, 3), np.float32), ["mean", "zeros"])["mean"]   # [1., 1.]
        ```
    """
    return summarize(_float_rows(block), names)


def value_as_array(value: Any) -> np.ndarray | None:
    """A numpy view of a numeric record value, or `None` for anything else.

    Tensors are detached and moved to the CPU; bfloat16 and float8 become
    float32 (exactly).  Python and numpy scalars become 0-d arrays.

    Example:
        ```python
        value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
        ```
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
    """The dtype of a record value, named as `Run.to_frame` names it.

    Tensors and numpy values give their dtype (`"float32"`, `"bfloat16"`);
    Python scalars their type (`"int"`, `"float"`); `"str"`, `"bytes"`,
    `"none"`; any other object `"pickle"` (how a file stores it).

    Example:
        ```python
        value_dtype_name(torch.zeros(1))   # "float32"
        ```
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
    """`value` as a `vartrace.Statistics` when it is a statistics record, else `None`."""
    if not isinstance(value, (np.ndarray, Mapping)) and "torch" not in sys.modules:
        return None
    return as_statistics(value)


def statistic_of(value: Any, stat: str) -> float:
    """One statistic (a `STATS` name, or a field of a statistics record) of one record.

    A statistics record ([`vartrace.stats`][vartrace.stats]) gives its stored field, a numeric
    value is reduced by `STATS`, anything else gives NaN.

    Example:
        ```python
        statistic_of(np.array([1.0, -np.inf]), "neginf")   # 1.0
        ```
    """
    statistics = _statistics(value)
    if statistics is not None:
        return statistics.statistic(stat)
    array = value_as_array(value)
    if array is None or stat not in STATS:
        return math.nan
    return float(reduce_block(STATS[stat], array[None])[0])
