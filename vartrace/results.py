"""The records a tracer keeps in memory, accumulated chunk by chunk.

Each gather hands over what the post-gather callbacks left of a chunk;
:class:`Results` keeps those pieces per site and joins them the first
time a site is read: lists of records are concatenated, stacked tensors
are concatenated along the record dimension (zero-padded to the largest
shape, with ``shapes`` keeping the true ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from vartrace.callbacks import pad_to
from vartrace.trace import Trace

__all__ = ["Results"]

_TAGS = ("iterations", "ranks", "order")


def _join_tags(pieces: list[Trace], field: str) -> Any:
    parts = [getattr(p, field) for p in pieces]
    if all(not isinstance(p, torch.Tensor) for p in parts):
        return [tag for part in parts for tag in part]
    return torch.cat(
        [torch.as_tensor(list(p) if not isinstance(p, torch.Tensor) else p) for p in parts]
    )


def _join(pieces: list[Trace]) -> Trace:
    joined = Trace(**{field: _join_tags(pieces, field) for field in _TAGS})
    if all(isinstance(p.values, torch.Tensor) for p in pieces):
        shapes = [
            list(p.shapes) if p.shapes is not None else [tuple(p.values.shape[1:])] * len(p)
            for p in pieces
        ]
        ndims = {p.values.dim() for p in pieces}
        if len(ndims) == 1:
            biggest = [max(s) for s in zip(*(p.values.shape[1:] for p in pieces), strict=True)]
            joined.values = torch.cat([pad_to(p.values, [len(p), *biggest]) for p in pieces])
            padded = any(p.shapes is not None for p in pieces) or any(
                tuple(p.values.shape[1:]) != tuple(biggest) for p in pieces
            )
            joined.shapes = [s for part in shapes for s in part] if padded else None
            return joined
    joined.values = [record for p in pieces for record in p.records()]
    return joined


class Results(Mapping[str, Trace]):
    """Site name -> :class:`~vartrace.trace.Trace` of everything kept in memory.

    Example::

        scores = tracer.results["layers.0.attn.forward.scores"]
        scores.values[0].shape, scores.iterations[:3]
    """

    def __init__(self) -> None:
        self._pieces: dict[str, list[Trace]] = {}

    def add(self, name: str, trace: Trace) -> None:
        """Keep the records of one chunk of site ``name``."""
        if len(trace):
            self._pieces.setdefault(name, []).append(trace)

    def __getitem__(self, name: str) -> Trace:
        pieces = self._pieces[name]
        if len(pieces) > 1:
            pieces[:] = [_join(pieces)]
        return pieces[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def __repr__(self) -> str:
        return f"<Results sites={len(self)}>"

    def to_frame(self, stat: str | Callable[[Any], Any] = "mean") -> Any:
        """A pandas DataFrame with one row per record and a statistic column.

        The same columns as ``vartrace.open(path).to_frame()``: site,
        iteration, rank, order, shape, dtype and ``stat`` (a name such as
        ``"mean"``, ``"std"``, ``"norm"``, or a callable)::

            df = tracer.results.to_frame(stat="std")
            df.groupby("site")["std"].max()
        """
        from vartrace.sources import results_frame

        return results_frame(self, stat)
