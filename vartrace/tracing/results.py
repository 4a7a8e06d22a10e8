"""The records a tracer keeps in memory, accumulated chunk by chunk.

Each gather hands over what the post-gather callbacks left of a chunk;
[`Results`][vartrace.Results] keeps those pieces per site and joins them the first
time a site is read: lists of records are concatenated, stacked tensors
are concatenated along the record dimension (zero-padded to the largest
shape, with `shapes` keeping the true ones).  The line sites of an `@every`
variable (`forward.h@every:L27`, ...) also read as one series, `forward.h@every`
(an `EverySeries`: every binding in
execution order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vartrace._support.series import every_series, series_read_as
from vartrace._support.text import missing_site
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.trace import Trace, join_traces

__all__ = ["EverySeries", "Results"]


def _tag_list(tags: Any) -> list[int]:
    return [int(t) for t in (tags.tolist() if hasattr(tags, "tolist") else tags)]


class EverySeries(Trace):
    """Every binding of one `@every` variable, in execution order: a read-only view of its
    line sites' records (`results["forward.h@every"]`).

    `values`, `iterations`, `ranks`, `order` and `shapes` are those of a
    [`Trace`][vartrace.Trace], sorted by (iteration, rank, capture order); `sites` names the
    line site of each record.  Appending or clearing it is refused: the records belong
    to the line sites.

    Example:
        ```python
        h = tracer.results["forward.h@every"]
        h.get(iteration=3)   # the last value h took in iteration 3
        h.sites[:2]          # ['forward.h@every:L27', 'forward.h@every:L28']
        ```
    """

    __slots__ = ("name", "sites")

    def __init__(self, name: str, lines: list[tuple[str, Trace]]) -> None:
        joined = join_traces([trace for _, trace in lines])
        fields = ("iterations", "ranks", "order")
        tags = [_tag_list(getattr(joined, field)) for field in fields]
        keys = list(zip(*tags, strict=True))
        perm = sorted(range(len(keys)), key=keys.__getitem__)

        def ordered(found: Any) -> Any:
            """`found` (a list, or a tensor / array along records) in execution order."""
            return [found[i] for i in perm] if isinstance(found, list) else found[perm]

        iterations, ranks, order = (ordered(getattr(joined, field)) for field in fields)
        shapes = None if joined.shapes is None else ordered(list(joined.shapes))
        super().__init__(ordered(joined.values), iterations, ranks, order, shapes)
        self.name = name
        sites = [site for site, trace in lines for _ in range(len(trace))]
        self.sites = [sites[i] for i in perm]

    def __repr__(self) -> str:
        return f"<EverySeries {self.name!r} records={len(self)} lines={len(set(self.sites))}>"

    def append(self, value: Any, iteration: int, rank: int, order: int) -> None:
        """Refused: a series is a view of its line sites' records."""
        raise TypeError(f"{self.name!r} is a read-only view of its line sites' records")

    def clear(self) -> None:
        """Refused: a series is a view of its line sites' records."""
        raise TypeError(f"{self.name!r} is a read-only view of its line sites' records")

    def _rows(self, rank: int) -> list[int]:
        ranks = _tag_list(self.ranks)
        return [index for index, found in enumerate(ranks) if found == rank]

    def get(self, iteration: int, rank: int = 0) -> Any:
        """The value the variable held at `iteration` on `rank`: the last record at or
        before it (as [`Site.get`][vartrace.Site.get]); `KeyError` when there is none."""
        iterations = _tag_list(self.iterations)
        rows = [row for row in self._rows(rank) if iterations[row] <= iteration]
        if not rows:
            raise KeyError(
                f"series {self.name!r} has no record at or before iteration {iteration} "
                f"on rank {rank}"
            )
        return self.records()[rows[-1]]

    def calls(self, iteration: int, rank: int = 0) -> list[Any]:
        """Every value bound in `iteration` on `rank`, in execution order (a list)."""
        iterations = _tag_list(self.iterations)
        records = self.records()
        return [records[row] for row in self._rows(rank) if iterations[row] == iteration]

    def to_frame(self, stat: str | Callable[[Any], Any] = "mean") -> Any:
        """A pandas DataFrame of the series, one row per record (`Results.to_frame`'s
        columns, `site` the series name)."""
        from vartrace.analysis.sources.frames import results_frame

        return results_frame({self.name: self}, stat)


