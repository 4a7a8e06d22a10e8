"""The `vartrace` command: look at runs without writing a script.

Subcommands:

```python
vartrace ls RUN                         sites, records, shapes, dtypes, iterations, bytes
vartrace show RUN SITE... [--iteration I] [--rank R]
vartrace meta RUN [KEY]                 command, packages, git state, ...
vartrace sites MODULE:FACTORY [PATTERN] capturable sites of a model
vartrace compare A B [--atol --rtol --csv OUT --names PATTERN ...]
vartrace plot RUN SITE... [--stat mean,std] -o out.png
vartrace plot A B -o out.png            similarity heat map
```

`RUN` is an HDF5 file or a glob of per-rank shards (quote it:
`'run.rank*.h5'`); `SITE` may be a glob (`'layers.*.forward'`).  Sites
are listed in execution order.  `show --iteration K` prints the value each
site held at iteration K: its last record at or before K (change detection
stores a value only when it changes).  `compare` exits 1 when anything differs beyond
tolerance, so it can guard numerics in CI.  Errors print one line to
stderr and exit 2.  Everything is printed through `_print`, which shows control
and format characters of site names, metadata and paths escaped (`\x1b`, `\u202e`).

Example:
    ```python
    $ vartrace compare reference.h5 candidate.h5 --atol 1e-6 --csv diff.csv
    ```
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import math
import os
import re
import shlex
import sys
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np

__all__ = ["main"]

#: Values with more elements than this are previewed by ``show`` (edge items only).
_FULL_PRINT = 100
#: Most lines of one value's preview.
_PREVIEW_LINES = 24
#: Longest metadata text or list ``meta`` prints without being asked for that entry.
_META_LINES = 10
#: Records whose values ``show`` prints inline in its per-record table.
_INLINE = 6


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> NoReturn:
        _print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


class _UserError(Exception):
    """An error whose message is the whole story (no exception type printed)."""


#: A character other than printable ASCII: shown as it is unless its category is hidden.
_NOT_ASCII_TEXT = re.compile(r"[^\x20-\x7e]")
#: Unicode categories a terminal may act on rather than show: controls (C0 such as ESC,
#: BEL, NUL, CR, backspace; DEL; C1), format characters (bidi overrides and isolates, marks
#: and zero-width characters that reorder or hide text), lone surrogates, line separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(match: re.Match[str]) -> str:
    """The matched character as it is, or escaped if its category is hidden."""
    char = match.group()
    if char == "\t" or unicodedata.category(char) not in _HIDDEN:
        return char
    return char.encode("unicode_escape").decode("ascii")  # \x1b, \n, \u202e, \udc80


def _printable(text: str) -> str:
    """`text` with every character a terminal would act on shown escaped, as Python writes
    it (`\\x1b`, `\\n`, `\\u202e`); tabs and printable text of any script are kept."""
    return _NOT_ASCII_TEXT.sub(_escape, text)


def _print(*lines: str, file: TextIO | None = None) -> None:
    """Write `lines` to stdout (or `file`), each on a line of its own and
    `_printable`: a newline inside one (of a site name, a metadata string) shows as
    `\\n` and cannot forge a line.  Every command prints through it, errors too: a site
    name comes from any dict key of the traced code, a run file from anyone."""
    text = "".join(_printable(line) + "\n" for line in lines)
    (sys.stdout if file is None else file).write(text)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """The lines of an aligned table; cells are made printable first, so escaped names
    (`\\x1b`) keep the columns aligned."""
    from vartrace.analysis.comparison.report import table

    return table(header, [[_printable(cell) for cell in row] for row in rows], right)


def _open(path: str, allow_pickle: bool = False) -> Any:
    """Open a run, turning the usual failures into one-line messages."""
    from vartrace.storage.reader import open_run

    if not os.path.exists(path):  # an existing path is a path, even with [ ] or * in it
        if not glob.has_magic(path):
            raise _UserError(f"no such file: {path}")
        if not glob.glob(path):
            raise _UserError(f"no file matches {path}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = open_run(path, allow_pickle=allow_pickle)
    except ValueError as exc:  # not a vartrace file, a newer format, shards of several runs
        raise _UserError(_message(exc)) from exc
    except OSError as exc:
        raise _UserError(f"cannot open {path}: {_message(exc)}") from exc
    for warning in caught:  # a missing shard: one line, not Python's two
        _print(str(warning.message), file=sys.stderr)
    return run


def _site(run: Any, path: str, name: str) -> Any:
    if name not in run.names:
        close = _closest(name, run.names)
        hint = f"; did you mean {close}?" if close else f" (see vartrace ls {path})"
        raise _UserError(f"{path} has no site {name!r}{hint}")
    return run[name]


def _matching(run: Any, path: str, patterns: Sequence[str]) -> list[str]:
    """The sites named by `patterns` (exact names or globs), in execution order."""
    import fnmatch

    for pattern in patterns:
        if pattern not in run.names and not fnmatch.filter(run.names, pattern):
            _site(run, path, pattern)
    return [
        name
        for name in run.names
        if any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def _progress(items: Sequence[Any], what: str) -> Any:
    """`items` with a progress bar on a terminal's stderr, shown after one second."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, disable=not sys.stderr.isatty(), delay=1.0, leave=False)


