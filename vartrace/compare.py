"""Compare two runs record by record and find where they start to differ.

:func:`compare` takes two runs — HDF5 files (a path or glob), open
:class:`~vartrace.storage.reader.Run` objects, :class:`~vartrace.tracer.ModelTracer`
objects or plain mappings of site name -> :class:`~vartrace.trace.Trace` — and
matches their records by site, iteration, rank and occurrence (the n-th
record of that site in that iteration on that rank).  For every matched
pair it reports whether the shapes match, whether the values are close
(``|a - b| <= atol + rtol * |b|`` elementwise, NaN equal to NaN at the same
place), the largest absolute and relative difference, the cosine
similarity, and the mean/std/var of each side with their differences.

Numeric work is vectorised and streams once over the data: records stored
uncompressed are viewed in place through a memory map of the file (others
are read in large blocks into reused buffers); every site is indexed
first (record matching, HDF5 metadata), then a small thread pool reads and
reduces blocks of records with numpy (which releases the GIL).  Statistics
are accumulated in float64 from exact products of the inputs.  Identical
records take a shorter path.

Example::

    import vartrace

    report = vartrace.compare("reference.h5", "candidate.h5", atol=1e-6, rtol=1e-4)
    print(report)                       # per-site table + first divergence
    if not report.ok:
        site, iteration, rank = report.first_divergence
    report.to_csv("diff.csv")
"""

from __future__ import annotations

import concurrent.futures
import csv
import fnmatch
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vartrace.sources import (
    BufferPool,
    SiteView,
    Unreadable,
    open_source,
    value_as_array,
    value_dtype_name,
)

__all__ = ["Comparison", "Divergence", "SiteSummary", "compare"]

#: Elements reduced per group of rows: enough rows to amortise the per-call
#: cost of numpy on small records, few enough to keep the temporaries cached.
_STEP_ELEMENTS = 1 << 18
#: Largest block (bytes per side, counted as float64) read from a file in one go.
_READ_BYTES = 32 << 20

#: Record status values, in the order the report ranks them.
STATUS_OK = "ok"
STATUS_DIFFERS = "differs"
STATUS_SHAPE = "shape mismatch"
STATUS_ONLY_A = "only in a"
STATUS_ONLY_B = "only in b"
STATUS_SKIPPED = "not compared"

COLUMNS: tuple[str, ...] = (
    "site",
    "iteration",
    "rank",
    "occurrence",
    "order_a",
    "order_b",
    "status",
    "shape_a",
    "shape_b",
    "dtype_a",
    "dtype_b",
    "shape_match",
    "allclose",
    "max_abs_diff",
    "max_rel_diff",
    "cosine",
    "mean_a",
    "mean_b",
    "mean_diff",
    "std_a",
    "std_b",
    "std_diff",
    "var_a",
    "var_b",
    "var_diff",
)
_FLOAT_COLUMNS = (
    "max_abs_diff",
    "max_rel_diff",
    "cosine",
    "mean_a",
    "mean_b",
    "std_a",
    "std_b",
    "var_a",
    "var_b",
)


class Divergence(NamedTuple):
    """Where two runs first differ: ``(site, iteration, rank)``."""

    site: str
    iteration: int
    rank: int


@dataclass(frozen=True)
class SiteSummary:
    """One line of the report: how a site compared over all its records.

    Attributes:
        site: the site name.
        records: record pairs compared (matched in both runs).
        differing: records beyond tolerance, with a shape mismatch, or present
            in one run only.
        max_abs_diff: the largest absolute difference over the site's numeric
            records (NaN when none was compared).
        max_rel_diff: the largest relative difference ``|a - b| / |b|``.
        min_cosine: the smallest cosine similarity over the site's records.
        status: ``"ok"`` or the worst record status.
    """

    site: str
    records: int
    differing: int
    max_abs_diff: float
    max_rel_diff: float
    min_cosine: float
    status: str


# --------------------------------------------------------------------------- matching


