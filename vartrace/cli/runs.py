"""Opening the runs a command names and picking their sites, with one-line errors.

Example:
    ```python
    run = open_path("run.h5")
    names = matching(run, "run.h5", ["layers.*.forward"])
    ```
"""

from __future__ import annotations

import glob
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from vartrace._support.series import picked
from vartrace._support.text import close_matches
from vartrace.cli.output import UserError, message_of, print_safe


def _is_url(text: str) -> bool:
    """Whether `text` names a run through fsspec (`s3://...`, `memory://...`)."""
    return "://" in text


def open_path(path: str | Sequence[str], allow_pickle: bool = False) -> Any:
    """Open a run (a path, a glob, a directory or a URL, or several of them: the shards of
    one run in several directories), turning the usual failures into one-line messages."""
    from vartrace.storage.reader import open_run

    paths = [path] if isinstance(path, str) else list(path)
    for one in paths:
        # An existing path is a path, even with [ ] or * in it; a URL is looked up by fsspec.
        if not _is_url(one) and not os.path.exists(one):
            if not glob.has_magic(one):
                raise UserError(f"no such file: {one}")
            if not glob.glob(one):
                raise UserError(f"no file matches {one}")
    path = paths[0] if len(paths) == 1 else " ".join(paths)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = open_run(paths[0] if len(paths) == 1 else paths, allow_pickle=allow_pickle)
    except ValueError as exc:  # not a vartrace file, a newer format, shards of several runs
        raise UserError(message_of(exc)) from exc
    except ImportError as exc:  # a URL without fsspec
        raise UserError(message_of(exc)) from exc
    except OSError as exc:
        raise UserError(f"cannot open {path}: {message_of(exc)}") from exc
    for warning in caught:  # a missing shard: one line, not Python's two
        print_safe(str(warning.message), file=sys.stderr)
    return run


def site_of(run: Any, path: str, name: str) -> Any:
    if name not in run:  # (a plain name reads as its @every series: run.series)
        close = ", ".join(close_matches(name, run.names))
        hint = f"; did you mean {close}?" if close else f" (see vartrace ls {path})"
        raise UserError(f"{path} has no site {name!r}{hint}")
    return run[name]


def matching(run: Any, path: str, patterns: Sequence[str]) -> list[str]:
    """The sites named by `patterns` (exact names or globs, see `picked`: an `@every`
    series by its name), in execution order."""
    names, series = run.names, run.series
    for pattern in patterns:
        if not picked(pattern, names, series):
            site_of(run, path, pattern)
    chosen = {name for pattern in patterns for name in picked(pattern, names, series)}
    firsts = {lines[0]: name for name, lines in series.items()}  # a series before its lines
    ordered = [found for name in names for found in (firsts.get(name), name) if found]
    return [name for name in ordered if name in chosen]


def is_run_path(text: str) -> bool:
    return _is_url(text) or os.path.isfile(text) or (glob.has_magic(text) and bool(glob.glob(text)))


def matches_pattern(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)