def _closest(name: str, names: Sequence[str]) -> str:
    import difflib

    matches = difflib.get_close_matches(name, list(names), n=3)
    return ", ".join(matches)


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


def _cmd_ls(args: argparse.Namespace) -> int:
    from vartrace.analysis.sources import open_source

    with _open(args.run) as run, open_source(run) as source:
        aliases: dict[str, str] = getattr(run, "aliases", {})
        rows = []
        total_records = 0
        total_bytes = 0
        for name in source.names:
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
                    "alias" if name in aliases else "-" if nbytes is None else _human_bytes(nbytes),
                )
            )
        live = " (live: its writer still runs; run again for newer records)" if run.live else ""
    stored = len(rows) - len(aliases)
    summary = f"{stored} sites, {total_records} records, {_human_bytes(total_bytes)}"
    if aliases:
        summary += f"; {len(aliases)} aliases"
    _print(f"{args.run}: {summary}{live}")
    if rows:
        header = ("site", "records", "shape", "dtype", "iterations", "ranks", "bytes")
        _print(*_table(header, rows, right=(1, 6)))
    if aliases:
        _print("", "aliases (a value stored once, under the site that held it first):")
        _print(*(f"  {name} -> {target}" for name, target in aliases.items()))
    return 0


def _format_value(value: Any, dtype: str) -> list[str]:
    """Lines showing one record: the full value when small, a summary when big."""
    from vartrace.analysis.sources import Unreadable, value_as_array

    if isinstance(value, Unreadable):
        return ["  a pickled object: pass --allow-pickle to read it (it runs code from the file)"]
    if dtype == _STATISTICS:
        return _statistics_lines(value)
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


def _statistics_lines(value: Any) -> list[str]:
    """A statistics record (vartrace.stats): its fields, a few a line."""
    items = [f"{name} {number:.6g}" for name, number in value.items()]
    lines = [f"  statistics record ({_FINITE_LABEL}; {len(items)} fields)"]
    lines += ["  " + "  ".join(items[i : i + 6]) for i in range(0, len(items), 6)]
    return lines


def _cmd_show(args: argparse.Namespace) -> int:
    from vartrace.analysis.sources import open_source

    with _open(args.run, args.allow_pickle) as run, open_source(run) as source:
        names = _matching(run, args.run, args.sites)
        shown = 0
        for name in _progress(names, "show"):
            if len(names) > 1 and shown:
                _print("")
            shown += _show_site(source.site(name), name, args, single=len(names) == 1)
        if not shown:
            raise _UserError(
                f"no site of {', '.join(args.sites)} has a record at or before iteration "
                f"{args.iteration}" + ("" if args.rank is None else f" on rank {args.rank}")
            )
    return 0


