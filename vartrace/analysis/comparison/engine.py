"""The comparison engine: match records, plan blocks, read and reduce them.

Every site of both runs is indexed first (records matched by iteration, rank
and occurrence; shapes and dtypes read), its numeric pairs grouped into
blocks of equally shaped records (`_Task`); then a few threads read
and reduce the blocks (`vartrace.analysis.comparison.kernels`) and each block's
statistics fill its site's rows (`_SiteResult`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from vartrace.analysis.comparison.kernels import block_partial, concatenate, finish, numeric_stats
from vartrace.analysis.comparison.report import (
    FLOAT_COLUMNS,
    STATUS_DIFFERS,
    STATUS_OK,
    STATUS_ONLY_A,
    STATUS_ONLY_B,
    STATUS_SHAPE,
    STATUS_SKIPPED,
)
from vartrace.analysis.comparison.rows import SiteRows
from vartrace.analysis.sources import (
    BufferPool,
    SiteView,
    Unreadable,
    value_as_array,
    value_dtype_name,
)
from vartrace.analysis.sources.views import STATISTICS
from vartrace.statistics.named import STATS, statistic_of
from vartrace.statistics.records import as_statistics

#: Largest block (bytes per side, counted as float64) read from a file in one go.
_READ_BYTES = 32 << 20


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


def _match(
    a: SiteView, b: SiteView, occ_a: np.ndarray, occ_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pair records by (iteration, rank, occurrence `occ_a` / `occ_b`): (ia, ib, only_a,
    only_b) row indices."""
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


def _objects_equal(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y)
    except Exception:  # an opaque object whose == is not a plain bool
        return False


@dataclass
class _Task:
    """One block of matched numeric records to read and reduce."""

    a: SiteView
    b: SiteView
    pairs: np.ndarray  # positions in the site's pair list
    rows_a: np.ndarray
    rows_b: np.ndarray
    shape: tuple[int, ...]


