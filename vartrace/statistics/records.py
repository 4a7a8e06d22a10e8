"""Statistics mode: a few float64 numbers per record, computed where the tensor lives.

[`stats`][vartrace.stats] makes a pre-save reducer.  For each tensor (or numpy array) record it
computes, on the tensor's own device and in float64 (one fused op,
`vartrace.statistics.summary`), the statistics of
`SUMMARY_FIELDS` (count, mean, std, min, max,
absmax, L2 norm over the finite values; counts of NaN, +inf, -inf and exact
zeros), optionally a histogram of the exponents `floor(log2|x|)` of the finite
non-zero values and quantiles of a fixed strided sample.  The record becomes one
small float64 tensor, so an accelerator's records leave the device
asynchronously like any other (tens of bytes instead of the tensor), and the
step never waits: no `.item()`, no op whose output size depends on the data,
autocast off.  Values of other types (ints, strings, None) pass unchanged.

The record tensor describes itself: its first element is a NaN whose payload
names the layout (`is_statistics`), so in-memory results, gathers and the
file writer all recognise it.  The file stores each statistics record as one
row of a compound dataset whose fields are the statistic names
(`record_dtype`); reading it back (`Site.get`, `Site.record`) gives a
[`Statistics`][vartrace.Statistics] mapping, and `Site.values["absmax"]` the column.

Example:
    ```python
    import vartrace

    with vartrace.H5PYSaverCallback("stats.h5") as saver, vartrace.ModelTracer(
        model, ["**.forward", "**.forward@grad"],
        pre_save_callbacks=[vartrace.stats(histogram=True)],
        post_gather_callbacks=[saver], gathering_interval=50,
    ):
        train(model)

    with vartrace.open("stats.h5") as run:
        run["blocks.3.forward"].values["absmax"]     # one float per step
        run.to_frame("absmax")
    ```
"""

from __future__ import annotations

import fnmatch
import math
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np

from vartrace.statistics.compiled import dense_row
from vartrace.statistics.fields import COUNTS, SUMMARY_FIELDS
from vartrace.statistics.kernels import BLOCK, cpu_summary, summarize_values, summary

__all__ = [
    "Statistics",
    "StatsReducer",
    "as_statistics",
    "is_statistics",
    "layout_of",
    "record_dtype",
    "stats",
]

_TAG = 0x7FF8_A57A_0000_0000  # a quiet NaN whose payload says "vartrace statistics"
_TAG_MASK = 0xFFFF_FFFF_0000_0000
_BIAS = 1024  # exponent bounds are stored biased, in 11 bits each
_MAX_QUANTILES = 511
_DOUBLE = struct.Struct("<d")
_UINT = struct.Struct("<Q")


class Layout(NamedTuple):
    """What a statistics record holds besides the summary fields.

    `bins`: `(low, high)` exponent bounds of the log2 histogram or `None`;
    `quantiles`: the probabilities of the sampled quantiles.
    """

    bins: tuple[int, int] | None
    quantiles: tuple[float, ...]

    @property
    def header(self) -> float:
        """The record's first element: the NaN naming this layout."""
        bits = _TAG | len(self.quantiles)
        if self.bins is not None:
            low, high = self.bins
            bits |= 1 << 31 | (low + _BIAS) << 20 | (high + _BIAS) << 9
        return float(_DOUBLE.unpack(_UINT.pack(bits))[0])

    @property
    def size(self) -> int:
        """Elements of a record tensor: header, summary, bins, probabilities, quantiles."""
        bins = 0 if self.bins is None else self.bins[1] - self.bins[0] + 1
        return 1 + len(SUMMARY_FIELDS) + bins + 2 * len(self.quantiles)

    @property
    def bin_names(self) -> list[str]:
        """Names of the histogram fields: `log2|x|<=L`, `log2|x|=e`..., `log2|x|>=H`."""
        if self.bins is None:
            return []
        low, high = self.bins
        return [
            f"log2|x|<={e}" if e == low else f"log2|x|>={e}" if e == high else f"log2|x|={e}"
            for e in range(low, high + 1)
        ]

    @property
    def fields(self) -> list[str]:
        """The stored fields, in order: summary, histogram bins, `q<p>` quantiles."""
        return [*SUMMARY_FIELDS, *self.bin_names, *(f"q{q:g}" for q in self.quantiles)]


