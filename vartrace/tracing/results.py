"""The records a tracer keeps in memory, accumulated chunk by chunk.

Each gather hands over what the post-gather callbacks left of a chunk;
[`Results`][vartrace.Results] keeps those pieces per site and joins them the first
time a site is read: lists of records are concatenated, stacked tensors
are concatenated along the record dimension (zero-padded to the largest
shape, with `shapes` keeping the true ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vartrace._support.text import missing_site
from vartrace.reduced import ReducedFrom
from vartrace.trace import Trace, join_traces

__all__ = ["Results"]


class Results(Mapping[str, Trace]):
    """Site name -> [`Trace`][vartrace.Trace] of everything kept in memory.

    The names include the aliases of `**` patterns (`aliases`): a name that held a
    tensor another site stored reads as that site's records.

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

    @property
    def stored(self) -> list[str]:
        """The names that hold records of their own (every name but the aliases)."""
        return list(self._pieces)

    def __getitem__(self, name: str) -> Trace:
        pieces = self._pieces.get(self._aliases.get(name, name))
        if pieces is None:
            raise missing_site(name, self, "the tracer's results")
        if len(pieces) > 1:
            pieces[:] = [join_traces(pieces)]
        return pieces[0]

    def __contains__(self, name: object) -> bool:
        """Whether `name` reads as records (without the close matches a KeyError names)."""
        return isinstance(name, str) and self._aliases.get(name, name) in self._pieces

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """`results[name]`, or `default` when there is no such site (no close matches
        looked for)."""
        return self[name] if name in self else default  # noqa: SIM401 (this is get)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._pieces, *(a for a, t in self._aliases.items() if t in self._pieces)])

    def __len__(self) -> int:
        return len(self._pieces) + sum(t in self._pieces for t in self._aliases.values())

    def __repr__(self) -> str:
        return f"<Results sites={len(self)}>"

    def to_frame(self, stat: str | Callable[[Any], Any] = "mean") -> Any:
        """A pandas DataFrame with one row per record and a statistic column.

        The same columns as `vartrace.open(path).to_frame()`: site,
        iteration, rank, order, shape, dtype and `stat` (a name such as
        `"mean"`, `"std"`, `"norm"`, or a callable):

        ```python
        df = tracer.results.to_frame(stat="std")
        df.groupby("site")["std"].max()
        ```
        """
        from vartrace.analysis.sources.frames import results_frame

        return results_frame(self, stat)
