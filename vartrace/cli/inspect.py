"""`vartrace ls`, `show` and `meta`: what a run holds, record by record.

Example:
    ```python
    $ vartrace show run.h5 'layers.0.forward' --iteration 40
    ```
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from vartrace._support.text import size_text
from vartrace.cli.output import UserError, print_safe, progress, table_lines
from vartrace.cli.runs import matching, open_path
from vartrace.statistics.fields import COUNTS

#: Values with more elements than this are previewed by ``show`` (edge items only).
_FULL_PRINT = 100
#: Most lines of one value's preview.
_PREVIEW_LINES = 24
#: Longest metadata text or list ``meta`` prints without being asked for that entry.
_META_LINES = 10
#: Records whose values ``show`` prints inline in its per-record table.
_INLINE = 6


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _shapes_summary(view: Any) -> str:
    shapes = {s for s in view.shapes if s is not None}
    if not shapes:
        origin = view.reduced_from  # statistics rows: the shape of what they summarise
        return "-" if origin is None else origin.shape_text
    if len(shapes) == 1:
        return _shape_text(next(iter(shapes)))
    ndims = {len(s) for s in shapes}
    if len(ndims) == 1:
        biggest = tuple(max(dims) for dims in zip(*shapes, strict=True))
        return f"ragged <= {_shape_text(biggest)}"
    return f"{len(shapes)} shapes"


def _dtypes(view: Any) -> list[str]:
    """Every dtype among a site's records, in order of first appearance.

    Numeric records kept outside the site's `values` dataset (another dtype
    than the first record's) are read to name theirs.
    """
    from vartrace.analysis.sources import value_dtype_name

    found: dict[str, None] = {}
    for row, (dtype, shape) in enumerate(zip(view.dtypes, view.shapes, strict=True)):
        if shape is None and dtype in _NUMERIC_KINDS:
            dtype = value_dtype_name(view.objects(np.asarray([row]))[0])
        found[view.dtype_label(dtype)] = None
    return list(found)


#: Kind names of numeric records that ``ls`` reads to name their dtype.
_NUMERIC_KINDS = frozenset({"tensor", "ndarray", "numpy scalar"})


def _range_text(values: np.ndarray) -> str:
    if len(values) == 0:
        return "-"
    low, high = int(values.min()), int(values.max())
    return str(low) if low == high else f"{low}..{high}"


def _site_bytes(site: Any) -> int | None:
    values = getattr(site, "raw_values", None)  # its size needs no compression filter
    nbytes = getattr(values, "nbytes", None)
    return None if nbytes is None else int(nbytes)


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    from vartrace.analysis.sources import open_source

    with open_path(args.run) as run, open_source(run) as source:
        aliases: dict[str, str] = getattr(run, "aliases", {})
        rows = []
        total_records = 0
        total_bytes = 0
        for name in progress(source.names, "ls"):
            view = source.site(name)
            nbytes = None if name in aliases else _site_bytes(run[name])
            if name not in aliases:
                total_records += len(view.iterations)
            total_bytes += nbytes or 0
            rows.append(
                (
                    name,
                    str(len(view.iterations)),
                    _shapes_summary(view),
                    ",".join(_dtypes(view)) or "-",
                    _range_text(view.iterations),
                    _range_text(view.ranks),
                    "alias" if name in aliases else "-" if nbytes is None else size_text(nbytes),
                )
            )
        live = " (live: its writer still runs; run again for newer records)" if run.live else ""
        series: dict[str, list[str]] = getattr(run, "series", {})
    stored = len(rows) - len(aliases)
    summary = f"{stored} sites, {total_records} records, {size_text(total_bytes)}"
    if aliases:
        summary += f"; {len(aliases)} aliases"
    print_safe(f"{' '.join(args.run)}: {summary}{live}")
    if rows:
        header = ("site", "records", "shape", "dtype", "iterations", "ranks", "bytes")
        print_safe(*table_lines(header, rows, right=(1, 6)))
    if aliases:
        print_safe("", "aliases (a value stored once, under the site that held it first):")
        print_safe(*(f"  {name} -> {target}" for name, target in aliases.items()))
    if series:
        print_safe("", "series (every binding of a variable in execution order, read by name):")
        print_safe(*(f"  {name} = {' + '.join(lines)}" for name, lines in series.items()))
    return 0


def _format_value(value: Any, dtype: str, reduced_from: Any = None) -> list[str]:
    """Lines showing one record: the full value when small, a summary when big; a
    statistics record with the dtype and shape of what it summarises (`reduced_from`)."""
    from vartrace.analysis.sources import Unreadable, value_as_array

    if isinstance(value, Unreadable):
        return ["  a pickled object: pass --allow-pickle to read it (it runs code from the file)"]
    if dtype == _STATISTICS:
        return _statistics_lines(value, reduced_from)
    array = value_as_array(value)
    if array is None:
        text = _value_text(value)
        if len(text) > 2000:
            text = text[:2000] + f"... ({len(text)} characters)"
        return [f"  {type(value).__name__}: {text}"]
    lines = [f"  shape {_shape_text(array.shape)}  dtype {dtype}"]
    if array.size and array.dtype.kind in "fciub":
        lines.append("  " + _stats_text(array))
    with np.printoptions(threshold=_FULL_PRINT, edgeitems=3, linewidth=100, precision=6):
        body = np.array2string(array).splitlines()
    if len(body) > _PREVIEW_LINES:
        cut = len(body) - _PREVIEW_LINES
        body = [
            *body[: _PREVIEW_LINES // 2],
            f"... ({cut} more lines)",
            *body[-_PREVIEW_LINES // 2 :],
        ]
    lines.extend("  " + line for line in body)
    return lines


#: The statistics of ``show``'s record table and value summaries.
_TABLE_STATS = ("mean", "std", "min", "max")
#: How ``show`` labels the statistics of :data:`vartrace.analysis.sources.STATS` it prints.
_FINITE_LABEL = "over finite values"
#: Counts of the values the statistics leave out, with their labels.
_NONFINITE = (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf"))
_STATISTICS = "statistics"
#: The prefix of the histogram fields of a statistics record (`log2|x|=3`).
_BINS = "log2|x|"


def _value_text(value: Any) -> str:
    """`repr` of a record value; an int too long for decimal text (Python refuses more
    than 4300 digits) in hexadecimal, its middle cut."""
    try:
        return repr(value)
    except ValueError:
        if not isinstance(value, int):
            raise
        digits = hex(value)
        return f"{digits[:34]}...{digits[-8:]} (an int of {value.bit_length()} bits)"


def _stats_text(array: np.ndarray) -> str:
    """The one definition of every view (`analysis.sources.STATS`): statistics over the finite
    values, then the counts of NaN, +inf and -inf when there are any."""
    from vartrace.statistics.named import STATS, reduce_block

    block = array.reshape(1, -1)
    parts = [f"{name} {reduce_block(STATS[name], block)[0]:.6g}" for name in _TABLE_STATS]
    counts = [
        f"{label} {int(reduce_block(STATS[name], block)[0])}"
        for name, label in _NONFINITE
        if reduce_block(STATS[name], block)[0]
    ]
    return "  ".join([*parts, f"({_FINITE_LABEL})", *counts])


def _statistics_lines(value: Any, reduced_from: Any) -> list[str]:
    """A statistics record (vartrace.stats): what it summarises, then its fields, a few a
    line."""
    items = [f"{name} {number:.6g}" for name, number in value.items()]
    lines = [f"  statistics record ({_FINITE_LABEL}; {len(items)} fields)"]
    if reduced_from is not None:
        lines.append(f"  of shape {reduced_from.shape_text}  dtype {reduced_from.dtype}")
    lines += ["  " + "  ".join(items[i : i + 6]) for i in range(0, len(items), 6)]
    return lines


def _statistics_table(view: Any, rows: np.ndarray) -> list[str]:
    """A table of statistics records, a column per field (the histogram's bins left to
    `show --iteration`), the shape of what each summarises in the shape column."""
    records = view.objects(rows)
    fields = list(dict.fromkeys(name for record in records for name in record))
    columns = [name for name in fields if not name.startswith(_BINS)]
    shape = "-" if view.reduced_from is None else view.reduced_from.shape_text
    header = ("iteration", "rank", "shape", *columns)
    body = [
        (
            str(view.iterations[r]),
            str(view.ranks[r]),
            shape,
            *(_field_text(record.statistic(name), name) for name in columns),
        )
        for r, record in zip(rows.tolist(), records, strict=True)
    ]
    lines = [f"(statistics {_FINITE_LABEL}; nan, posinf, neginf count the others)"]
    lines += table_lines(header, body, right=range(len(header)))
    bins = len(fields) - len(columns)
    if bins:
        lines.append(f"(and {bins} histogram bins: show --iteration I prints them)")
    return lines


def _field_text(number: float, name: str) -> str:
    """A statistics field as `show` prints it: counts whole, the rest to 6 digits."""
    if math.isnan(number):
        return "-" if name in COUNTS else "nan"
    return f"{number:.0f}" if name in COUNTS else f"{number:.6g}"


def cmd_show(args: argparse.Namespace) -> int:
    from vartrace.analysis.sources import open_source

    with open_path(args.run, args.allow_pickle) as run, open_source(run) as source:
        names = matching(run, args.run, args.sites)
        horizon = _Horizon(source, run.live)
        shown = 0
        for name in progress(names, "show"):
            if len(names) > 1 and shown:
                print_safe("")
            printed = _show_site(source.site(name), name, args, horizon, len(names) == 1)
            shown += printed
            if printed and (placement := run[name].placement) is not None:
                print_safe(
                    f"  each rank's shard of {placement}: "
                    f"vartrace.assemble(run[{name!r}], iteration) joins them"
                )
        if not shown:
            raise UserError(
                f"no site of {', '.join(args.sites)} has a record at or before iteration "
                f"{args.iteration}" + ("" if args.rank is None else f" on rank {args.rank}")
            )
    return 0


class _Horizon:
    """How far a run goes: whether its writer still runs, and per rank its last iteration
    (of any site: what a live file holds as of its last flush), read when first asked."""

    def __init__(self, source: Any, live: bool) -> None:
        self.live = live
        self._source = source
        self._last: dict[int, int] | None = None

    def last(self, rank: int) -> int:
        if self._last is None:
            self._last = {}
            for name in self._source.names:
                view = self._source.site(name)
                for r in np.unique(view.ranks).tolist():
                    at = int(view.iterations[view.ranks == r].max())
                    self._last[r] = max(at, self._last.get(r, at))
        return self._last.get(rank, -1)

    def why_unchanged(self, iteration: int, rank: int, since: int) -> str:
        """Why a site holds at `iteration` what it held at `since`: it did not change, or
        the run has not flushed that iteration yet (live), or it ended before it."""
        last = self.last(rank)
        if iteration <= last:
            return f"unchanged since iteration {since}"
        if self.live:
            return (
                f"not flushed yet (live; last flush at {last}); its last record: iteration {since}"
            )
        return f"after the run's last iteration ({last}); its last record: iteration {since}"


def _show_site(
    view: Any, name: str, args: argparse.Namespace, horizon: _Horizon, single: bool
) -> int:
    """Print one site (a table of its records, or its value as of an iteration); 1 if printed."""
    from vartrace.analysis.sources import record_stats

    ranks = sorted(set(view.ranks.tolist())) if args.rank is None else [args.rank]
    if args.iteration is None:
        rows = np.flatnonzero(np.isin(view.ranks, ranks))
        if not len(rows):
            if single:
                raise UserError(f"site {name!r} has no record on rank {args.rank} ({_where(view)})")
            return 0
        origin = "" if view.reduced_from is None else f", shape {view.reduced_from.shape_text}"
        print_safe(f"{name}: {len(rows)} records, dtype {','.join(_dtypes(view))}{origin}")
        print_safe(*_record_table(view, rows, record_stats))
        return 1
    printed = 0
    origin = view.reduced_from
    for rank in ranks:
        mine = np.flatnonzero(view.ranks == rank)
        mine = mine[np.lexsort((view.order[mine], view.iterations[mine]))]
        at = mine[view.iterations[mine] == args.iteration]
        before = mine[view.iterations[mine] < args.iteration]
        if len(at):
            label = f"{name} @ iteration {args.iteration}, rank {rank}"
            for call, r in enumerate(at, 1):
                count = f", call {call} of {len(at)}" if len(at) > 1 else ""
                print_safe(f"{label}{count} (capture order {view.order[r]})")
                print_safe(*_format_value(_record_value(view, int(r)), view.dtypes[r], origin))
        elif len(before):
            r = before[-1]
            why = horizon.why_unchanged(args.iteration, rank, int(view.iterations[r]))
            print_safe(
                f"{name} @ iteration {args.iteration}, rank {rank}: {why} "
                f"(capture order {view.order[r]})"
            )
            print_safe(*_format_value(_record_value(view, int(r)), view.dtypes[r], origin))
        else:
            continue
        printed = 1
    if not printed and single:
        on = "" if args.rank is None else f" on rank {args.rank}"
        raise UserError(
            f"site {name!r} has no record at or before iteration {args.iteration}{on} "
            f"({_where(view)})"
        )
    return printed


def _where(view: Any) -> str:
    return f"iterations {_range_text(view.iterations)}, ranks {_range_text(view.ranks)}"


def _record_value(view: Any, row: int) -> Any:
    shape = view.shapes[row]
    if shape is None:
        return view.objects(np.asarray([row]))[0]
    return view.read(np.asarray([row]), shape)[0]


def _record_table(view: Any, rows: np.ndarray, record_stats: Any) -> list[str]:
    if all(view.dtypes[r] == _STATISTICS for r in rows):
        return _statistics_table(view, rows)
    statistics = any(view.dtypes[r] == _STATISTICS for r in rows)
    numeric = statistics or any(view.shapes[r] is not None for r in rows)
    small = (
        numeric
        and not statistics
        and all(view.shapes[r] is None or math.prod(view.shapes[r]) <= _INLINE for r in rows)
    )
    header: tuple[str, ...]
    if not numeric or small:
        header = ("iteration", "rank", "shape", "value")
        body: list[tuple[str, ...]] = []
        for r in rows:
            value = _record_value(view, int(r))
            text = (
                np.array2string(np.asarray(value), max_line_width=200)
                if view.shapes[r] is not None
                else _value_text(value)
            )
            shape = view.shapes[r]
            body.append(
                (
                    str(view.iterations[r]),
                    str(view.ranks[r]),
                    "-" if shape is None else _shape_text(shape),
                    text if len(text) <= 80 else text[:77] + "...",
                )
            )
        return table_lines(header, body, right=(0, 1))
    names = (*_TABLE_STATS, *(name for name, _ in _NONFINITE))
    found = record_stats(view, names, progress=sys.stderr.isatty())
    stats = {s: v[rows] for s, v in found.items()}
    counted = [(n, label) for n, label in _NONFINITE if np.nansum(stats[n]) > 0]
    header = (
        "iteration",
        "rank",
        "shape",
        *_TABLE_STATS,
        *(label for _, label in counted),
    )
    body = [
        (
            str(view.iterations[r]),
            str(view.ranks[r]),
            _record_shape(
                view.shapes[r], view.reduced_from if view.dtypes[r] == _STATISTICS else None
            ),
            *(f"{stats[s][i]:.6g}" for s in _TABLE_STATS),
            *(f"{stats[n][i]:.0f}" for n, _ in counted),
        )
        for i, r in enumerate(rows)
    ]
    table = table_lines(header, body, right=range(len(header)))
    if not counted:
        return table
    return [f"(statistics {_FINITE_LABEL}; NaN and infinities counted)", *table]


def _record_shape(shape: Sequence[int] | None, reduced_from: Any = None) -> str:
    """A record's shape; of a statistics record, the shape of what it summarises."""
    if reduced_from is not None:
        return str(reduced_from.shape_text)
    return "-" if shape is None else _shape_text(shape)


