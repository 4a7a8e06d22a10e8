"""`Chunk`: the records since the last gather, and the state that keeping them needs.

Whichever staging a tracer chose delivers every record here (`Chunk.keep`, or
`Chunk.keep_dense` for a plain dense CPU tensor, copied here), in capture order: change detection
against the site's last record (`vartrace.staging.dense.LastRecords`), room made with a
saver writing on a thread of its own, then the record appended to its site's trace
with its order number.  The hand-over takes the traces (`take`), and puts them back
if a callback is interrupted (`put_back`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vartrace._support.memory import held_bytes
from vartrace.staging import StagingStats
from vartrace.staging.blocking import BlockingStaging
from vartrace.staging.dense import LastRecords, plain_copy
from vartrace.staging.protocol import Staging
from vartrace.staging.stager import Stager
from vartrace.trace import Trace, unstacked
from vartrace.tracing.config import TracerConfig

__all__ = ["Chunk", "staging_for"]


class Chunk:
    """The records kept since the last gather, by site.

    Attributes:
        traces: site -> its records since the last gather.
        bytes: the bytes of those records, counted while a saver makes room.
        rank: the rank that tags each record kept.
        stats: the asynchronous stager's counts (records kept, unchanged, the time
            waited for room), or `None` with synchronous staging.

    Records are kept under a lock: threads calling the model at once share the chunk
    with synchronous staging (with asynchronous staging only the stager's thread keeps
    them, and the lock is never contended).
    """

    def __init__(self, *, compare: bool) -> None:
        self.traces: dict[str, Trace] = {}
        self.bytes = 0
        self.rank = 0
        self.stats: StagingStats | None = None
        self._compare = compare
        self._last = LastRecords()
        self._order = 0
        self._room: Sequence[Callable[[int], None]] = ()
        self._lock = threading.Lock()

    def wait_for(self, make_room: Sequence[Callable[[int], None]]) -> None:
        """Make room with these savers (`SaverCallback.make_room`) for each record kept."""
        self._room = make_room

    @property
    def waits(self) -> bool:
        """Whether records wait for a saver to make room for them."""
        return bool(self._room)

    @property
    def kept(self) -> int:
        """The records kept since the start (what change detection let through)."""
        return self._order

    def make_room(self, value: Any) -> int:
        """Wait until each saver writing on a thread of its own has room for a copy of
        `value` beside the chunk (the caller waits while the writer falls behind);
        return the copy's bytes."""
        nbytes = held_bytes([value])
        for make_room in self._room:
            make_room(self.bytes + nbytes)
        return nbytes

    def keep(
        self, site: str, record: Any, iteration: int, host: Any, nbytes: int | None = None
    ) -> None:
        """Append `record` to `site`'s trace, unless `host` (its host copy) equals the
        site's last one; `host` is `None` for a record a stager already compared on the
        device.

        `nbytes`: the bytes room was made for at admission; `None` makes room for
        `record` now (the staging thread waits for the writer, not the step).
        """
        stats = self.stats
        if self._compare and not self._last.differs(site, host):
            if stats is not None:
                stats.unchanged += 1
            return
        if nbytes is None:
            nbytes = self._timed_room(record, stats) if self._room else 0
        self._append(site, record, iteration, nbytes)
        if stats is not None:
            stats.kept += 1

    def keep_dense(self, site: str, value: Any, iteration: int, nbytes: int) -> None:
        """`keep` of a copy of `value`, a plain dense CPU tensor of `nbytes` bytes, made
        where no saver makes room (synchronous staging's common record): compared by its
        bytes before it is copied, and not copied when unchanged (`LastRecords.dense_copy`;
        `plain_copy` without change detection).  What the copy raises (a dtype torch cannot
        copy) reaches the caller."""
        if self._compare:
            record = self._last.dense_copy(site, value, nbytes)
        else:
            record = plain_copy(value, nbytes)
        if record is not None:
            self._append(site, record, iteration, 0)

    def _append(self, site: str, record: Any, iteration: int, nbytes: int) -> None:
        """Append `record` to `site`'s trace with the next order number."""
        lock = self._lock
        lock.acquire()  # (half the instructions of a with statement)
        try:
            order = self._order = self._order + 1
            self.bytes += nbytes
            trace = self.traces.get(site)
            if trace is None:  # the site's first record since the last gather
                self.traces[site] = Trace._first(record, iteration, self.rank, order)
            else:
                trace.values.append(record)  # Trace.append, without its call
                trace.iterations.append(iteration)
                trace.ranks.append(self.rank)
                trace.order.append(order)
        finally:
            lock.release()

    def _timed_room(self, record: Any, stats: StagingStats | None) -> int:
        """`make_room` for `record`, the time waited counted in `stats`."""
        started = time.perf_counter()
        nbytes = self.make_room(record)
        if stats is not None:
            stats.writer_wait_seconds += time.perf_counter() - started
        return nbytes

    def take(self) -> dict[str, Trace]:
        """The traces kept so far; the chunk starts empty."""
        with self._lock:
            traces, self.traces = self.traces, {}
            self.bytes = 0
        return traces

    def put_back(self, traces: dict[str, Trace]) -> None:
        """Return the traces of an interrupted hand-over, before later records.

        A callback may have stacked them before the interrupt: they go back unstacked, so
        that the steps after a caught interrupt append to them as to any chunk.
        """
        with self._lock:
            later, self.traces = self.traces, {}
            for name in dict.fromkeys([*traces, *later]):
                pieces = [t for t in (traces.get(name), later.get(name)) if t is not None]
                self.traces[name] = unstacked(pieces)
            if self._room:
                self.bytes = sum(held_bytes(t.values) for t in self.traces.values())

    def forget(self) -> None:
        """In a forked child: drop the parent's records, and the lock a thread of the
        parent may have held at the fork."""
        self._lock = threading.Lock()
        self.traces = {}


def staging_for(chunk: Chunk, device: Any, config: TracerConfig | None = None) -> Staging:
    """The staging that copies records to `device` and delivers them to `chunk`: the one
    `config.staging` names, or synchronous staging with nothing to wait for (`None`: a
    tracer not started, or in a forked child)."""
    if config is None or config.staging == "sync":
        room = chunk.make_room if config is not None and chunk.waits else None
        return BlockingStaging(
            chunk.keep, device=device, make_room=room, deliver_dense=chunk.keep_dense
        )
    stager = Stager(
        chunk.keep,
        max_inflight_bytes=config.max_inflight_bytes,
        on_full=config.on_full,
        device=device,
        compare=config.change_detection,
        max_device_bytes=config.max_device_bytes,
        host_bytes=config.max_host_bytes,  # the chunk waits in the slots until its gather
    )
    chunk.stats = stager.stats
    return stager
