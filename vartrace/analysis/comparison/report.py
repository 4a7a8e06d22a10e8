"""What [`vartrace.compare`][vartrace.compare] returns, and how it prints.

[`Comparison`][vartrace.Comparison] holds one row per record pair (columns `COLUMNS`)
and a `SiteSummary` per site; `table` aligns the columns of the
printed report (and of the command line's tables).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from vartrace._support.html import block

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
    "dtype_match",
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
    "first_differing_iteration",
)
FLOAT_COLUMNS = (
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
    """Where two runs first differ: `(site, iteration, rank)`."""

    site: str
    iteration: int
    rank: int


@dataclass(frozen=True)
class SiteSummary:
    """One line of the report: how a site compared over all its records.

    Attributes:
        site: the site name.
        records: record pairs compared (matched in both runs).
        differing: record pairs beyond tolerance or with a shape mismatch
            (at most `records`).
        unpaired: records present in one run only (a missing partner fails the
            comparison too).
        max_abs_diff: the largest absolute difference over the site's numeric
            records (NaN when none was compared).
        max_rel_diff: the largest relative difference `|a - b| / |b|`.
        min_cosine: the smallest cosine similarity over the site's records.
        status: `"ok"` or the worst record status.
        dtypes: the dtype of the site's record pairs, `"float32"`; where the runs
            differ (an fp32 run against a bf16 one), both, `"float32 vs bfloat16"`
            (several such pairs are joined by `", "`); `""` with no pair.
        dtype_match: every record pair has the same dtype on both sides.
        first_differing_iteration: the iteration of the site's first record pair beyond
            tolerance (or shape mismatch, or record without a partner), `None` when none:
            read down the sites, it says in which order a difference propagated.
    """

    site: str
    records: int
    differing: int
    unpaired: int
    max_abs_diff: float
    max_rel_diff: float
    min_cosine: float
    status: str
    dtypes: str
    dtype_match: bool
    first_differing_iteration: int | None = None


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.3g}"


def _fmt_cosine(x: float, differs: bool) -> str:
    """Six decimals; of a differing site, a cosine six decimals would round to 1 as its
    distance from 1 (`1-3.2e-09`, or `1` when exactly 1: b a multiple of a), so a site
    marked DIFFERS never reads as a perfect 1.000000."""
    if math.isnan(x):
        return "-"
    if differs and f"{x:.6f}" == "1.000000":
        return "1" if x == 1.0 else f"1-{1.0 - x:.2g}"
    return f"{x:.6f}"


class Comparison:
    """The result of [`compare`][vartrace.compare].

    Example:
        ```python
        report = vartrace.compare("a.h5", "b.h5")
        report.ok                  # True when every compared record is within tolerance
        report.first_divergence    # Divergence(site, iteration, rank) or None
        report.only_in_a, report.only_in_b
        df = report.to_frame()     # one row per record pair
        report.to_csv("diff.csv")
        ```

    Attributes:
        ok: every compared record has matching shapes, is within tolerance,
            and has a partner in the other run.
        first_divergence: the earliest differing record in execution order
            (iteration, then capture order), or `None`.
        only_in_a / only_in_b: sites present in one run only.
        moved_lines: a's `@every` line site -> b's, for the bindings whose line moved
            between the runs (compared under a's name).
        notes: what the report says about pairing the sites (lines moved, bindings not
            paired); printed, and in `to_frame().attrs["notes"]`.
        sites: a `SiteSummary` per compared site, in execution order.
        atol / rtol: the tolerances used.
    """

    def __init__(
        self,
        sites: list[SiteSummary],
        columns: dict[str, list[Any]],
        first_divergence: Divergence | None,
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
        self.sites = sites
        self._columns = columns
        self.first_divergence = first_divergence
        self.ok = first_divergence is None
        self.moved_lines: dict[str, str] = {}
        self.notes: list[str] = []

    def __len__(self) -> int:
        """Number of rows: record pairs plus records present on one side only."""
        return len(self._columns["site"])

    def __repr__(self) -> str:
        return (
            f"<Comparison ok={self.ok} sites={len(self.sites)} rows={len(self)} "
            f"first_divergence={self.first_divergence}>"
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        """Yield one dict per row, keys as in `COLUMNS`."""
        cols = [self._columns[name] for name in COLUMNS]
        for values in zip(*cols, strict=True):
            yield dict(zip(COLUMNS, values, strict=True))

    def to_frame(self) -> Any:
        """A pandas DataFrame with one row per record pair (columns `COLUMNS`).

        `first_differing_iteration` is, on each row, that of its site (see `SiteSummary`;
        -1 where the site never differs, as `order_a` is -1 where a has no record):
        `frame.groupby("site", sort=False).first_differing_iteration.first()` says in
        which order the sites diverged.

        `*_diff` columns are `a - b`; `dtype_match` is `False` where the two
        records' dtypes differ (`dtype_a`, `dtype_b`: `float32` against
        `bfloat16`); a record present in one run only has `status`
        `"only in a"`/`"only in b"`, NaN statistics and `False` matches.
        The frame's `attrs` hold `notes` and `moved_lines` (see the attributes).
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                "Comparison.to_frame() needs pandas: pip install 'torch-vartrace[pandas]'"
            ) from exc
        frame = pd.DataFrame(self._columns, columns=list(COLUMNS))
        frame.attrs.update(notes=list(self.notes), moved_lines=dict(self.moved_lines))
        return frame

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write one row per record pair to `path` (works without pandas); return the path."""
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for row in self.rows():
                writer.writerow(_csv_value(row[name]) for name in COLUMNS)
        return path

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        """The report in a notebook: its table, a row per site, and its summary lines."""
        header, body = self._table()
        facts = [("", line) for line in self._summary_lines()]
        return block(self._title(), facts, head=header, rows=body)

    def _title(self) -> str:
        a, b = self.labels
        return f"comparing {a} with {b} (atol={self.atol:g}, rtol={self.rtol:g})"

    def _table(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """The report's table: its header and a row per site."""
        header: tuple[str, ...] = (
            "site",
            "pairs",
            "differing",
            "unpaired",
            "first differing",
            "max abs diff",
            "max rel diff",
            "min cosine",
            "dtype",
            "status",
        )
        body: list[tuple[str, ...]] = [
            (
                s.site,
                str(s.records),
                str(s.differing),
                str(s.unpaired),
                "-" if s.first_differing_iteration is None else str(s.first_differing_iteration),
                _fmt(s.max_abs_diff),
                _fmt(s.max_rel_diff),
                _fmt_cosine(s.min_cosine, s.status not in (STATUS_OK, STATUS_SKIPPED)),
                s.dtypes,
                s.status if s.status == STATUS_OK else s.status.upper(),
            )
            for s in self.sites
        ]
        return header, body

    def lines(self) -> list[str]:
        """The readable report, line by line (`str(report)` joins them): a site name
        holding a newline stays on its line."""
        header, body = self._table()
        lines = [self._title(), *table(header, body, right=(1, 2, 3, 4, 5, 6, 7)), ""]
        return lines + self._summary_lines()

    def _summary_lines(self) -> list[str]:
        """The lines under the table: counts, the first divergence, one-sided sites."""
        differing = sum(1 for s in self.sites if s.status not in (STATUS_OK, STATUS_SKIPPED))
        summary = (
            f"{_plural(len(self.sites), 'site')} compared, {differing} differ, "
            f"{_plural(sum(s.records for s in self.sites), 'record pair')}"
        )
        retyped = sum(1 for s in self.sites if not s.dtype_match)
        if retyped:
            summary += f", {retyped} with different dtypes"
        lines = [summary]
        if self.first_divergence is None:
            lines.append("first divergence: none")
        else:
            d = self.first_divergence
            lines.append(f"first divergence: {d.site} at iteration {d.iteration}, rank {d.rank}")
        if self.only_in_a:
            lines.append(f"only in a ({len(self.only_in_a)}): " + ", ".join(self.only_in_a))
        if self.only_in_b:
            lines.append(f"only in b ({len(self.only_in_b)}): " + ", ".join(self.only_in_b))
        lines.extend(f"note: {note}" for note in self.notes)
        return lines


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _csv_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return str(tuple(int(d) for d in value))
    if value is None:
        return ""
    return value


def table(
    header: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Align columns: left-justified text, right-justified numbers (column indices `right`)."""
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in body)]
