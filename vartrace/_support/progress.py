"""Progress bars on stderr: tqdm's, shown when asked for and once the work has lasted a second;
when not asked for, no bar at all (tqdm is not even imported, so it warns of nothing).

A terminal that reports no size (a pty nobody sized: 0 columns, 0 rows) gets a bar 80
columns wide: tqdm would take it for a screen of -1 rows and hide every bar.  In a
notebook, `tqdm.auto` draws a widget when ipywidgets is importable; without it, importing
`tqdm.auto` warns "IProgress not found", so the terminal bar is used instead.

Example:
    ```python
    with progress_bar(show=sys.stderr.isatty(), total=len(rows), desc="export") as bar:
        for row in rows:
            ...
            bar.update(1)
    ```
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

#: Seconds of work before a bar is drawn: short work prints nothing.
DELAY = 1.0
#: The size assumed of a terminal that reports none: (columns, rows).
_UNSIZED = (80, 24)


class _NoBar:
    """What `progress_bar` returns when no bar is wanted: it iterates and prints nothing."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(() if self._iterable is None else self._iterable)

    def update(self, n: int = 1) -> None:
        """Nothing to advance."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *_: object) -> None:
        return None


def _tqdm() -> Any:
    """`tqdm.auto.tqdm` where ipywidgets is importable (a widget in a notebook), else the
    terminal bar `tqdm.std.tqdm`."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def _unsized_terminal() -> dict[str, int]:
    """`ncols` and `nrows` for tqdm when stderr is a terminal reporting 0 columns or rows."""
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal, or no file descriptor
        return {}
    if columns and rows:
        return {}
    return {"ncols": columns or _UNSIZED[0], "nrows": rows or _UNSIZED[1]}


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    show: bool,
    desc: str,
    total: int | None = None,
    unit: str = "it",
) -> Any:
    """A tqdm bar over `iterable` (or of `total` steps, advanced by `update`) on stderr, drawn
    after `DELAY` seconds and cleared when done; without `show`, a stand-in that iterates
    and prints nothing."""
    if not show:
        return _NoBar(iterable)
    return _tqdm()(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        leave=False,
        delay=DELAY,
        **_unsized_terminal(),
    )
