"""A statistic of every record of one site in one file, with its dtype and shape: the
file side of `to_frame`.

Records in a numeric `values` dataset are read in large blocks and a named
statistic is taken of all records of one shape at once; the others are read
one by one.  Raw-bit records (bfloat16, float8...) are decoded to 64-bit numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from vartrace.statistics.named import STATS, reduce_block
from vartrace.storage.codec import KIND_NAMES, Kind, decode_raw, from_array, in_values
from vartrace.storage.guard import check_read
from vartrace.storage.site_reader import Part

__all__ = ["describe"]

_READ_BLOCK = 64 << 20  # bytes read at once by to_frame
_REDUCE_BYTES = 16 << 20  # bytes (as float64) a statistic of records of one shape takes at once


def describe(
    part: Part, stat: str | Callable[[Any], Any], allow_pickle: bool, name: str
) -> list[tuple[Any, str, tuple[int, ...]]]:
    """Per row: the statistic of the record, its dtype name and its shape.

    Records in a numeric `values` dataset are read in blocks and a named
    statistic is taken of all records of one shape in a block at once; the
    others (and every record for a callable `stat`) one by one.
    """
    kinds = part.tags["kinds"]
    rows: list[Any] = [None] * len(kinds)
    if part.storage == "array":
        assert part.values is not None
        part.check(name)
        record_bytes = part.itemsize * math.prod(part.padded)
        step = max(1, _READ_BLOCK // max(1, record_bytes))
        held = np.flatnonzero(in_values(kinds))
        _check_shapes(part, held)
        for begin in range(0, len(kinds), step):
            stop = min(begin + step, len(kinds))  # rows past the committed ones: unflushed
            check_read(part.values, (stop - begin) * record_bytes // part.itemsize)
            block = part.values[begin:stop]
            taken = held[(held >= begin) & (held < stop)]
            if callable(stat):
                _describe_each(part, stat, block, begin, taken, rows, name)
            else:
                numeric = decode_raw(block, part.torch_dtype, width=64, where=f"site {name!r}")
                _describe_block(part, stat, numeric, begin, taken, rows)
    for row, kind in enumerate(kinds & 0x7F):
        if rows[row] is not None:
            continue
        if kind == Kind.PICKLE and not allow_pickle and not callable(stat):
            rows[row] = (np.nan, "pickle", ())
            continue
        value = part.read(row, allow_pickle, f"row {row} of site {name!r}")
        if hasattr(value, "dtype") and hasattr(value, "shape"):
            dtype, shape = str(value.dtype).removeprefix("torch."), tuple(value.shape)
        else:
            dtype, shape = KIND_NAMES[kind], ()
        rows[row] = (_apply(stat, value, _numeric(value)), dtype, shape)
    return rows


def _check_shapes(part: Part, rows: np.ndarray) -> None:
    """Check the true shapes of records `rows` of `values` as `shape` checks
    one: the first outside the padded shape raises its error."""
    shapes = part.shapes[rows]
    outside = ((shapes < 0) | (shapes > np.asarray(part.padded, np.int64))).any(axis=1)
    if outside.any():
        part.shape(int(rows[np.flatnonzero(outside)[0]]))


def _describe_each(
    part: Part,
    stat: Callable[[Any], Any],
    block: np.ndarray,
    begin: int,
    taken: np.ndarray,
    rows: list[Any],
    name: str,
) -> None:
    """The callable `stat` of each record `taken` of `block` (rows from `begin`)."""
    kinds = part.tags["kinds"].tolist()
    for row in taken.tolist():
        shape = tuple(part.shapes[row].tolist())
        cut = (row - begin, *(slice(0, n) for n in shape))
        value = from_array(kinds[row], block[cut], part.torch_dtype, f"row {row} of {name!r}")
        rows[row] = (stat(value), part.dtype, shape)


def _describe_block(
    part: Part, stat: str, numeric: np.ndarray, begin: int, taken: np.ndarray, rows: list[Any]
) -> None:
    """The statistic `stat` of the records `taken` of `numeric` (rows from
    `begin`): a field of each statistics record, or `STATS` of all records of
    one shape at once."""
    dtype = part.dtype
    shapes = part.shapes[taken]
    if numeric.dtype.names:  # statistics records: a field of each
        for row, shape in zip(taken.tolist(), shapes.tolist(), strict=True):
            cut = (row - begin, *(slice(0, n) for n in shape))
            rows[row] = (_apply(stat, None, numeric[cut]), dtype, tuple(shape))
        return
    if not len(shapes) or (shapes == shapes[0]).all():  # one shape: the usual case
        unique, group_of = shapes[:1], np.zeros(len(shapes), np.intp)
    else:
        unique, group_of = np.unique(shapes, axis=0, return_inverse=True)
    for group, shape in enumerate(unique.tolist()):
        members = taken if len(unique) == 1 else taken[group_of.reshape(-1) == group]
        found = _reduced(stat, numeric, members - begin, tuple(shape))
        for row, value in zip(members.tolist(), found, strict=True):
            rows[row] = (value, dtype, tuple(shape))


def _reduced(stat: str, numeric: np.ndarray, at: np.ndarray, shape: tuple[int, ...]) -> list[float]:
    """`STATS` `stat` of the records at `at` of `numeric`, all of `shape`
    (NaN for a name that is no statistic), a slice of `_REDUCE_BYTES` at a time."""
    if stat not in STATS:
        return [np.nan] * len(at)
    cut = (slice(None), *(slice(0, n) for n in shape))
    step = max(1, _REDUCE_BYTES // max(1, 8 * math.prod(shape)))
    found: list[float] = []
    for first in range(0, len(at), step):
        some = at[first : first + step]
        whole = len(some) == some[-1] - some[0] + 1  # consecutive rows: a view
        records = numeric[some[0] : some[-1] + 1] if whole else numeric[some]
        found += reduce_block(STATS[stat], records[cut]).tolist()
    return found


def _numeric(value: Any) -> np.ndarray | None:
    """A numeric record as a numpy array (tensors of any dtype included), else `None`."""
    from vartrace.statistics.records import Statistics

    if isinstance(value, Statistics):
        return value.row
    if hasattr(value, "detach"):  # a tensor
        import torch

        tensor = value.detach()
        if tensor.is_complex():
            return tensor.to(torch.complex128).numpy()
        return tensor.numpy() if tensor.dtype == torch.bool else tensor.double().numpy()
    if isinstance(value, (bool, int, float, complex)):
        try:
            return np.asarray(value, complex if isinstance(value, complex) else float)
        except OverflowError:  # an int beyond float64: no float statistic of it
            return None
    if isinstance(value, (np.ndarray, np.generic)) and np.asarray(value).dtype.kind in "biufc":
        return np.asarray(value)
    return None


def _apply(stat: str | Callable[[Any], Any], value: Any, numeric: np.ndarray | None) -> Any:
    if callable(stat):
        return stat(value)
    if numeric is not None and numeric.dtype.names:  # a statistics record: its own field
        from vartrace.statistics.records import Statistics

        return Statistics(numeric).statistic(stat)
    if numeric is None or stat not in STATS:
        return np.nan
    return float(reduce_block(STATS[stat], numeric.reshape(1, -1))[0])
