"""The names of `@every` series: which line sites one variable's bindings are stored under.

`@every` stores each value under the line that bound it, `<site>@every:L<line>`; the
series `<site>@every` reads all of them as one, in execution order, and so does the plain
`<site>` when nothing else holds that name (as for `@entry` / `@return`).  This module
only works with names: the results and the reader merge the records.

Example:
    ```python
    groups = every_series(["forward.h@every:L27", "forward.h@every:L28", "forward.y"])
    # {"forward.h@every": ["forward.h@every:L27", "forward.h@every:L28"]}
    series_read_as("forward.h", groups, {"forward.y"})   # "forward.h@every"
    ```
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Container, Iterable, Mapping, Sequence

__all__ = [
    "EVERY",
    "every_series",
    "line_of",
    "picked",
    "series_of",
    "series_read_as",
]

#: The suffix of a series name (`forward.h@every`).
EVERY = "@every"

_LINE_SITE = re.compile(r"(.+@every):L(\d+)")


def series_of(name: str) -> str | None:
    """The series a line site belongs to (`forward.h@every:L27` -> `forward.h@every`), or
    `None` for a name that is no line site."""
    found = _LINE_SITE.fullmatch(name)
    return None if found is None else found.group(1)


def line_of(name: str) -> int | None:
    """The source line of a line site (`forward.h@every:L27` -> 27), or `None`."""
    found = _LINE_SITE.fullmatch(name)
    return None if found is None else int(found.group(2))


def every_series(names: Iterable[str]) -> dict[str, list[str]]:
    """Series name -> its line sites among `names`, in the order of `names`.

    A series whose name is itself among `names` (a file of an older vartrace that stored
    `forward.h@every`) is left out: that name reads as what it stored.
    """
    names = list(names)
    given = set(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        series = series_of(name)
        if series is not None and series not in given:
            groups.setdefault(series, []).append(name)
    return groups


def series_read_as(
    name: object, series: Mapping[str, list[str]], names: Container[str]
) -> str | None:
    """The series `name` reads as: itself when it is one, the series `<name>@every` for a
    plain name that `names` (the stored sites and aliases) do not hold; else `None`."""
    if not isinstance(name, str):
        return None
    if name in series:
        return name
    if name not in names and name + EVERY in series:
        return name + EVERY
    return None


def picked(pattern: str, names: Sequence[str], series: Mapping[str, list[str]]) -> list[str]:
    """The sites `pattern` names among a run's `names` and its `series`: a name (a series
    by its name, or by its plain name when no site has that name), else the names an
    fnmatch glob matches; a glob ending in `@every` (`layers.*.forward.h@every`) matches
    series too, any other glob (`forward.*`) the line sites only (the same records)."""
    known = set(names)
    if pattern in known:
        return [pattern]
    found = series_read_as(pattern, series, known)
    if found is not None:
        return [found]
    pool = [*names, *series] if pattern.endswith(EVERY) else names
    return [name for name in pool if fnmatch.fnmatchcase(name, pattern)]