def _show_site(view: Any, name: str, args: argparse.Namespace, single: bool) -> int:
    """Print one site (a table of its records, or its value as of an iteration); 1 if printed."""
    from vartrace.analysis.sources import record_stats

    ranks = sorted(set(view.ranks.tolist())) if args.rank is None else [args.rank]
    if args.iteration is None:
        rows = np.flatnonzero(np.isin(view.ranks, ranks))
        if not len(rows):
            if single:
                raise _UserError(
                    f"site {name!r} has no record on rank {args.rank} ({_where(view)})"
                )
            return 0
        origin = "" if view.reduced_from is None else f", shape {view.reduced_from.shape_text}"
        _print(f"{name}: {len(rows)} records, dtype {','.join(_dtypes(view))}{origin}")
        _print(*_record_table(view, rows, record_stats))
        return 1
    printed = 0
    for rank in ranks:
        mine = np.flatnonzero(view.ranks == rank)
        mine = mine[np.lexsort((view.order[mine], view.iterations[mine]))]
        at = mine[view.iterations[mine] == args.iteration]
        before = mine[view.iterations[mine] < args.iteration]
        if len(at):
            label = f"{name} @ iteration {args.iteration}, rank {rank}"
            for call, r in enumerate(at, 1):
                count = f", call {call} of {len(at)}" if len(at) > 1 else ""
                _print(f"{label}{count} (capture order {view.order[r]})")
                _print(*_format_value(_record_value(view, int(r)), view.dtypes[r]))
        elif len(before):
            r = before[-1]
            _print(
                f"{name} @ iteration {args.iteration}, rank {rank}: unchanged since "
                f"iteration {view.iterations[r]} (capture order {view.order[r]})"
            )
            _print(*_format_value(_record_value(view, int(r)), view.dtypes[r]))
        else:
            continue
        printed = 1
    if not printed and single:
        on = "" if args.rank is None else f" on rank {args.rank}"
        raise _UserError(
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
        return _table(header, body, right=(0, 1))
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
            _STATISTICS if view.dtypes[r] == _STATISTICS else _record_shape(view.shapes[r]),
            *(f"{stats[s][i]:.6g}" for s in _TABLE_STATS),
            *(f"{stats[n][i]:.0f}" for n, _ in counted),
        )
        for i, r in enumerate(rows)
    ]
    table = _table(header, body, right=range(len(header)))
    if not counted:
        return table
    return [f"(statistics {_FINITE_LABEL}; NaN and infinities counted)", *table]


def _record_shape(shape: Sequence[int] | None) -> str:
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
            size = _human_bytes(len(text.encode()))
            return [f"{key.ljust(width)}  ({len(lines)} lines, {size}: {command} {key} prints it)"]
        return [f"{key.ljust(width)}  |", *(f"    {line}" for line in lines)]
    return [f"{key.ljust(width)}  {text}"]


def _cmd_meta(args: argparse.Namespace) -> int:
    with _open(args.run) as run:
        meta = dict(run.meta)
    items = _flatten(meta)
    if args.key is not None:
        chosen = [(k, v) for k, v in items if k == args.key or k.startswith(args.key + ".")]
        if not chosen:
            keys = ", ".join(k for k, _ in items) or "none"
            raise _UserError(f"{args.run} has no metadata {args.key!r} (keys: {keys})")
        items = chosen
    if not items:
        _print(f"{args.run}: no metadata")
        return 0
    width = min(30, max(len(k) for k, _ in items))
    command = f"vartrace meta {shlex.quote(args.run)}" if args.key is None else None
    for key, value in items:
        _print(*_meta_lines(key, value, width, command))
    return 0