def _flatten(meta: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(meta, dict):
        items: list[tuple[str, Any]] = []
        for key, value in meta.items():
            items.extend(_flatten(value, f"{prefix}{key}."))
        return items
    return [(prefix.rstrip("."), meta)]


def _meta_lines(key: str, value: Any, width: int, command: str | None) -> list[str]:
    """The lines of one metadata entry; with `command` (how to print one entry), long texts
    and lists (the git diff, the packages) are summarized in one line."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            return [f"{key.ljust(width)}  (none)"]
        text = ", ".join(map(str, value))
        if len(text) <= 100:
            return [f"{key.ljust(width)}  {text}"]
        if command is not None and len(value) > _META_LINES:
            return [f"{key.ljust(width)}  ({len(value)} entries: {command} {key} lists them)"]
        return [f"{key.ljust(width)}  ({len(value)} entries)", *(f"    {v}" for v in value)]
    text = str(value)
    if "\n" in text:  # one indented line per line; any other control character shows escaped
        lines = text.removesuffix("\n").split("\n")
        if command is not None and len(lines) > _META_LINES:
            size = size_text(len(text.encode()))
            return [f"{key.ljust(width)}  ({len(lines)} lines, {size}: {command} {key} prints it)"]
        return [f"{key.ljust(width)}  |", *(f"    {line}" for line in lines)]
    return [f"{key.ljust(width)}  {text}"]


def cmd_meta(args: argparse.Namespace) -> int:
    with open_path(args.run) as run:
        meta = dict(run.meta)
    items = _flatten(meta)
    if args.key is not None:
        chosen = [(k, v) for k, v in items if k == args.key or k.startswith(args.key + ".")]
        if not chosen:
            keys = ", ".join(k for k, _ in items) or "none"
            raise UserError(f"{args.run} has no metadata {args.key!r} (keys: {keys})")
        items = chosen
    if not items:
        print_safe(f"{args.run}: no metadata")
        return 0
    width = min(30, max(len(k) for k, _ in items))
    command = f"vartrace meta {shlex.quote(args.run)}" if args.key is None else None
    for key, value in items:
        print_safe(*_meta_lines(key, value, width, command))
    return 0
