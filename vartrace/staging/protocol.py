"""`Staging`: the one interface between a tracer and the way its records leave the step.

Two implementations: `BlockingStaging` copies each record on the thread that
captures it and delivers it at once (its `flush` and `drain` wait for nothing),
and `Stager` takes records off that thread and delivers them on a thread of its
own.  torch's distributed checkpoint pairs `BlockingAsyncStager` with
`AsyncStager` the same way: the blocking one is the implementation whose
synchronisation is a no-op.  A tracer picks one when it starts and speaks to it
through this protocol only, so the path of a record after admission is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from vartrace.staging.stats import StagingStats

__all__ = ["Staging"]


class Staging(Protocol):
    """Admits records on the capturing thread; delivers them, in capture order, to the
    receiver given when it was made (the tracer's chunk); runs jobs in that order."""

    @property
    def stats(self) -> StagingStats | None:
        """What the staging counted (`tracer.staging_stats`), or `None` if it counts nothing."""

    def admit(self, site: str, value: Any, iteration: int, *, fresh: bool = False) -> None:
        """Take `value`'s record of `site` at `iteration`; `fresh`: `value` is a new tensor
        nothing else holds (a statistics row), that needs no defensive clone."""

    def admit_plain(self, site: str, value: Any, iteration: int) -> None:
        """`admit` of a tensor of type `torch.Tensor` (no subclass) that is no `torch.func`
        wrapper: the tracer's common record, which a staging may take by a shorter path."""

    def flush(self) -> None:
        """Start the records admitted so far towards delivery (the end of an iteration)."""

    def call(self, job: Callable[[], None]) -> None:
        """Run `job` once every record admitted before was delivered (a hand-over)."""

    def drain(self) -> None:
        """Wait until every record admitted was delivered and every job ran."""

    def close(self, last: Callable[[], None] | None = None) -> None:
        """Run `last` (if given) as `call` does, drain, and release what the staging holds."""