def _load_factory(spec: str) -> Any:
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise _UserError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise _UserError(f"no such file: {module_name}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise _UserError(f"cannot import {module_name}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise _UserError(f"cannot import module {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise _UserError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise _UserError(f"{spec} is not callable")
    return target


def _cmd_sites(args: argparse.Namespace) -> int:
    factory = _load_factory(args.factory)
    try:
        model = factory()
    except Exception as exc:
        raise _UserError(f"{args.factory}() failed: {_message(exc)}") from exc
    from torch import nn

    from vartrace.tracing.sites import list_sites

    if not isinstance(model, nn.Module):
        raise _UserError(f"{args.factory}() returned {type(model).__name__}, not a torch.nn.Module")
    sites = list_sites(model, args.pattern)
    if not sites:
        raise _UserError(f"no site of {type(model).__name__} matches {args.pattern!r}")
    _print(*sites)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from vartrace.analysis.comparison import compare

    run_a = _open(args.a, args.allow_pickle)
    try:
        run_b = _open(args.b, args.allow_pickle)
        try:
            report = compare(
                run_a,
                run_b,
                atol=args.atol,
                rtol=args.rtol,
                names=args.names,
                progress=sys.stderr.isatty(),
                labels=(args.a, args.b),
            )
        finally:
            run_b.close()
    finally:
        run_a.close()
    _print(*report.lines())
    if args.csv is not None:
        report.to_csv(args.csv)
        _print(f"wrote {args.csv} ({len(report)} rows)")
    return 0 if report.ok else 1


def _is_run_path(text: str) -> bool:
    return os.path.isfile(text) or (glob.has_magic(text) and bool(glob.glob(text)))


def _cmd_plot(args: argparse.Namespace) -> int:
    from vartrace.analysis.plot import plot_similarity, plot_stat

    first, rest = args.inputs[0], args.inputs[1:]
    if not rest:
        raise _UserError("plot needs SITE names after RUN, or a second RUN for a similarity map")
    run = _open(first, args.allow_pickle)
    try:
        similarity = (  # a site glob matching a file of the folder ('forward.*') names sites
            args.stat is None
            and len(rest) == 1
            and not any(_fnmatch(name, rest[0]) for name in run.names)
            and _is_run_path(rest[0])
        )
        if similarity:
            other = _open(rest[0], args.allow_pickle)
            try:
                from vartrace.analysis.comparison import compare

                report = compare(
                    run,
                    other,
                    atol=args.atol,
                    rtol=args.rtol,
                    progress=sys.stderr.isatty(),
                    labels=(first, rest[0]),
                )
            finally:
                other.close()
            plot_similarity(None, None, args.output, comparison=report)
            what = f"similarity of {len(report.sites)} sites"
        else:
            for name in rest:
                if name not in run.names and not any(_fnmatch(n, name) for n in run.names):
                    _site(run, first, name)
            stats = args.stat or "mean,std"
            figure = plot_stat(run, rest, stats, args.output, progress=sys.stderr.isatty())
            lines = len(figure.axes[0].get_lines())
            what = f"{stats} over iterations, {lines} line(s) per statistic"
    finally:
        run.close()
    _print(f"wrote {args.output} ({what})")
    return 0


def _cmd_tensorboard(args: argparse.Namespace) -> int:
    from vartrace.analysis.tensorboard import export_run

    stats = [s for s in args.stat.split(",") if s] if args.stat else None
    with _open(args.run, args.allow_pickle) as run:
        names = _matching(run, args.run, args.sites) if args.sites else list(run.names)
        options: dict[str, Any] = {"histograms": not args.no_histograms}
        if stats is not None:
            options["stats"] = stats
        written = export_run(run, args.logdir, names=_progress(names, "tensorboard"), **options)
    _print(
        f"wrote {written} record(s) of {len(names)} site(s) to {args.logdir}",
        f"view them with: tensorboard --logdir {args.logdir}",
    )
    return 0


def _fnmatch(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


# --------------------------------------------------------------------------- parser


_RUN_HELP = "an HDF5 run file, or a quoted glob of per-rank shards ('run.rank*.h5')"
_PICKLE_HELP = (
    "unpickle records stored as pickled objects (runs code stored in the file: "
    "only for files you trust)"
)


def _parser() -> argparse.ArgumentParser:
    from vartrace import __version__

    parser = _Parser(
        prog="vartrace",
        description="Look at vartrace runs: list, show, compare and plot recorded values.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("ls", help="list the sites of a run, in execution order")
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "show",
        help="print the recorded values of sites",
        description="Without --iteration: a table of every record.  With --iteration K: the "
        "value each site held at K, i.e. its last record at or before K.",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument(
        "sites", metavar="SITE", nargs="+", help="site names or quoted globs ('layers.*')"
    )
    p.add_argument(
        "--iteration",
        "-i",
        type=int,
        help="print the value held at this iteration (its last record at or before it)",
    )
    p.add_argument("--rank", "-r", type=int, help="only records of this rank (default: all)")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("meta", help="print a run's metadata (command, packages, git, ...)")
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument(
        "key",
        metavar="KEY",
        nargs="?",
        help="print only this entry, dotted (git.commit), in full: long ones (git.diff, "
        "packages) are summarized otherwise",
    )
    p.set_defaults(func=_cmd_meta)

    p = sub.add_parser("sites", help="list the capturable sites of a model built by a factory")
    p.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a callable returning the model: mypkg.models:build or path/to/file.py:build",
    )
    p.add_argument(
        "pattern", metavar="PATTERN", nargs="?", default="**", help="a path pattern (default **)"
    )
    p.set_defaults(func=_cmd_sites)

    p = sub.add_parser("compare", help="compare two runs; exit 1 when they differ")
    p.add_argument("a", metavar="A", help="the first run: " + _RUN_HELP)
    p.add_argument("b", metavar="B", help="the second run, the reference of --rtol")
    p.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (1e-8)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    p.add_argument("--csv", metavar="OUT", help="write one row per record pair to OUT")
    p.add_argument("--names", nargs="+", metavar="PATTERN", help="compare only these sites")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "plot",
        help="plot statistics over iterations, or a similarity heat map of two runs",
        usage="%(prog)s RUN SITE... [--stat STAT] -o OUTPUT [--allow-pickle]\n"
        "       %(prog)s A B -o OUTPUT [--atol ATOL] [--rtol RTOL] [--allow-pickle]",
        description="RUN SITE...: statistics of sites over iterations, one line per rank.  "
        "A B: a heat map of the similarity of two runs, sites x iterations.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a run and site names or quoted globs; or two runs for a similarity map",
    )
    p.add_argument(
        "--stat",
        help="statistics, comma separated (default mean,std; also var, min, max, absmax, norm, "
        "nan, posinf, neginf, zeros, count; q0.5... of statistics records), over finite values",
    )
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .pdf, .svg)")
    p.add_argument("--atol", type=float, default=1e-8, help="similarity map: absolute tolerance")
    p.add_argument("--rtol", type=float, default=1e-5, help="similarity map: relative tolerance")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser(
        "tensorboard",
        help="write a run's statistics and histograms as TensorBoard event files",
        description="Each numeric record becomes scalars <site>/<statistic> (over finite "
        "values; nan, posinf, neginf count the others) and a histogram <site>, at its "
        "iteration.  Needs pip install 'torch-vartrace[tensorboard]'.",
    )
    p.add_argument("run", metavar="RUN", help=_RUN_HELP)
    p.add_argument("--logdir", required=True, help="folder of the event files to write")
    p.add_argument(
        "--sites", nargs="+", metavar="SITE", help="only these sites (names or quoted globs)"
    )
    p.add_argument(
        "--stat",
        help="statistics written as scalars, comma separated "
        "(default mean,std,min,max,absmax,nan,posinf,neginf)",
    )
    p.add_argument("--no-histograms", action="store_true", help="write scalars only")
    p.add_argument("--allow-pickle", action="store_true", help=_PICKLE_HELP)
    p.set_defaults(func=_cmd_tensorboard)
    return parser


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Print a warning of a library (matplotlib's missing glyph of a site name) in one line
    through `_print`, as `warnings.showwarning` during a command."""
    _print(f"{filename}:{lineno}: {category.__name__}: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `vartrace` command line; return the exit status.

    Example:
        ```python
        >>> main(["ls", "run.h5"])
        0
        ```
    """
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(args.func(args))
    except _UserError as exc:
        _print(f"vartrace {args.command}: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        _print("vartrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    except Exception as exc:
        _print(f"vartrace {args.command}: error: {_message(exc)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
