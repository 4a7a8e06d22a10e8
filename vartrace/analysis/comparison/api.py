"""`vartrace.compare`: the two runs opened as sources, their sites matched, the records
compared in process (`engine`) or as Dask tasks over their files (`on_dask`), the report
assembled (`rows`).

Example:
    ```python
    report = compare("reference.h5", "candidate.h5", atol=1e-6, scheduler="threads")
    ```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vartrace.analysis.comparison.engine import compare_views
from vartrace.analysis.comparison.lines import pair_sites
from vartrace.analysis.comparison.report import Comparison
from vartrace.analysis.comparison.rows import SiteRows, assemble
from vartrace.analysis.sources import Source, open_source

__all__ = ["compare"]


def _select(source: Source, patterns: Sequence[str] | None) -> list[str]:
    """The names of `source` that `patterns` pick (`Source.pick`: an `@every` series only
    when named, since its records are its line sites', compared under their own names)."""
    if patterns is None:
        return list(source.names)
    chosen = {name for pattern in patterns for name in source.pick(pattern)}
    return [name for name in [*source.names, *source.series] if name in chosen]


def _stored(a: Source, b: Source, common: list[str]) -> list[str]:
    """`common` less the aliases that read as the same compared site in both runs: the
    records are compared once, under the name that stored them."""
    compared = set(common)
    return [
        name
        for name in common
        if not (a.aliases.get(name) in compared and a.aliases.get(name) == b.aliases.get(name))
    ]


def compare(
    a: Any,
    b: Any,
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    names: str | Iterable[str] | None = None,
    progress: bool = False,
    labels: tuple[str, str] | None = None,
    scheduler: Any = None,
) -> Comparison:
    """Compare two runs record by record.

    `a` and `b` are each a path or glob of an HDF5 run, an open run
    ([`vartrace.open`][vartrace.open]), a [`ModelTracer`][vartrace.ModelTracer] (its
    `results`) or a mapping of site name -> [`Trace`][vartrace.Trace].
    Records are matched by site, iteration, rank and occurrence within that
    iteration and rank; the `@every` line sites of one variable
    (`forward.h@every:L27`) are paired by their rank in its binding order, so
    that lines moved by an edit are compared as the same statements and said so in
    `notes` (when the runs bind it on different numbers of lines, its line sites
    are listed as present in one run only); `b` is the reference of the relative tolerance,
    as in `numpy.isclose`.  `names` restricts the comparison to
    these site names or glob patterns.  Sites present in one run only are
    listed in `only_in_a` / `only_in_b` and do not make the comparison
    fail; a record present on one side only does.  `progress` shows a tqdm
    bar on stderr for long comparisons; `labels` names the two runs in the
    report (default: their paths).

    `scheduler` runs the comparison on Dask (`pip install 'torch-vartrace[dask]'`):
    `"threads"`, `"processes"`, a `distributed.Client` or a scheduler's address
    (`"tcp://host:8786"`), one task per pair of shards (per ~256 MB of them),
    each opening its files by path; the report is the one computed in process
    (`None`, the default), row for row.  See the "Big runs" how-to.

    Example:
        ```python
        report = vartrace.compare("fp64.h5", tracer, atol=1e-5, rtol=1e-3)
        print(report)
        assert report.ok, report.first_divergence
        ```
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
    patterns = [names] if isinstance(names, str) else (None if names is None else list(names))
    with open_source(a) as source_a, open_source(b) as source_b:
        names_a = _select(source_a, patterns)
        names_b = _select(source_b, patterns)
        if patterns is not None and not names_a and not names_b:
            raise ValueError(f"no site matches {', '.join(map(repr, patterns))} in either run")
        pairs = pair_sites(names_a, names_b)
        common = _stored(source_a, source_b, pairs.common)
        results: list[SiteRows] | None = None
        if scheduler is not None:
            from vartrace.analysis.comparison.on_dask import compare_on

            results = compare_on(scheduler, source_a, source_b, common, atol, rtol, progress)
        named = [] if results is not None else [(n, n) for n in common]
        named += pairs.moved.items()
        views = ((a, source_a.site(a), source_b.site(b)) for a, b in named)
        count = len(named)
        found = list(compare_views(views, atol, rtol, count=count, progress=progress))
        results = [*(results or []), *found]
    labels = labels or (source_a.label, source_b.label)
    comparison = assemble(results, pairs.only_a, pairs.only_b, atol, rtol, labels)
    comparison.moved_lines, comparison.notes = dict(pairs.moved), pairs.notes
    return comparison