def _bits(value: float) -> int:
    return int(_UINT.unpack(_DOUBLE.pack(value))[0])


def layout_of(header: float) -> Layout | None:
    """The layout named by a record's first element, or `None` when it names none."""
    bits = _bits(header)
    if bits & _TAG_MASK != _TAG:
        return None
    bins = None
    if bits >> 31 & 1:
        bins = ((bits >> 20 & 0x7FF) - _BIAS, (bits >> 9 & 0x7FF) - _BIAS)
    return Layout(bins, (math.nan,) * (bits & 0x1FF))


def _layout_of_record(values: np.ndarray) -> Layout | None:
    """The full layout (probabilities read from the record) of a 1-D float64 record."""
    if values.dtype != np.float64 or values.ndim != 1 or not len(values):
        return None
    layout = layout_of(float(values[0]))
    if layout is None or layout.size != len(values):
        return None
    count = len(layout.quantiles)
    start = len(values) - 2 * count
    return layout._replace(quantiles=tuple(float(q) for q in values[start : start + count]))


def is_statistics(value: Any) -> bool:
    """Whether `value` is a statistics record made by [`stats`][vartrace.stats] (a tensor or array).

    Example:
        ```python
        is_statistics(vartrace.stats()("x", torch.ones(3), 1))   # True
        ```
    """
    array = _host_array(value)
    return array is not None and _layout_of_record(array) is not None


def as_statistics(value: Any) -> Statistics | None:
    """`value` as a `Statistics` (read back, or a record in memory), else `None`.

    Example:
        ```python
        as_statistics(run["blocks.0.forward"].get(3))["absmax"]
        ```
    """
    if isinstance(value, Statistics):
        return value
    array = _host_array(value)
    compound = None if array is None else to_compound(array)
    return None if compound is None else Statistics(compound)


def _host_array(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype != torch.float64 or value.ndim != 1 or not value.is_cpu:
            return None
        return value.detach().numpy()
    return None


def record_dtype(layout: Layout) -> np.dtype:
    """The compound dtype a file stores a record of `layout` as: counts int64, else float64."""
    counts = set(COUNTS) | set(layout.bin_names)
    return np.dtype([(f, np.int64 if f in counts else np.float64) for f in layout.fields])


def to_compound(values: np.ndarray) -> np.ndarray | None:
    """A statistics record (1-D float64 array) as a 0-d compound array; `None` otherwise."""
    layout = _layout_of_record(values)
    if layout is None:
        return None
    count = len(layout.quantiles)
    kept = np.concatenate([values[1 : len(values) - 2 * count], values[len(values) - count :]])
    dtype = record_dtype(layout)
    out = np.zeros((), dtype)
    for name, number in zip(dtype.names or (), kept.tolist(), strict=True):
        out[name] = number
    return out


class Statistics(Mapping[str, float]):
    """One statistics record read back: a read-only mapping statistic name -> number.

    Counts are ints, the rest floats.  [`histogram`][vartrace.Statistics.histogram] gives the log2
    histogram as `{exponent: count}` (the first and last bins also hold
    what lies beyond), [`quantiles`][vartrace.Statistics.quantiles] `{probability: value}`.

    Example:
        ```python
        s = run["blocks.0.forward"].get(iteration=5)
        s["absmax"], s["nan"], s.quantiles
        ```
    """

    __slots__ = ("_row",)

    def __init__(self, row: Any) -> None:
        self._row = np.asarray(row)

    @classmethod
    def of(cls, record: Any) -> Statistics:
        """The statistics of an in-memory record (a tensor made by [`stats`][vartrace.stats])."""
        statistics = as_statistics(record)
        if statistics is None:
            raise ValueError(f"not a statistics record: {type(record).__name__}")
        return statistics

    def statistic(self, name: str) -> float:
        """One statistic as a float: a stored field, `var` from `std`, else NaN.

        Example: `s.statistic("var") == s["std"] ** 2`.
        """
        if name in (self._row.dtype.names or ()):
            return float(self._row[name])
        if name == "var":
            return float(self._row["std"]) ** 2
        return math.nan

    @property
    def dtype(self) -> np.dtype:
        """The compound dtype of the record (as the file stores it)."""
        return self._row.dtype

    @property
    def row(self) -> np.ndarray:
        """The record as the file stores it: a 0-d array of the compound
        [`dtype`][vartrace.Statistics.dtype]."""
        return self._row

    def __getitem__(self, name: str) -> Any:
        if name not in (self._row.dtype.names or ()):
            raise KeyError(name)
        return self._row[name].item()

    def __iter__(self) -> Iterator[str]:
        return iter(self._row.dtype.names or ())

    def __len__(self) -> int:
        return len(self._row.dtype.names or ())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Statistics) or other.dtype != self.dtype:
            return False
        mine, theirs = self._row.tolist(), other._row.tolist()
        return all(a == b or (a != a and b != b) for a, b in zip(mine, theirs, strict=True))

    __hash__ = None  # type: ignore[assignment]

    @property
    def histogram(self) -> dict[int, int]:
        """`{exponent: count}` of `floor(log2|x|)` over finite non-zero values."""
        out = {}
        for name in self:
            if name.startswith("log2|x|"):
                out[int(name.rsplit("=", 1)[1])] = self[name]
        return out

    @property
    def quantiles(self) -> dict[float, float]:
        """`{probability: value}` of the sampled quantiles."""
        return {float(name[1:]): self[name] for name in self if name.startswith("q")}

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={self[name]:.6g}" for name in SUMMARY_FIELDS)
        return f"Statistics({shown})"