def _occurrence(iterations: np.ndarray, ranks: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Index of each record among the records of its (iteration, rank), by capture order."""
    count = len(iterations)
    occ = np.zeros(count, dtype=np.int64)
    if count == 0:
        return occ
    idx = np.lexsort((order, ranks, iterations))
    it, rk = iterations[idx], ranks[idx]
    start = np.ones(count, dtype=bool)
    start[1:] = (it[1:] != it[:-1]) | (rk[1:] != rk[:-1])
    positions = np.arange(count)
    group_start = np.maximum.accumulate(np.where(start, positions, 0))
    occ[idx] = positions - group_start
    return occ


def _match(a: SiteView, b: SiteView) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pair records by (iteration, rank, occurrence): (ia, ib, only_a, only_b) row indices."""
    occ_a = _occurrence(a.iterations, a.ranks, a.order)
    occ_b = _occurrence(b.iterations, b.ranks, b.order)
    keys_a = np.stack([a.iterations, a.ranks, occ_a], axis=1)
    keys_b = np.stack([b.iterations, b.ranks, occ_b], axis=1)
    if np.array_equal(keys_a, keys_b):  # the usual case: both runs recorded the same steps
        rows = np.lexsort((occ_a, a.ranks, a.iterations)).astype(np.int64)
        empty = np.empty(0, dtype=np.int64)
        return rows, rows, empty, empty
    both = np.concatenate([keys_a, keys_b])
    if len(both) == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty, empty
    _, inverse = np.unique(both, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    ka, kb = inverse[: len(keys_a)], inverse[len(keys_a) :]
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    only_a = np.setdiff1d(np.arange(len(ka)), ia)
    only_b = np.setdiff1d(np.arange(len(kb)), ib)
    return ia.astype(np.int64), ib.astype(np.int64), only_a, only_b


# --------------------------------------------------------------------------- numerics


def _work_dtype(a: np.dtype, b: np.dtype) -> np.dtype:
    kinds = {a.kind, b.kind}
    if "c" in kinds:
        return np.dtype(np.complex128)
    if a == b and a in (np.float32, np.float64):
        return a
    if kinds <= {"f"} and max(a.itemsize, b.itemsize) <= 4:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


#: Dot products are taken in pieces of at most this many elements: OpenBLAS runs
#: shorter dots on the calling thread, and a dot spread over threads stalls badly
#: when the cores are busy (an assumption about BLAS, so only a speed matter).
_DOT_PIECE = 8192
#: Records longer than this many elements are reduced in column slices, so the
#: scratch memory stays bounded whatever the record size.
_COLUMNS = 1 << 20


class _Scratch:
    """Buffers reused across the row groups of one block (no allocation per record).

    ``wide`` holds the float64 copies of ``a`` and ``b`` padded with zeros to
    a whole number of dot pieces.
    """

    def __init__(self, rows: int, m: int, dtype: np.dtype) -> None:
        self.rows = rows
        self.piece = min(m, _DOT_PIECE)
        padded = -(-m // self.piece) * self.piece
        self.wide = np.zeros((2, rows, padded))
        self.ones = np.ones(self.piece)
        self.diff = np.empty((rows, m), dtype)
        self.other = np.empty((rows, m), dtype)
        self.rel = np.empty((rows, m), dtype)


_THREAD_SCRATCH = threading.local()


def _scratch(rows: int, m: int, dtype: np.dtype) -> _Scratch:
    """This thread's scratch buffers for ``rows`` rows of (m, dtype), kept from its last block."""
    cached = getattr(_THREAD_SCRATCH, "value", None)
    if cached is None or cached[0] != (m, dtype) or cached[1].rows < rows:
        cached = ((m, dtype), _Scratch(rows, m, dtype))
        _THREAD_SCRATCH.value = cached
    return cached[1]


def _piecewise_dot(x: np.ndarray, y: np.ndarray, piece: int) -> np.ndarray:
    """Row-wise dot products of (k, padded) float64 arrays, summed over pieces."""
    k = x.shape[0]
    xs = x.reshape(k, -1, 1, piece)
    ys = y.reshape(k, -1, piece, 1)
    return np.matmul(xs, ys).reshape(k, -1).sum(axis=1)


def _power_sums(
    a: np.ndarray, b: np.ndarray, scratch: _Scratch, same: bool = False
) -> tuple[np.ndarray, ...]:
    """Per row, in float64 (exact products of the inputs): sums of a, b, a*a, b*b, a*b.

    ``same`` says every row of ``a`` equals that of ``b``: b's sums are then a's.
    """
    rows, m = a.shape
    if m < 512:
        a64 = a.astype(np.float64, copy=False)
        sa, saa = a64.sum(axis=1), np.einsum("ij,ij->i", a64, a64)
        if same:
            return sa, sa, saa, saa, saa
        b64 = b.astype(np.float64, copy=False)
        sb, sbb = b64.sum(axis=1), np.einsum("ij,ij->i", b64, b64)
        return sa, sb, saa, sbb, np.einsum("ij,ij->i", a64, b64)
    sides = 1 if same else 2
    wide = scratch.wide[:sides, :rows]
    wide[0, :, :m] = a
    if not same:
        wide[1, :, :m] = b
    if m < wide.shape[2]:  # a last, narrower column slice: clear what an earlier one left
        wide[:, :, m:] = 0.0
    piece = scratch.piece
    sums = np.matmul(wide.reshape(sides, rows, -1, piece), scratch.ones)
    sums = sums.reshape(sides, rows, -1).sum(axis=2)
    x = wide[0]
    saa = _piecewise_dot(x, x, piece)
    if same:
        return sums[0], sums[0], saa, saa, saa
    y = wide[1]
    return sums[0], sums[1], saa, _piecewise_dot(y, y, piece), _piecewise_dot(x, y, piece)


class _Partial(NamedTuple):
    """What a slice of columns contributes to each row's statistics."""

    sums: tuple[np.ndarray, ...]  # sum a, sum b, sum a*a, sum b*b, sum a*b (float64)
    max_abs: np.ndarray
    max_rel: np.ndarray
    close: np.ndarray


def _combine(left: _Partial, right: _Partial) -> _Partial:
    """The contribution of two column slices of the same rows."""
    return _Partial(
        tuple(x + y for x, y in zip(left.sums, right.sums, strict=True)),
        np.maximum(left.max_abs, right.max_abs),  # a NaN (a NaN met a number) stays
        np.maximum(left.max_rel, right.max_rel),
        left.close & right.close,
    )


def _numeric_stats(
    block_a: np.ndarray, block_b: np.ndarray, atol: float, rtol: float
) -> dict[str, np.ndarray]:
    """Per-record statistics of two equally shaped stacks of records."""
    m = int(np.prod(block_a.shape[1:], dtype=np.int64))
    return _finish(m, _block_partial(block_a, block_b, atol, rtol))


def _block_partial(block_a: np.ndarray, block_b: np.ndarray, atol: float, rtol: float) -> _Partial:
    """Row sums, largest differences and closeness of two equally shaped stacks of records."""
    k = block_a.shape[0]
    m = int(np.prod(block_a.shape[1:], dtype=np.int64))
    work = _work_dtype(block_a.dtype, block_b.dtype)
    a2 = block_a.reshape(k, m).astype(work, copy=False)
    b2 = block_b.reshape(k, m).astype(work, copy=False)
    if m == 0:
        zeros = np.zeros(k)
        return _Partial((zeros,) * 5, zeros, zeros, np.ones(k, dtype=bool))
    width = min(m, _COLUMNS)
    step = max(1, _STEP_ELEMENTS // width)
    scratch = _scratch(min(step, k), width, work)
    partial_of = _complex_partial if work.kind == "c" else _real_partial
    groups = []
    with np.errstate(all="ignore"):
        for start in range(0, k, step):
            rows = slice(start, min(k, start + step))
            partial = partial_of(a2[rows, :width], b2[rows, :width], atol, rtol, scratch)
            for first in range(width, m, width):
                columns = slice(first, min(m, first + width))
                more = partial_of(a2[rows, columns], b2[rows, columns], atol, rtol, scratch)
                partial = _combine(partial, more)
            groups.append(partial)
    partial = groups[0] if len(groups) == 1 else _concatenate(groups)
    if block_a.dtype.kind in "iu" and block_b.dtype.kind in "iu":
        # float64 cannot tell integers above 2**53 apart: check equality exactly.
        same = np.all(block_a.reshape(k, m) == block_b.reshape(k, m), axis=1)
        partial.close[(partial.max_abs == 0) & ~same] = False
    return partial


def _concatenate(parts: list[_Partial]) -> _Partial:
    """The partials of consecutive row groups as one."""
    return _Partial(
        tuple(np.concatenate(column) for column in zip(*(p.sums for p in parts), strict=True)),
        np.concatenate([p.max_abs for p in parts]),
        np.concatenate([p.max_rel for p in parts]),
        np.concatenate([p.close for p in parts]),
    )


def _finish(m: int, partial: _Partial) -> dict[str, np.ndarray]:
    """Turn the row sums of ``partial`` (records of ``m`` elements) into the report's columns."""
    sa, sb, saa, sbb, sab = partial.sums
    out: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for side, s, ss in (("a", sa, saa), ("b", sb, sbb)):
            mean = s / m
            var = np.maximum(ss / m - mean * mean, 0.0)
            out[f"mean_{side}"] = mean
            out[f"var_{side}"] = var
            out[f"std_{side}"] = np.sqrt(var)
        norm = np.sqrt(saa * sbb)
        norm = np.where(np.isfinite(norm), norm, np.sqrt(saa) * np.sqrt(sbb))
        cos = np.clip(sab / np.where(norm > 0, norm, 1.0), -1.0, 1.0)
    zero_a, zero_b = saa == 0, sbb == 0
    cos = np.where(zero_a & zero_b, 1.0, cos)
    cos = np.where(zero_a ^ zero_b, 0.0, cos)
    out["cosine"] = np.where(partial.max_abs == 0, 1.0, cos)
    out["max_abs_diff"] = np.asarray(partial.max_abs, dtype=np.float64)
    out["max_rel_diff"] = np.asarray(partial.max_rel, dtype=np.float64)
    out["allclose"] = partial.close.astype(np.float64)
    return out


def _real_partial(
    a: np.ndarray, b: np.ndarray, atol: float, rtol: float, scratch: _Scratch
) -> _Partial:
    """Row contributions of real columns ``a``, ``b`` of shape (k, width), float32 or float64."""
    rows, m = a.shape
    diff = np.subtract(a, b, out=scratch.diff[:rows, :m])
    np.abs(diff, out=diff)
    max_abs = diff.max(axis=1)
    if not np.any(max_abs):  # identical rows (a NaN makes max_abs NaN, which is truthy)
        zeros = np.zeros(rows)
        return _Partial(_power_sums(a, b, scratch, same=True), zeros, zeros, np.ones(rows, bool))
    sums = _power_sums(a, b, scratch)
    absb = np.abs(b, out=scratch.other[:rows, :m])
    rel = np.divide(diff, absb, out=scratch.rel[:rows, :m])  # 0/0 -> NaN, which fmax skips
    max_rel = np.where(max_abs == 0, 0.0, np.fmax.reduce(rel, axis=1))
    close = (max_abs <= atol) | (max_rel <= rtol)
    for i in np.flatnonzero(~close & ~np.isnan(max_abs)):
        # |a - b| <= atol + rtol * |b| elementwise: max(|a - b| - rtol * |b|) <= atol
        excess = np.multiply(absb[i], -rtol, out=rel[i])
        excess += diff[i]
        close[i] = excess.max() <= atol
    for i in np.flatnonzero(np.isnan(max_abs)):
        row_a, row_b = a[i].astype(np.float64), b[i].astype(np.float64)
        max_abs[i], max_rel[i], close[i] = _nonfinite_row(row_a, row_b, atol, rtol)
    return _Partial(sums, max_abs, max_rel, close)


def _nonfinite_row(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[float, ...]:
    """Differences of one record holding NaN/inf: NaN == NaN and inf == inf count as equal."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    absb = np.abs(b)
    rel = np.where(same, 0.0, diff / absb)
    close = bool(np.all(same | (diff <= atol + rtol * absb)))
    return float(np.max(diff)), float(np.max(rel)), close


def _complex_partial(
    a: np.ndarray, b: np.ndarray, atol: float, rtol: float, scratch: _Scratch
) -> _Partial:
    """Complex columns: differences on the complex values, statistics of the magnitudes."""
    mag_a, mag_b = np.abs(a), np.abs(b)
    sums = _power_sums(mag_a, mag_b, scratch)
    sab = np.real(np.einsum("ij,ij->i", np.conj(a), b))
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    rel = np.where(same, 0.0, diff / mag_b)
    close = np.all(same | (diff <= atol + rtol * mag_b), axis=1)
    return _Partial((*sums[:4], sab), diff.max(axis=1), rel.max(axis=1), close)


def _objects_equal(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y)
    except Exception:  # an opaque object whose == is not a plain bool
        return False


# --------------------------------------------------------------------------- engine


@dataclass
class _Task:
    """One block of matched numeric records to read and reduce."""

    a: SiteView
    b: SiteView
    pairs: np.ndarray  # positions in the site's pair list
    rows_a: np.ndarray
    rows_b: np.ndarray
    shape: tuple[int, ...]


class _SiteResult:
    """Columns of one site's records while they are being filled."""

    def __init__(self, name: str, a: SiteView, b: SiteView, atol: float, rtol: float) -> None:
        self.name = name
        self.atol, self.rtol = atol, rtol
        ia, ib, only_a, only_b = _match(a, b)
        n_pairs = len(ia)
        self.n_pairs = n_pairs
        n = n_pairs + len(only_a) + len(only_b)
        nan = np.full(n, math.nan)
        self.iteration = np.concatenate(
            [a.iterations[ia], a.iterations[only_a], b.iterations[only_b]]
        )
        self.rank = np.concatenate([a.ranks[ia], a.ranks[only_a], b.ranks[only_b]])
        occ_a = _occurrence(a.iterations, a.ranks, a.order)
        occ_b = _occurrence(b.iterations, b.ranks, b.order)
        self.occurrence = np.concatenate([occ_a[ia], occ_a[only_a], occ_b[only_b]])
        missing = np.full(len(only_b), -1, dtype=np.int64)
        self.order_a = np.concatenate([a.order[ia], a.order[only_a], missing])
        missing_a = np.full(len(only_a), -1, dtype=np.int64)
        self.order_b = np.concatenate([b.order[ib], missing_a, b.order[only_b]])
        rows_a = np.concatenate([ia, only_a, np.full(len(only_b), -1, dtype=np.int64)])
        rows_b = np.concatenate([ib, np.full(len(only_a), -1, dtype=np.int64), only_b])
        self.shape_a = [a.shapes[r] if r >= 0 else None for r in rows_a]
        self.shape_b = [b.shapes[r] if r >= 0 else None for r in rows_b]
        self.dtype_a = [a.dtypes[r] if r >= 0 else "" for r in rows_a]
        self.dtype_b = [b.dtypes[r] if r >= 0 else "" for r in rows_b]
        self.floats = {name: nan.copy() for name in _FLOAT_COLUMNS}
        self.allclose = np.zeros(n, dtype=bool)
        self.shape_match = np.zeros(n, dtype=bool)
        self.status = np.array(
            [STATUS_DIFFERS] * n_pairs
            + [STATUS_ONLY_A] * len(only_a)
            + [STATUS_ONLY_B] * len(only_b),
            dtype=object,
        )
        self.tasks: list[_Task] = []
        self._plan(a, b, ia, ib)

    def _plan(self, a: SiteView, b: SiteView, ia: np.ndarray, ib: np.ndarray) -> None:
        groups: dict[tuple[int, ...], list[int]] = {}
        object_pairs: list[int] = []
        for p in range(self.n_pairs):
            sa, sb = self.shape_a[p], self.shape_b[p]
            if sa is None or sb is None:
                object_pairs.append(p)
            elif sa != sb:
                self.status[p] = STATUS_SHAPE
            else:
                self.shape_match[p] = True
                groups.setdefault(sa, []).append(p)
        if object_pairs:
            pos = np.asarray(object_pairs)
            values_a = a.objects(ia[pos])
            values_b = b.objects(ib[pos])
            for p, x, y in zip(object_pairs, values_a, values_b, strict=True):
                self._compare_values(p, x, y)
        for shape, members in groups.items():
            pairs = np.asarray(members, dtype=np.int64)
            pairs = pairs[np.argsort(ia[pairs], kind="stable")]
            record_bytes = max(1, int(np.prod(shape, dtype=np.int64)) * 8)
            per_task = max(1, _READ_BYTES // record_bytes)
            for start in range(0, len(pairs), per_task):
                chunk = pairs[start : start + per_task]
                self.tasks.append(_Task(a, b, chunk, ia[chunk], ib[chunk], shape))

    def _compare_values(self, p: int, x: Any, y: Any) -> None:
        """Compare one pair of values read one by one (non-numeric, or outside a block)."""
        self.dtype_a[p], self.dtype_b[p] = value_dtype_name(x), value_dtype_name(y)
        if isinstance(x, Unreadable) or isinstance(y, Unreadable):
            self.status[p] = STATUS_SKIPPED
            return
        array_a, array_b = value_as_array(x), value_as_array(y)
        self.shape_a[p] = None if array_a is None else tuple(array_a.shape)
        self.shape_b[p] = None if array_b is None else tuple(array_b.shape)
        if array_a is None or array_b is None:
            self.shape_match[p] = array_a is None and array_b is None
            self.allclose[p] = _objects_equal(x, y)
        elif array_a.shape != array_b.shape:
            self.status[p] = STATUS_SHAPE
            return
        else:
            self.shape_match[p] = True
            stats = _numeric_stats(array_a[None], array_b[None], self.atol, self.rtol)
            for name in _FLOAT_COLUMNS:
                self.floats[name][p] = stats[name][0]
            self.allclose[p] = bool(stats["allclose"][0])
        self.status[p] = STATUS_OK if self.allclose[p] else STATUS_DIFFERS

    def fill(self, task: _Task, stats: dict[str, np.ndarray]) -> None:
        for name in _FLOAT_COLUMNS:
            self.floats[name][task.pairs] = stats[name]
        close = stats["allclose"].astype(bool)
        self.allclose[task.pairs] = close
        self.status[task.pairs] = np.where(close, STATUS_OK, STATUS_DIFFERS)

    def _failing(self) -> np.ndarray:
        return (self.status != STATUS_OK) & (self.status != STATUS_SKIPPED)

    def summary(self) -> SiteSummary:
        bad = self._failing()
        statuses = set(self.status.tolist())
        status = STATUS_OK
        for candidate in (
            STATUS_SKIPPED,
            STATUS_ONLY_B,
            STATUS_ONLY_A,
            STATUS_DIFFERS,
            STATUS_SHAPE,
        ):
            if candidate in statuses:
                status = candidate
        return SiteSummary(
            site=self.name,
            records=self.n_pairs,
            differing=int(bad.sum()),
            max_abs_diff=_worst(np.nanmax, self.floats["max_abs_diff"][: self.n_pairs]),
            max_rel_diff=_worst(np.nanmax, self.floats["max_rel_diff"][: self.n_pairs]),
            min_cosine=_worst(np.nanmin, self.floats["cosine"][: self.n_pairs]),
            status=status,
        )

    def first_key(self) -> tuple[int, int, int] | None:
        """(iteration, order, rank) of the earliest record that differs."""
        bad = np.flatnonzero(self._failing())
        if len(bad) == 0:
            return None
        order = np.where(self.order_a[bad] >= 0, self.order_a[bad], self.order_b[bad])
        best = np.lexsort((self.rank[bad], order, self.iteration[bad]))[0]
        return int(self.iteration[bad][best]), int(order[best]), int(self.rank[bad][best])

    def execution_key(self) -> tuple[int, int]:
        orders = np.where(self.order_a >= 0, self.order_a, self.order_b)
        if len(orders) == 0:
            return (sys.maxsize, sys.maxsize)
        i = np.lexsort((orders, self.iteration))[0]
        return int(self.iteration[i]), int(orders[i])


def _worst(reduce: Callable[[np.ndarray], Any], values: np.ndarray) -> float:
    """``reduce`` (nanmax / nanmin) over the numeric rows; NaN when there are none."""
    values = values[~np.isnan(values)]
    return float(reduce(values)) if len(values) else math.nan


def _load(task: _Task, pool: BufferPool) -> Any:
    """The task's records on both sides: aligned zero-copy views, or blocks read into ``pool``."""
    views_a = task.a.views(task.rows_a, task.shape)
    views_b = None if views_a is None else task.b.views(task.rows_b, task.shape)
    if views_a is not None and views_b is not None:
        return _align(views_a, views_b, len(task.rows_a))
    return task.a.read(task.rows_a, task.shape, pool), task.b.read(task.rows_b, task.shape, pool)


class _Aligned(NamedTuple):
    """Zero-copy views of a task's records on both sides, cut at the same positions."""

    count: int
    pieces: list[tuple[int, int, np.ndarray, np.ndarray]]


def _align(
    views_a: list[tuple[int, np.ndarray]], views_b: list[tuple[int, np.ndarray]], count: int
) -> _Aligned:
    """Cut both sides' runs of records at the union of their boundaries."""
    cuts = sorted({p for p, _ in views_a} | {p for p, _ in views_b} | {count})
    pieces = []
    ia = ib = 0
    for start, stop in itertools.pairwise(cuts):
        while views_a[ia][0] + len(views_a[ia][1]) <= start:
            ia += 1
        while views_b[ib][0] + len(views_b[ib][1]) <= start:
            ib += 1
        (pa, va), (pb, vb) = views_a[ia], views_b[ib]
        pieces.append((start, stop, va[start - pa : stop - pa], vb[start - pb : stop - pb]))
    return _Aligned(count, pieces)


def _reduce_task(task: _Task, atol: float, rtol: float, pool: BufferPool) -> dict[str, np.ndarray]:
    """Statistics of one task's records (read blocks are given back to ``pool``)."""
    blocks = _load(task, pool)
    if isinstance(blocks, _Aligned):
        parts = [_block_partial(va, vb, atol, rtol) for _, _, va, vb in blocks.pieces]
        m = int(np.prod(blocks.pieces[0][2].shape[1:], dtype=np.int64))
        return _finish(m, parts[0] if len(parts) == 1 else _concatenate(parts))
    try:
        return _numeric_stats(*blocks, atol, rtol)
    finally:
        for block in blocks:
            pool.give(block)


def _reduce_all(
    tasks: Sequence[_Task], atol: float, rtol: float
) -> Iterator[tuple[_Task, dict[str, np.ndarray]]]:
    """Each task with its statistics, as they complete, reduced on a few threads.

    A task reads its records when it runs (so memory holds a few blocks at a
    time) and its numpy work releases the GIL.  The sites were indexed before
    (:class:`_SiteResult`): that HDF5 work holds the GIL, and interleaving it
    with the reductions would stall them on every switch.
    """
    pool = BufferPool()
    workers = max(1, min(4, os.cpu_count() or 1))
    if workers == 1:
        for task in tasks:
            yield task, _reduce_task(task, atol, rtol, pool)
        return
    threads = concurrent.futures.ThreadPoolExecutor(workers, "vartrace-compare")
    try:
        futures = {threads.submit(_reduce_task, task, atol, rtol, pool): task for task in tasks}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    finally:
        threads.shutdown(cancel_futures=True)


def _select(names: Iterable[str], patterns: Sequence[str] | None) -> list[str]:
    if patterns is None:
        return list(names)
    return [n for n in names if any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns)]


def compare(
    a: Any,
    b: Any,
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    names: str | Iterable[str] | None = None,
    progress: bool = False,
    labels: tuple[str, str] | None = None,
) -> Comparison:
    """Compare two runs record by record.

    ``a`` and ``b`` are each a path or glob of an HDF5 run, an open run
    (:func:`vartrace.open`), a :class:`~vartrace.tracer.ModelTracer` (its
    ``results``) or a mapping of site name -> :class:`~vartrace.trace.Trace`.
    Records are matched by site, iteration, rank and occurrence within that
    iteration and rank; ``b`` is the reference of the relative tolerance,
    as in :func:`numpy.isclose`.  ``names`` restricts the comparison to
    these site names or glob patterns.  Sites present in one run only are
    listed in ``only_in_a`` / ``only_in_b`` and do not make the comparison
    fail; a record present on one side only does.  ``progress`` shows a tqdm
    bar on stderr for long comparisons; ``labels`` names the two runs in the
    report (default: their paths).

    Example::

        report = vartrace.compare("fp64.h5", tracer, atol=1e-5, rtol=1e-3)
        print(report)
        assert report.ok, report.first_divergence
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
    patterns = [names] if isinstance(names, str) else (None if names is None else list(names))
    with open_source(a) as source_a, open_source(b) as source_b:
        names_a = _select(source_a.names, patterns)
        names_b = _select(source_b.names, patterns)
        if patterns is not None and not names_a and not names_b:
            raise ValueError(f"no site matches {', '.join(map(repr, patterns))} in either run")
        in_a, in_b = set(names_a), set(names_b)
        only_a = [n for n in names_a if n not in in_b]
        only_b = [n for n in names_b if n not in in_a]
        common = [n for n in names_a if n in in_b]
        from tqdm.auto import tqdm

        with tqdm(
            total=len(common),
            unit="site",
            desc="compare: index",
            disable=not progress or not common,
            file=sys.stderr,
            leave=False,
            delay=1.0,
        ) as bar:
            results = []
            for name in common:
                results.append(
                    _SiteResult(name, source_a.site(name), source_b.site(name), atol, rtol)
                )
                bar.update(1)
            owner = {id(task): result for result in results for task in result.tasks}
            tasks = [task for result in results for task in result.tasks]
            bar.reset(total=len(tasks))
            bar.set_description("compare")
            bar.unit = "block"
            for task, stats in _reduce_all(tasks, atol, rtol):
                owner[id(task)].fill(task, stats)
                bar.update(1)
    results.sort(key=_SiteResult.execution_key)
    labels = labels or (source_a.label, source_b.label)
    return Comparison(results, only_a, only_b, atol, rtol, labels)


# --------------------------------------------------------------------------- report


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.3g}"


def _fmt_cosine(x: float) -> str:
    """Six decimals, so 0.9999995 does not read as a perfect 1."""
    if math.isnan(x):
        return "-"
    return f"{x:.6f}"


class Comparison:
    """The result of :func:`compare`.

    Example::

        report = vartrace.compare("a.h5", "b.h5")
        report.ok                  # True when every compared record is within tolerance
        report.first_divergence    # Divergence(site, iteration, rank) or None
        report.only_in_a, report.only_in_b
        df = report.to_frame()     # one row per record pair
        report.to_csv("diff.csv")

    Attributes:
        ok: every compared record has matching shapes, is within tolerance,
            and has a partner in the other run.
        first_divergence: the earliest differing record in execution order
            (iteration, then capture order), or ``None``.
        only_in_a / only_in_b: sites present in one run only.
        sites: a :class:`SiteSummary` per compared site, in execution order.
        atol / rtol: the tolerances used.
    """

    def __init__(
        self,
        results: list[_SiteResult],
        only_in_a: list[str],
        only_in_b: list[str],
        atol: float,
        rtol: float,
        labels: tuple[str, str] = ("a", "b"),
    ) -> None:
        self.atol = atol
        self.rtol = rtol
        self.labels = labels
        self.only_in_a = only_in_a
        self.only_in_b = only_in_b
        self.sites = [r.summary() for r in results]
        self._columns = self._gather_columns(results)
        firsts = [(key, r.name) for r in results if (key := r.first_key()) is not None]
        if firsts:
            (iteration, _, rank), site = min(firsts)
            self.first_divergence: Divergence | None = Divergence(site, iteration, rank)
        else:
            self.first_divergence = None
        self.ok = self.first_divergence is None

    @staticmethod
    def _gather_columns(results: list[_SiteResult]) -> dict[str, list[Any]]:
        columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
        for r in results:
            n = len(r.status)
            columns["site"].extend([r.name] * n)
            for name in ("iteration", "rank", "occurrence", "order_a", "order_b"):
                columns[name].extend(getattr(r, name).tolist())
            columns["status"].extend(r.status.tolist())
            columns["shape_a"].extend(r.shape_a)
            columns["shape_b"].extend(r.shape_b)
            columns["dtype_a"].extend(r.dtype_a)
            columns["dtype_b"].extend(r.dtype_b)
            columns["shape_match"].extend(r.shape_match.tolist())
            columns["allclose"].extend(r.allclose.tolist())
            for name in _FLOAT_COLUMNS:
                columns[name].extend(r.floats[name].tolist())
            for stat in ("mean", "std", "var"):
                diff = r.floats[f"{stat}_a"] - r.floats[f"{stat}_b"]
                columns[f"{stat}_diff"].extend(diff.tolist())
        return columns

    def __len__(self) -> int:
        """Number of rows: record pairs plus records present on one side only."""
        return len(self._columns["site"])

    def __repr__(self) -> str:
        return (
            f"<Comparison ok={self.ok} sites={len(self.sites)} rows={len(self)} "
            f"first_divergence={self.first_divergence}>"
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        """Yield one dict per row, keys as in :data:`COLUMNS`."""
        cols = [self._columns[name] for name in COLUMNS]
        for values in zip(*cols, strict=True):
            yield dict(zip(COLUMNS, values, strict=True))

    def to_frame(self) -> Any:
        """A pandas DataFrame with one row per record pair (columns :data:`COLUMNS`).

        ``*_diff`` columns are ``a - b``; a record present in one run only has
        ``status`` ``"only in a"``/``"only in b"`` and NaN statistics.
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                "Comparison.to_frame() needs pandas: pip install 'vartrace[pandas]'"
            ) from exc
        return pd.DataFrame(self._columns, columns=list(COLUMNS))

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write one row per record pair to ``path`` (works without pandas); return the path."""
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for row in self.rows():
                writer.writerow(_csv_value(row[name]) for name in COLUMNS)
        return path

    def __str__(self) -> str:
        header = (
            "site",
            "records",
            "differing",
            "max abs diff",
            "max rel diff",
            "min cosine",
            "status",
        )
        body = [
            (
                s.site,
                str(s.records),
                str(s.differing),
                _fmt(s.max_abs_diff),
                _fmt(s.max_rel_diff),
                _fmt_cosine(s.min_cosine),
                s.status if s.status == STATUS_OK else s.status.upper(),
            )
            for s in self.sites
        ]
        a, b = self.labels
        lines = [f"comparing {a} with {b} (atol={self.atol:g}, rtol={self.rtol:g})"]
        lines.extend(_table(header, body, right=(1, 2, 3, 4, 5)))
        differing = sum(1 for s in self.sites if s.status not in (STATUS_OK, STATUS_SKIPPED))
        lines.append("")
        lines.append(
            f"{_plural(len(self.sites), 'site')} compared, {differing} differ, "
            f"{_plural(sum(s.records for s in self.sites), 'record pair')}"
        )
        if self.first_divergence is None:
            lines.append("first divergence: none")
        else:
            d = self.first_divergence
            lines.append(f"first divergence: {d.site} at iteration {d.iteration}, rank {d.rank}")
        if self.only_in_a:
            lines.append(f"only in a ({len(self.only_in_a)}): " + ", ".join(self.only_in_a))
        if self.only_in_b:
            lines.append(f"only in b ({len(self.only_in_b)}): " + ", ".join(self.only_in_b))
        return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _csv_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return str(tuple(int(d) for d in value))
    if value is None:
        return ""
    return value


def _table(
    header: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Align columns: left-justified text, right-justified numbers (column indices ``right``)."""
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in body)]
