"""Gathering buffered chunks across ``torch.distributed`` ranks.

The tracer hands each rank's chunk (site name -> :class:`~vartrace.trace.Trace`)
to :func:`gather_chunk` every ``gathering_interval`` iterations.  Without an
initialised process group this is a local hand-over.
"""

from __future__ import annotations

import torch.distributed as dist

from vartrace.trace import Trace

__all__ = ["gather_chunk", "rank", "world_size"]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without an initialised process group."""
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """The number of ranks, 1 without an initialised process group."""
    return dist.get_world_size() if _active() else 1


def gather_chunk(chunk: dict[str, Trace]) -> dict[str, Trace] | None:
    """Gather every rank's chunk to rank 0.

    Returns the merged chunk on rank 0 and ``None`` on the other ranks.
    """
    if not _active() or dist.get_world_size() == 1:
        return chunk
    raise NotImplementedError("multi-rank gathering lands with the distributed issue")