class StatsReducer:
    """The pre-save callback made by [`stats`][vartrace.stats] (see there)."""

    #: Its records are new tensors that nothing else holds or writes: asynchronous
    #: staging takes them as they are, without a clone of its own.
    fresh_records = True

    def __init__(
        self,
        histogram: bool | tuple[int, int],
        quantiles: Sequence[float],
        sample: int,
        sites: Sequence[str] | None,
    ) -> None:
        if histogram is True:
            bins: tuple[int, int] | None = (-32, 32)
        elif histogram is False or histogram is None:
            bins = None
        else:
            low, high = (int(bound) for bound in histogram)
            if not -_BIAS < low < high < _BIAS:
                raise ValueError(
                    f"histogram bounds must satisfy -1024 < low < high < 1024, got {histogram!r}"
                )
            bins = (low, high)
        probabilities = tuple(float(q) for q in quantiles)
        if len(probabilities) > _MAX_QUANTILES or not all(0 <= q <= 1 for q in probabilities):
            raise ValueError(f"quantiles must be at most {_MAX_QUANTILES} numbers in [0, 1]")
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        self.layout = Layout(bins, probabilities)
        self.sample = sample
        self._header = self.layout.header  # (computed, not looked up, by the property)
        #: Whether records hold more than the summary: a histogram or quantiles.
        self._extras = bins is not None or bool(probabilities)
        # A record before its statistics: the header, the probabilities, NaN quantiles.
        self._template = np.full(self.layout.size, math.nan)
        self._template[0] = self.layout.header
        if probabilities:
            self._template[-2 * len(probabilities) : -len(probabilities)] = probabilities
        self.sites = None if sites is None else [sites] if isinstance(sites, str) else list(sites)
        self._constants: dict[Any, tuple[Any, Any]] = {}

    def __repr__(self) -> str:
        return (
            f"vartrace.stats(histogram={self.layout.bins}, quantiles={self.layout.quantiles}, "
            f"sample={self.sample}, sites={self.sites})"
        )

    def __call__(self, name: str, value: Any, iteration: int) -> Any:
        """`value`'s statistics record.  A built-in callback never breaks the step: a value
        it cannot reduce (a dtype torch cannot read, a device out of memory) becomes a
        marker, with a warning the first time its site gives one."""
        if self.sites is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.sites):
            return value
        try:
            if not self._extras:  # a plain CPU tensor's row, without the checks below
                row = dense_row(value, self._header, BLOCK)
                if row is not None:
                    return row
            return self._reduce(value)
        except Exception as error:
            from vartrace.tensors import (
                failed_reduction,  # (torch is there: a tensor raised)
            )

            return failed_reduction(value, name, "vartrace.stats()", error)

    def _reduce(self, value: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            if value.is_nested:
                value = _elements(value)
            if value.layout is not torch.strided or value.is_meta or value.is_quantized:
                return value
            if value.numel() == 1:  # a scalar (a loss): its value says more than 11 numbers
                return value
            if value.is_cpu:  # the op's kernel, called directly: no dispatch, no contexts
                if self._extras:
                    return torch.from_numpy(self._host(_numbers(value.detach())))
                return cpu_summary(value, self._header)
            return self._tensor(value)
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.size != 1:
            return self._host(np.abs(value) if value.dtype.kind == "c" else value)
        return value

    # -- the host definition: vartrace.statistics.named ---------------------------------------

    def _host(self, array: np.ndarray) -> np.ndarray:
        layout = self.layout
        out = self._template.copy()
        out[1 : 1 + len(SUMMARY_FIELDS)] = summarize_values(array)
        if not self._extras:
            return out
        row = array.reshape(1, -1).astype(np.float64, copy=False)
        at = 1 + len(SUMMARY_FIELDS)
        if layout.bins is not None:
            low, high = layout.bins
            finite = np.isfinite(row[0]) & (row[0] != 0)
            exponent = np.frexp(np.where(finite, row[0], 1.0))[1] - 1
            index = np.clip(exponent, low, high) - low
            counts = np.bincount(index[finite], minlength=high - low + 1)
            out[at : at + len(counts)] = counts
            at += len(counts)
        if layout.quantiles:
            count = len(layout.quantiles)
            sample = row[0][:: _step(row.size, self)]
            ordered = np.sort(np.where(np.isfinite(sample), sample, np.inf))
            finite_count = int(np.isfinite(sample).sum())
            if finite_count:
                low, high, weight = _positions(finite_count, out[at : at + count])
                below, above = ordered[low.astype(int)], ordered[high.astype(int)]
                with np.errstate(invalid="ignore"):
                    out[at + count :] = below + (above - below) * weight
        return out

    # -- a tensor where it lives: the fused summary op, the extras in torch, without a sync -----

    def _tensor(self, tensor: Any) -> Any:
        """The record of a tensor on its device: header and summary by ONE op
        (`vartrace.statistics.summary`) when no histogram or quantiles are asked for."""
        import torch

        device = tensor.device
        if self._extras and tensor.numel() == 0:  # known from the shape: a constant record
            return torch.from_numpy(self._host(np.empty(0))).to(device, non_blocking=True)
        autocast = torch.autocast(device.type, enabled=False) if _autocasts(device) else None
        with torch.no_grad(), autocast or nullcontext():
            if not self._extras:
                return summary(tensor, self._header)
            header, probabilities = self._constant(device)
            parts = [header, summary(tensor)]
            parts += self._device_extras(_float64(tensor.detach()).reshape(-1), probabilities)
            return torch.cat(parts)

    def _device_extras(self, x: Any, probabilities: Any) -> list[Any]:
        """The histogram and quantile parts of a record of float64 values `x` (torch)."""
        import torch

        parts = []
        layout = self.layout
        finite = torch.isfinite(x)
        if layout.bins is not None:
            low, high = layout.bins
            nonzero = finite & (x != 0)
            exponent = torch.frexp(torch.where(nonzero, x, 1.0)).exponent - 1
            index = (exponent.clamp(low, high) - low).long()
            bins = torch.zeros(high - low + 1, dtype=torch.float64, device=x.device)
            parts.append(bins.scatter_add_(0, index, nonzero.to(torch.float64)))
        if layout.quantiles:
            sample = x[:: _step(x.numel(), self)]
            kept = torch.isfinite(sample)
            ordered = torch.sort(torch.where(kept, sample, math.inf)).values
            count = kept.sum()
            low, high, weight = _positions(count, probabilities)
            below, above = ordered[low.long()], ordered[high.long()]
            nan = torch.full((), math.nan, dtype=torch.float64, device=x.device)
            quantile = torch.where(count > 0, below + (above - below) * weight, nan)
            parts += [probabilities, quantile]
        return parts

    def _constant(self, device: Any) -> tuple[Any, Any]:
        """The header and the quantile probabilities on `device`, copied there once."""
        constants = self._constants.get(device)
        if constants is None:
            import torch

            host = torch.tensor([self.layout.header, *self.layout.quantiles], dtype=torch.float64)
            on_device = host.to(device, non_blocking=True)
            constants = self._constants[device] = (on_device[:1], on_device[1:])
        return constants


def _positions(count: Any, probabilities: Any) -> tuple[Any, Any, Any]:
    """Linear-interpolation quantiles of `count` sorted finite values (numpy or torch arrays):
    the positions below and above each probability and the weight of the upper one."""
    position = probabilities * (count - 1)
    low = (position // 1).clip(0, None)
    return low, (-(-position // 1)).clip(0, None), position - low


#: CPU tensor dtypes whose values numpy reads as they are (no conversion by torch first).
_NUMPY_DTYPES = frozenset(
    f"torch.{name}"
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")
)


def _step(size: int, reducer: StatsReducer) -> int:
    """Stride of the quantile sample: at most `reducer.sample` values, evenly spread."""
    return max(1, -(-size // reducer.sample))


def _elements(nested: Any) -> Any:
    """A nested tensor's elements (strided or jagged layout) as one flat tensor: its
    components' elements one after the other, reduced together."""
    import torch

    parts = [part.reshape(-1) for part in nested.detach().unbind()]
    if not parts:
        return torch.empty(0, dtype=nested.dtype, device=nested.device)
    return torch.cat(parts)


def _numbers(tensor: Any) -> np.ndarray:
    """A CPU tensor's values as numpy: its own array where numpy has the dtype (converted
    to float64 by the reduction), else a float64 copy (bfloat16, float8, bool, complex)."""
    if str(tensor.dtype) in _NUMPY_DTYPES:
        return tensor.numpy()
    return _float64(tensor).numpy()


def _float64(tensor: Any) -> Any:
    """A tensor as float64 (exact for every float and int dtype up to 2**53; complex: |x|)."""
    import torch

    if tensor.is_complex():
        tensor = tensor.abs()
    return tensor.to(torch.float64)


def _autocasts(device: Any) -> bool:
    import torch

    try:
        return bool(torch.is_autocast_enabled(device.type))
    except RuntimeError:  # a device type autocast does not know: nothing to switch off
        return False


def stats(
    *,
    histogram: bool | tuple[int, int] = False,
    quantiles: Sequence[float] = (),
    sample: int = 4096,
    sites: str | Sequence[str] | None = None,
) -> StatsReducer:
    """A pre-save reducer that turns each tensor record into its float64 statistics.

    A scalar (a 0-d tensor or array, or one of one element: a loss passed to
    `vartrace.record`) is kept as its value: its statistics would only repeat it.
    Per record, on the tensor's own device: `count` (elements), `mean`,
    `std` (population), `min`, `max`, `absmax` and `norm` (L2) over
    the finite values, and the counts `nan`, `posinf`, `neginf` and
    `zeros`; non-finite values are counted, never poisoning the others.
    Every value is upcast exactly to float64 (bfloat16, float16, float8, ints), a block at
    a time: the summary is one op per record (`vartrace.statistics.summary`), one
    read of the tensor without a float64 copy of it; a histogram or quantiles add an
    eager pass over a float64 copy.

    Args:
        histogram: `True` adds a histogram of `floor(log2|x|)` over the
            finite non-zero values, one bin per exponent from -32 to 32 (the
            end bins also count what lies beyond); `(low, high)` picks the
            bounds (e.g. `(-10, 9)` for float8 e4m3).
        quantiles: probabilities in [0, 1] whose quantiles (linear
            interpolation, over finite values) are taken on a strided sample
            of at most `sample` elements.
        sites: glob patterns of the site names to reduce (`"**@grad"` is
            `"*@grad"` here: fnmatch over the whole name); the other sites'
            records are kept whole.  Default: every site.

    Example:
        ```python
        tracer = ModelTracer(model, ["**.forward", "**@grad"],
                             pre_save_callbacks=[vartrace.stats(histogram=True)])
        ```
    """
    return StatsReducer(histogram, quantiles, sample, sites)