class Results(Mapping[str, Trace]):
    """Site name -> [`Trace`][vartrace.Trace] of everything kept in memory.

    The names include the aliases of `**` patterns (`aliases`): a name that held a
    tensor another site stored reads as that site's records.  An `@every` variable's
    values are keys of their line sites (`forward.h@every:L27`, ...), and its series
    reads them all (`series`, not among the keys: each record is listed once):
    `results["forward.h@every"]` is an `EverySeries` of every value `h` took, and the
    plain `results["forward.h"]` reads the same when `h` was recorded only `@every`;
    `in` knows both.

    Example:
        ```python
        scores = tracer.results["layers.0.attn.forward.scores"]
        scores.values[0].shape, scores.iterations[:3]
        ```
    """

    def __init__(self) -> None:
        self._pieces: dict[str, list[Trace]] = {}
        self._aliases: dict[str, str] = {}
        self._reductions: dict[str, ReducedFrom] = {}
        self._placements: dict[str, Placement] = {}

    def add(self, name: str, trace: Trace) -> None:
        """Keep the records of one chunk of site `name` (an alias of that name ends)."""
        if len(trace):
            self._aliases.pop(name, None)
            self._pieces.setdefault(name, []).append(trace)

    def alias(self, name: str, target: str) -> None:
        """Make `name` read as site `target` (the records stored once, under `target`)."""
        if name not in self._pieces:
            self._aliases[name] = target

    @property
    def aliases(self) -> dict[str, str]:
        """Alias -> the site whose records it reads as."""
        return dict(self._aliases)

    def reduced(self, name: str, origin: ReducedFrom) -> None:
        """Note what a pre-save callback made site `name`'s records from (its values'
        dtype and shape: `reductions`)."""
        self._reductions[name] = origin

    @property
    def reductions(self) -> dict[str, ReducedFrom]:
        """Site -> the dtype and shape of the values its records were made from, for the
        sites whose values a pre-save callback replaced (statistics mode's rows).

        Example:
            ```python
            tracer.results.reductions["blocks.0.forward"]   # ReducedFrom('bfloat16', (8, -1, 768))
            ```
        """
        return {name: self._reductions[name] for name in self._pieces if name in self._reductions}

    def placed(self, name: str, placement: Placement) -> None:
        """Note that site `name` recorded a DTensor's local shards, placed as `placement`
        (`placements`; `vartrace.assemble` joins them)."""
        self._placements[name] = placement

    @property
    def placements(self) -> dict[str, Placement]:
        """Site -> the [`Placement`][vartrace.Placement] of the DTensor whose local shards
        its records are (each rank's); `results[name].placement` is the same.

        Example:
            ```python
            tracer.results.placements["a.weight"].placements   # ('Shard(dim=0)',)
            vartrace.assemble(tracer.results["a.weight"], 3)    # the whole weight
            ```
        """
        return {name: self._placements[name] for name in self._pieces if name in self._placements}

    @property
    def stored(self) -> list[str]:
        """The names that hold records of their own (every name but the aliases)."""
        return list(self._pieces)

    @property
    def series(self) -> dict[str, list[str]]:
        """`@every` series -> its line sites (`{"forward.h@every": ["forward.h@every:L27",
        ...]}`): `results[series]` reads them as one."""
        return every_series(self._names())

    def _names(self) -> list[str]:
        """The stored names and the aliases that read as one."""
        return [*self._pieces, *(a for a, t in self._aliases.items() if t in self._pieces)]

    def _known(self, name: object) -> bool:
        return isinstance(name, str) and self._aliases.get(name, name) in self._pieces

    def __getitem__(self, name: str) -> Trace:
        pieces = self._pieces.get(self._aliases.get(name, name))
        if pieces is None:
            groups = self.series
            series = series_read_as(name, groups, set(self._names()))
            if series is None:
                raise missing_site(name, [*groups, *self], "the tracer's results")
            found = EverySeries(series, [(line, self[line]) for line in groups[series]])
            placed = (self._placements.get(line) for line in groups[series])
            found.placement = next((p for p in placed if p is not None), None)
            return found
        if len(pieces) > 1:
            pieces[:] = [join_traces(pieces)]
        pieces[0].placement = self._placements.get(self._aliases.get(name, name))
        return pieces[0]

    def __contains__(self, name: object) -> bool:
        """Whether `name` reads as records (without the close matches a KeyError names)."""
        return self._known(name) or (
            series_read_as(name, self.series, set(self._names())) is not None
        )

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """`results[name]`, or `default` when there is no such site (no close matches
        looked for)."""
        return self[name] if name in self else default  # noqa: SIM401 (this is get)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"<Results sites={len(self)}>"

    def to_frame(self, stat: str | Callable[[Any], Any] = "mean") -> Any:
        """A pandas DataFrame with one row per record and a statistic column.

        The same columns as `vartrace.open(path).to_frame()`: site,
        iteration, rank, order, shape, dtype and `stat` (a name such as
        `"mean"`, `"std"`, `"norm"`, or a callable).  An `@every` value is a row of
        its line site (`results["forward.h@every"].to_frame()` gives the series):

        ```python
        df = tracer.results.to_frame(stat="std")
        df.groupby("site")["std"].max()
        ```
        """
        from vartrace.analysis.sources.frames import results_frame

        return results_frame(self, stat)
