"""A run in any form (file, glob of shards, open run, tracer, results) as one `Source`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from vartrace._support.series import picked, series_read_as
from vartrace.analysis.sources.chunk_maps import FileMaps
from vartrace.analysis.sources.views import FileSiteView, MemorySiteView, SiteView

__all__ = ["Source", "open_source"]


class Source:
    """A run in any form: its site names and a `SiteView` per site.

    `aliases` maps the names a `**` pattern stored once to the site each reads
    as (see `vartrace.tracing.aliases`); `series` maps each `@every` series
    (`forward.h@every`) to its line sites among `names`: `site` reads one by its name, or
    by its plain name (`forward.h`) when no site has that name.

    A source opened from a path closes its file on `close` (or when
    used as a context manager); one wrapping an object the caller opened
    leaves it open.  `run` is the open run of a source read from files
    (`None` for records in memory).

    Example:
        ```python
        with open_source("run.h5") as run:
            for name in run.names:
                print(name, len(run.site(name).iterations))
        ```
    """

    def __init__(
        self,
        names: Sequence[str],
        view: Callable[[str], SiteView],
        label: str,
        close: Callable[[], None] | None = None,
        aliases: Mapping[str, str] | None = None,
        run: Any = None,
        series: Mapping[str, list[str]] | None = None,
    ) -> None:
        self.names = list(names)
        self.run = run
        self.label = label
        self.aliases = dict(aliases or {})
        self._view = view
        self._close = close
        self._known = set(self.names)
        self.series = dict(series or {})

    def named(self, name: str) -> str | None:
        """The site `name` reads as: itself, an `@every` series (by its name, or its plain
        name), or `None` when there is no such site."""
        if name in self._known:
            return name
        return series_read_as(name, self.series, self._known)

    def pick(self, pattern: str) -> list[str]:
        """The sites a name or glob `pattern` names (see `vartrace._support.series.picked`)."""
        return picked(pattern, self.names, self.series)

    def site(self, name: str) -> SiteView:
        """The view of site `name`; `KeyError` naming the run when it has no such site."""
        found = self.named(name)
        if found is None:
            raise KeyError(f"{self.label} has no site {name!r}")
        return self._view(found)

    def close(self) -> None:
        """Close the file this source opened (no-op otherwise)."""
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def open_source(source: Any, *, allow_pickle: bool = False) -> Source:
    """Wrap a path/glob, an open run, a ModelTracer or a mapping name -> Trace as a `Source`.

    Example:
        ```python
        with open_source(tracer) as run:
            view = run.site("forward")
        ```
    """
    if isinstance(source, Source):
        return Source(
            source.names,
            source.site,
            source.label,
            aliases=source.aliases,
            run=source.run,
            series=source.series,
        )
    if isinstance(source, (str, os.PathLike)):
        from vartrace.storage.reader import open_run

        run = open_run(source, allow_pickle=allow_pickle)
        maps = FileMaps()
        return Source(
            run.names,
            lambda n: FileSiteView(n, run[n], maps),
            os.fspath(source),
            run.close,
            run.aliases,
            run,
            run.series,
        )
    if hasattr(type(source), "names") and hasattr(type(source), "meta"):  # reads neither
        paths = [os.fspath(p) for p in getattr(source, "paths", [])] or ["run"]
        label = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} shards)"
        maps = FileMaps()
        return Source(
            source.names,
            lambda n: FileSiteView(n, source[n], maps),
            label,
            aliases=getattr(source, "aliases", None),
            run=source,
            series=getattr(source, "series", None),
        )
    results = getattr(source, "results", source)
    if isinstance(results, Mapping):
        label = "tracer results" if results is not source else "results"
        aliases = dict(getattr(results, "aliases", None) or {})
        reductions = getattr(results, "reductions", {})
        return Source(
            list(results),
            lambda n: MemorySiteView(n, results[n], reductions.get(aliases.get(n, n))),
            label,
            aliases=aliases,
            series=getattr(results, "series", None),
        )
    raise TypeError(
        "expected a path, an open run, a ModelTracer or a mapping of site name -> Trace, "
        f"not {type(source).__name__}"
    )