class _SiteResult(SiteRows):
    """The rows of one site, matched here and filled as its blocks are reduced."""

    def __init__(self, name: str, a: SiteView, b: SiteView, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol
        occ_a = _occurrence(a.iterations, a.ranks, a.order)
        occ_b = _occurrence(b.iterations, b.ranks, b.order)
        ia, ib, only_a, only_b = _match(a, b, occ_a, occ_b)
        n_pairs = len(ia)
        missing_b = np.full(len(only_b), -1, dtype=np.int64)
        missing_a = np.full(len(only_a), -1, dtype=np.int64)
        tags = {
            "iteration": np.concatenate(
                [a.iterations[ia], a.iterations[only_a], b.iterations[only_b]]
            ),
            "rank": np.concatenate([a.ranks[ia], a.ranks[only_a], b.ranks[only_b]]),
            "occurrence": np.concatenate([occ_a[ia], occ_a[only_a], occ_b[only_b]]),
            "order_a": np.concatenate([a.order[ia], a.order[only_a], missing_b]),
            "order_b": np.concatenate([b.order[ib], missing_a, b.order[only_b]]),
        }
        rows_a = np.concatenate([ia, only_a, missing_b])
        rows_b = np.concatenate([ib, missing_a, only_b])
        status = np.array(
            [STATUS_DIFFERS] * n_pairs
            + [STATUS_ONLY_A] * len(only_a)
            + [STATUS_ONLY_B] * len(only_b),
            dtype=object,
        )
        super().__init__(
            name,
            n_pairs,
            tags,
            (
                [a.shapes[r] if r >= 0 else None for r in rows_a],
                [b.shapes[r] if r >= 0 else None for r in rows_b],
            ),
            (
                [a.dtype_label(a.dtypes[r]) if r >= 0 else "" for r in rows_a],
                [b.dtype_label(b.dtypes[r]) if r >= 0 else "" for r in rows_b],
            ),
            status,
        )
        self._labels = (a.dtype_label, b.dtype_label)
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
        dtype_a, dtype_b = value_dtype_name(x), value_dtype_name(y)
        label_a, label_b = self._labels
        self.dtype_a[p], self.dtype_b[p] = label_a(dtype_a), label_b(dtype_b)
        if isinstance(x, Unreadable) or isinstance(y, Unreadable):
            self.status[p] = STATUS_SKIPPED
            return
        if STATISTICS in (dtype_a, dtype_b):
            self._compare_statistics(p, x, y)
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
            stats = numeric_stats(array_a[None], array_b[None], self.atol, self.rtol)
            for name in FLOAT_COLUMNS:
                self.floats[name][p] = stats[name][0]
            self.allclose[p] = bool(stats["allclose"][0])
        self.status[p] = STATUS_OK if self.allclose[p] else STATUS_DIFFERS

    def _compare_statistics(self, p: int, x: Any, y: Any) -> None:
        """Compare statistics records as statistics (a whole record is first reduced to them).

        Each field both sides have is a number compared with the tolerances:
        `|a - b| <= atol + rtol * |b|`, NaN equal to NaN and equal infinities
        equal; the report's mean/std/var columns are the records' own, and the
        cosine similarity is not defined (NaN).
        """
        fields_a, fields_b = _statistics_fields(x), _statistics_fields(y)
        if fields_a is None or fields_b is None:  # statistics against a str, None...
            self.status[p] = STATUS_SHAPE
            return
        # a whole record (no fields of its own) is reduced to the other side's statistics
        whole = not fields_a or not fields_b
        common = [f for f in fields_a or fields_b if f in fields_b or not fields_b]
        common = [f for f in common if f in STATS] if whole else common
        fields_a = fields_a or {f: statistic_of(x, f) for f in common}
        fields_b = fields_b or {f: statistic_of(y, f) for f in common}
        self.shape_match[p] = True
        a = np.array([fields_a[f] for f in common], dtype=np.float64)
        b = np.array([fields_b[f] for f in common], dtype=np.float64)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        with np.errstate(all="ignore"):
            diff = np.where(same, 0.0, np.abs(a - b))
            rel = np.where(same, 0.0, diff / np.abs(b))
        close = bool(np.all(same | (diff <= self.atol + self.rtol * np.abs(b))))
        for side, values in (("a", fields_a), ("b", fields_b)):
            self.floats[f"mean_{side}"][p] = values.get("mean", math.nan)
            self.floats[f"std_{side}"][p] = values.get("std", math.nan)
            self.floats[f"var_{side}"][p] = values.get("std", math.nan) ** 2
        self.floats["max_abs_diff"][p] = float(np.nanmax(diff, initial=0.0))
        self.floats["max_rel_diff"][p] = float(np.nanmax(rel, initial=0.0))
        self.allclose[p] = close
        self.status[p] = STATUS_OK if close else STATUS_DIFFERS

    def fill(self, task: _Task, stats: dict[str, np.ndarray]) -> None:
        for name in FLOAT_COLUMNS:
            self.floats[name][task.pairs] = stats[name]
        close = stats["allclose"].astype(bool)
        self.allclose[task.pairs] = close
        self.status[task.pairs] = np.where(close, STATUS_OK, STATUS_DIFFERS)


def _statistics_fields(value: Any) -> dict[str, float] | None:
    """The fields of a statistics record as floats; `{}` for a numeric record; else `None`.

    A numeric record has every statistic (it is reduced on demand), so its
    dict is empty and the other side's fields are taken.
    """
    statistics = as_statistics(value)
    if statistics is not None:
        return {name: statistics.statistic(name) for name in statistics}
    return None if value_as_array(value) is None else {}


def _load(task: _Task, pool: BufferPool) -> Any:
    """The task's records on both sides: aligned zero-copy views, or blocks read into `pool`."""
    views_a = task.a.views(task.rows_a, task.shape)
    views_b = None if views_a is None else task.b.views(task.rows_b, task.shape)
    if views_a is not None and views_b is not None:
        return _align(views_a, views_b, len(task.rows_a))
    return task.a.read(task.rows_a, task.shape, pool), task.b.read(task.rows_b, task.shape, pool)


class _Aligned(NamedTuple):
    """Zero-copy views of a task's records on both sides, cut at the same positions."""

    count: int  # type: ignore[assignment]  # a field named like tuple.count
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
    """Statistics of one task's records (read blocks are given back to `pool`)."""
    blocks = _load(task, pool)
    if isinstance(blocks, _Aligned):
        parts = [block_partial(va, vb, atol, rtol) for _, _, va, vb in blocks.pieces]
        m = int(np.prod(blocks.pieces[0][2].shape[1:], dtype=np.int64))
        return finish(m, parts[0] if len(parts) == 1 else concatenate(parts))
    try:
        block_a, block_b = blocks
        return numeric_stats(block_a, block_b, atol, rtol)
    finally:
        for block in blocks:
            pool.give(block)


def _reduce_all(
    tasks: Sequence[_Task], atol: float, rtol: float, threads: int
) -> Iterator[tuple[_Task, dict[str, np.ndarray]]]:
    """Each task with its statistics, as they complete, reduced on up to `threads` threads.

    A task reads its records when it runs (so memory holds a few blocks at a
    time) and its numpy work releases the GIL.  The sites were indexed before
    (`_SiteResult`): that HDF5 work holds the GIL, and interleaving it
    with the reductions would stall them on every switch.
    """
    pool = BufferPool()
    workers = max(1, min(threads, os.cpu_count() or 1))
    if workers == 1:
        for task in tasks:
            yield task, _reduce_task(task, atol, rtol, pool)
        return
    executor = concurrent.futures.ThreadPoolExecutor(workers, "vartrace-compare")
    try:
        futures = {executor.submit(_reduce_task, task, atol, rtol, pool): task for task in tasks}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    finally:
        executor.shutdown(cancel_futures=True)


def _progress(show: bool, total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, shown only when `show` and the work lasts over a second."""
    from vartrace._support.progress import progress_bar

    return progress_bar(show=show and total > 0, total=total, desc=desc, unit=unit)


def compare_views(
    views: Iterable[tuple[str, SiteView, SiteView]],
    atol: float,
    rtol: float,
    *,
    count: int = 0,
    progress: bool = False,
    threads: int = 4,
) -> list[_SiteResult]:
    """The rows of each (name, view of a, view of b) (`count` of them, for the bar):
    every site indexed first, then their blocks reduced on up to `threads` threads."""
    results = []
    with _progress(progress, count, "compare: index", "site") as bar:
        for name, a, b in views:
            results.append(_SiteResult(name, a, b, atol, rtol))
            bar.update(1)
    owner = {id(task): result for result in results for task in result.tasks}
    tasks = [task for result in results for task in result.tasks]
    with _progress(progress, len(tasks), "compare", "block") as bar:
        for task, stats in _reduce_all(tasks, atol, rtol, threads):
            owner[id(task)].fill(task, stats)
            bar.update(1)
    return results
