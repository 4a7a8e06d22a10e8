"""Statistics of every record of one site in one file, with its dtype and shape: the
file side of `to_frame`.

Records in a numeric `values` dataset are read in large blocks, each block once for
all the statistics asked: the named statistics are taken of all records of one shape
at once (a column of statistics records is read as one array); the other records are
read one by one.  Raw-bit records (bfloat16, float8...) are decoded to 64-bit numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vartrace.statistics.named import STATS, reduce_block, summarize_block
from vartrace.storage.codec import KIND_NAMES, Kind, decode_raw, from_array, in_values
from vartrace.storage.guard import check_read
from vartrace.storage.site_reader import Part

__all__ = ["Columns", "describe"]

_READ_BLOCK = 64 << 20  # bytes read at once by to_frame
_REDUCE_BYTES = 16 << 20  # bytes (as float64) a statistic of records of one shape takes at once

Stat = str | Callable[[Any], Any]
#: Per statistic its column (float64 for a name, a list for a callable), then the
#: dtype name and the shape of each record.
Columns = tuple[list[Any], list[str], list[tuple[int, ...]]]


def describe(part: Part, stats: Sequence[Stat], allow_pickle: bool, name: str) -> Columns:
    """The column of each statistic of `stats` over the records of `part`, their dtype
    names and their shapes.

    Records in a numeric `values` dataset are read in blocks, each once for all of
    `stats`; a name is taken of all records of one shape in a block at once, a
    callable of each record.  The others are read one by one.
    """
    kinds = part.tags["kinds"]
    rows = len(kinds)
    columns: list[Any] = [[None] * rows if callable(s) else np.full(rows, np.nan) for s in stats]
    dtypes: list[Any] = [None] * rows
    shapes: list[Any] = [None] * rows
    named = [(column, s) for column, s in enumerate(stats) if not callable(s)]
    calls = [(column, s) for column, s in enumerate(stats) if callable(s)]
    held = np.zeros(0, np.intp)
    if part.storage == "array":
        assert part.values is not None
        part.check(name)
        record_bytes = part.itemsize * math.prod(part.padded)
        step = max(1, _READ_BLOCK // max(1, record_bytes))
        held = np.flatnonzero(in_values(kinds))
        _check_shapes(part, held)
        for begin in range(0, rows, step):
            stop = min(begin + step, rows)  # rows past the committed ones: unflushed
            check_read(part.values, (stop - begin) * record_bytes // part.itemsize)
            block = part.values[begin:stop]
            taken = held[(held >= begin) & (held < stop)]
            for column, call in calls:
                _describe_each(part, call, block, begin, taken, columns[column], name)
            if named:
                numeric = decode_raw(block, part.torch_dtype, width=64, where=f"site {name!r}")
                _describe_block(part, named, numeric, begin, taken, columns)
        dtype = part.dtype
        for row, shape in zip(held.tolist(), part.shapes[held].tolist(), strict=True):
            dtypes[row], shapes[row] = dtype, tuple(shape)
    others = np.ones(rows, bool)
    others[held] = False
    for row in np.flatnonzero(others).tolist():
        kind = int(kinds[row]) & 0x7F
        if kind == Kind.PICKLE and not allow_pickle and not calls:
            dtypes[row], shapes[row] = "pickle", ()
            continue
        value = part.read(row, allow_pickle, f"row {row} of site {name!r}")
        if hasattr(value, "dtype") and hasattr(value, "shape"):
            dtypes[row], shapes[row] = str(value.dtype).removeprefix("torch."), tuple(value.shape)
        else:
            dtypes[row], shapes[row] = KIND_NAMES[kind], ()
        as_numbers = _numeric(value)
        for column, stat in enumerate(stats):
            columns[column][row] = _apply(stat, value, as_numbers)
    return columns, dtypes, shapes


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
    column: list[Any],
    name: str,
) -> None:
    """The callable `stat` of each record `taken` of `block` (rows from `begin`)."""
    kinds = part.tags["kinds"].tolist()
    for row in taken.tolist():
        shape = tuple(part.shapes[row].tolist())
        cut = (row - begin, *(slice(0, n) for n in shape))
        value = from_array(kinds[row], block[cut], part.torch_dtype, f"row {row} of {name!r}")
        column[row] = stat(value)


def _describe_block(
    part: Part,
    named: list[tuple[int, str]],
    numeric: np.ndarray,
    begin: int,
    taken: np.ndarray,
    columns: list[Any],
) -> None:
    """The statistics `named` (column, name) of the records `taken` of `numeric` (rows
    from `begin`): fields of statistics records, or `STATS` of all records of one
    shape at once."""
    shapes = part.shapes[taken]
    if numeric.dtype.names:  # statistics records
        _fields(named, numeric, taken - begin, shapes, columns, taken)
        return
    if not len(shapes) or (shapes == shapes[0]).all():  # one shape: the usual case
        unique, group_of = shapes[:1], np.zeros(len(shapes), np.intp)
    else:
        unique, group_of = np.unique(shapes, axis=0, return_inverse=True)
    names = [stat for _, stat in named if stat in STATS]
    for group, shape in enumerate(unique.tolist()):
        members = taken if len(unique) == 1 else taken[group_of.reshape(-1) == group]
        found = _reduced(names, numeric, members - begin, tuple(shape))
        for column, stat in named:
            if stat in found:
                columns[column][members] = found[stat]


def _fields(
    named: list[tuple[int, str]],
    numeric: np.ndarray,
    at: np.ndarray,
    shapes: np.ndarray,
    columns: list[Any],
    rows: np.ndarray,
) -> None:
    """The statistics `named` of the statistics records at `at` of `numeric` (the
    records `rows` of the site): a stored field as a column, `var` from `std`."""
    if shapes.shape[1] or numeric.ndim != 1:  # records of several statistics: each alone
        for row, place, shape in zip(rows.tolist(), at.tolist(), shapes.tolist(), strict=True):
            cut = (place, *(slice(0, n) for n in shape))
            for column, stat in named:
                columns[column][row] = _apply(stat, None, numeric[cut])
        return
    fields = numeric.dtype.names or ()
    for column, stat in named:
        if stat in fields:
            columns[column][rows] = numeric[stat][at]
        elif stat == "var" and "std" in fields:  # as `Statistics.statistic`: Python's pow
            columns[column][rows] = [float(std) ** 2 for std in numeric["std"][at].tolist()]


def _reduced(
    names: list[str], numeric: np.ndarray, at: np.ndarray, shape: tuple[int, ...]
) -> dict[str, np.ndarray]:
    """The `STATS` `names` of the records at `at` of `numeric`, all of `shape`, sharing
    the work (`summarize_block`), a slice of `_REDUCE_BYTES` at a time."""
    if not names or not len(at):
        return {}
    cut = (slice(None), *(slice(0, n) for n in shape))
    step = max(1, _REDUCE_BYTES // max(1, 8 * math.prod(shape)))
    found: dict[str, list[np.ndarray]] = {stat: [] for stat in names}
    for first in range(0, len(at), step):
        some = at[first : first + step]
        whole = len(some) == some[-1] - some[0] + 1  # consecutive rows: a view
        records = numeric[some[0] : some[-1] + 1] if whole else numeric[some]
        for stat, values in summarize_block(records[cut], names).items():
            found[stat].append(np.asarray(values, np.float64).reshape(len(some)))
    return {stat: np.concatenate(pieces) for stat, pieces in found.items()}


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
