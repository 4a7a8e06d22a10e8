"""The rows of a comparison, site by site, and the report assembled from them.

`SiteRows` holds one site's report columns (a row per record pair, then its
records present in one run only) and what the report says of the site: its
summary, its first differing record, where it ran first.  `assemble` turns the
sites' rows into the [`Comparison`][vartrace.Comparison], whether they were filled in
this process or merged from the tasks of a Dask cluster.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vartrace.analysis.comparison.report import (
    COLUMNS,
    FLOAT_COLUMNS,
    STATUS_DIFFERS,
    STATUS_OK,
    STATUS_ONLY_A,
    STATUS_ONLY_B,
    STATUS_SHAPE,
    STATUS_SKIPPED,
    Comparison,
    Divergence,
    SiteSummary,
)

__all__ = ["SiteRows", "assemble"]


class SiteRows:
    """The report columns of one site: its `n_pairs` record pairs first, then its
    records present in one run only (`"only in a"`, then `"only in b"`)."""

    def __init__(
        self,
        name: str,
        n_pairs: int,
        tags: dict[str, np.ndarray],
        shapes: tuple[list[Any], list[Any]],
        dtypes: tuple[list[str], list[str]],
        status: np.ndarray,
    ) -> None:
        self.name = name
        self.n_pairs = n_pairs
        self.iteration = tags["iteration"]
        self.rank = tags["rank"]
        self.occurrence = tags["occurrence"]
        self.order_a = tags["order_a"]
        self.order_b = tags["order_b"]
        self.shape_a, self.shape_b = shapes
        self.dtype_a, self.dtype_b = dtypes
        self.status = status
        n = len(status)
        self.floats = {name: np.full(n, math.nan) for name in FLOAT_COLUMNS}
        self.allclose = np.zeros(n, dtype=bool)
        self.shape_match = np.zeros(n, dtype=bool)

    def taken(self, rows: np.ndarray, n_pairs: int) -> SiteRows:
        """These rows at positions `rows` (of which the first `n_pairs` are pairs)."""
        picked = rows.tolist()
        out = SiteRows(
            self.name,
            n_pairs,
            {name: getattr(self, name)[rows] for name in TAGS},
            ([self.shape_a[r] for r in picked], [self.shape_b[r] for r in picked]),
            ([self.dtype_a[r] for r in picked], [self.dtype_b[r] for r in picked]),
            self.status[rows],
        )
        out.floats = {name: values[rows] for name, values in self.floats.items()}
        out.allclose, out.shape_match = self.allclose[rows], self.shape_match[rows]
        return out

    @classmethod
    def joined(cls, name: str, parts: Sequence[SiteRows]) -> SiteRows:
        """The rows of `parts` one after the other (pairs and unpaired rows as they come:
        reorder them with `taken`)."""
        out = cls(
            name,
            sum(part.n_pairs for part in parts),
            {tag: np.concatenate([getattr(part, tag) for part in parts]) for tag in TAGS},
            ([s for p in parts for s in p.shape_a], [s for p in parts for s in p.shape_b]),
            ([d for p in parts for d in p.dtype_a], [d for p in parts for d in p.dtype_b]),
            np.concatenate([part.status for part in parts]),
        )
        out.floats = {n: np.concatenate([p.floats[n] for p in parts]) for n in FLOAT_COLUMNS}
        out.allclose = np.concatenate([part.allclose for part in parts])
        out.shape_match = np.concatenate([part.shape_match for part in parts])
        return out

    def _failing(self) -> np.ndarray:
        return (self.status != STATUS_OK) & (self.status != STATUS_SKIPPED)

    def summary(self) -> SiteSummary:
        bad = self._failing()
        first = self.first_key()
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
            differing=int(bad[: self.n_pairs].sum()),
            unpaired=len(bad) - self.n_pairs,
            max_abs_diff=_worst(np.nanmax, self.floats["max_abs_diff"][: self.n_pairs]),
            max_rel_diff=_worst(np.nanmax, self.floats["max_rel_diff"][: self.n_pairs]),
            min_cosine=_worst(np.nanmin, self.floats["cosine"][: self.n_pairs]),
            status=status,
            dtypes=self.dtype_names(),
            dtype_match=bool(self.dtype_match()[: self.n_pairs].all()),
            first_differing_iteration=None if first is None else first[0],
        )

    def dtype_match(self) -> np.ndarray:
        """Per row: both records are there and have the same dtype."""
        return np.array(
            [a == b and a != "" for a, b in zip(self.dtype_a, self.dtype_b, strict=True)],
            dtype=bool,
        )

    def dtype_names(self) -> str:
        """The record pairs' dtypes: `"float32"`, or `"float32 vs bfloat16"` where they
        differ (several kinds joined by `", "`, in order of first appearance)."""
        kinds = dict.fromkeys(
            a if a == b else f"{a} vs {b}"
            for a, b in zip(self.dtype_a[: self.n_pairs], self.dtype_b[: self.n_pairs], strict=True)
        )
        return ", ".join(kinds)

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


#: The integer tag columns of `SiteRows`.
TAGS = ("iteration", "rank", "occurrence", "order_a", "order_b")


def _worst(reduce: Callable[[np.ndarray], Any], values: np.ndarray) -> float:
    """`reduce` (nanmax / nanmin) over the numeric rows; NaN when there are none."""
    values = values[~np.isnan(values)]
    return float(reduce(values)) if len(values) else math.nan


def assemble(
    results: list[SiteRows],
    only_a: list[str],
    only_b: list[str],
    atol: float,
    rtol: float,
    labels: tuple[str, str],
) -> Comparison:
    """The report of the compared sites' rows (given in the order of the runs' names):
    sites in execution order, the first divergence, one row per record."""
    results = sorted(results, key=SiteRows.execution_key)
    firsts = [(key, r.name) for r in results if (key := r.first_key()) is not None]
    first = None
    if firsts:
        (iteration, _, rank), site = min(firsts)
        first = Divergence(site, iteration, rank)
    summaries = [r.summary() for r in results]
    return Comparison(summaries, _columns(results), first, only_a, only_b, atol, rtol, labels)


def _columns(results: list[SiteRows]) -> dict[str, list[Any]]:
    """The report's columns (`COLUMNS`): one entry per record pair or unpaired record."""
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for r in results:
        n = len(r.status)
        columns["site"].extend([r.name] * n)
        for name in TAGS:
            columns[name].extend(getattr(r, name).tolist())
        columns["status"].extend(r.status.tolist())
        columns["shape_a"].extend(r.shape_a)
        columns["shape_b"].extend(r.shape_b)
        columns["dtype_a"].extend(r.dtype_a)
        columns["dtype_b"].extend(r.dtype_b)
        columns["shape_match"].extend(r.shape_match.tolist())
        columns["dtype_match"].extend(r.dtype_match().tolist())
        columns["allclose"].extend(r.allclose.tolist())
        first = r.first_key()  # the site's, on each of its rows
        columns["first_differing_iteration"].extend([-1 if first is None else first[0]] * n)
        for name in FLOAT_COLUMNS:
            columns[name].extend(r.floats[name].tolist())
        for stat in ("mean", "std", "var"):
            with np.errstate(invalid="ignore"):  # inf - inf: a sum beyond float64 on both sides
                diff = r.floats[f"{stat}_a"] - r.floats[f"{stat}_b"]
            columns[f"{stat}_diff"].extend(diff.tolist())
    return columns
