"""The writer thread of a saver made with `background=True`: gathers written off the training
thread, the records it holds bounded.

Example:
    ```python
    thread = BackgroundWriter()
    thread.make_room(nbytes)  # the tracer, before it copies a record of nbytes
    # returns at once; the first batch starts the thread
    thread.submit(batch, saver_write, name="vartrace-writer run.h5", at_exit=saver.close)
    thread.join()  # every batch written; re-raises a job's error
    thread.settle()  # every batch written; the error left for the next call
    thread.stop()
    ```

The thread takes the items of a batch one piece at a time (`one_by_one`) and
lets go of each as soon as it is written, counting its bytes out then: the
records it holds and those the tracer gathers add up to at most the largest
batch handed to it (or `_BACKGROUND_BYTES` if more; at most `limit`, when the
saver sets one), and a caller that would pass that waits.  At most one batch
waits in the queue.  The first exception a job raises is kept; later jobs are
skipped, and `submit`, `join` and `stop` raise it in the caller's thread as
`vartrace.storage.WorkerError` (`settle` waits like `join` and leaves it to them).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from vartrace._support import exit as _exit
from vartrace._support import memory as _memory
from vartrace._support.memory import held_bytes
from vartrace._support.waiting import TICK, finish, join, put
from vartrace.errors import WorkerError
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.storage.site_writer import int64
from vartrace.trace import Trace

__all__ = ["BackgroundWriter", "Handed", "Item", "one_by_one"]

# With background=True, the records the writer thread holds and those the tracer gathers
# add up to at most the largest gather handed to the thread, or this many bytes if more
# (see make_room): a tracer's record, or a gather, waits for the thread until they fit.
_BACKGROUND_BYTES = 64 << 20

# A taken item of a site: records, an alias's target, `reduced`, `placed`.
Item = Trace | str | ReducedFrom | Placement
#: A batch on the writer thread: entered, the pieces of its items, each `(site name, piece)`.
Handed = AbstractContextManager[Iterator[tuple[str, Item]]]

_STOP = object()


class _Worker:
    """One daemon thread running submitted jobs in submission order, at most `depth` queued:
    the caller blocks rather than let memory grow when the thread falls behind."""

    def __init__(self, name: str, depth: int = 1) -> None:
        self._jobs: queue.Queue[Callable[[], None] | object] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._inline = False  # no thread: jobs run in the caller's thread
        try:
            self._thread.start()
        except RuntimeError:  # Python 3.12+ starts no thread at interpreter shutdown
            self._inline = True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                self._one(job)  # type: ignore[arg-type]
            finally:
                self._jobs.task_done()

    def _one(self, job: Callable[[], None]) -> None:
        """Run `job` unless an earlier one failed; keep its exception for the caller."""
        if self._error is None:
            try:
                job()
            except BaseException as exc:  # kept and raised in the caller's thread
                self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise WorkerError(f"a background job failed: {self._error!r}") from self._error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; raise the error of an earlier job instead, if one failed."""
        self._raise()
        if self._inline:
            self._one(job)
            return
        if not self._thread.is_alive():
            raise RuntimeError("the worker is stopped")
        put(self._jobs, job)

    def join(self) -> None:
        """Wait until every submitted job ran; raise the first error of one."""
        finish(self._jobs)
        self._raise()

    def settle(self) -> None:
        """Wait until every submitted job ran (an error stays for `submit`, `join`, `stop`)."""
        finish(self._jobs)

    def stop(self) -> None:
        """Run what is queued, end the thread, and raise the first error of a job."""
        if self._thread.is_alive():
            put(self._jobs, _STOP)
            join(self._thread)
        self._raise()


class BackgroundWriter:
    """A saver's writer thread, started by the first batch, and the bytes of the records
    handed to it that it has not written yet."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._at_exit: Callable[[], None] | None = None  # run at exit while the thread runs
        # Bytes of the records handed to the thread and not yet written; the thread notifies
        # as they go, and sets `_stopped` when a job raised (later jobs are skipped).
        self._handed = 0
        self._largest = 0  # bytes of the largest gather handed to the thread
        self.limit: int | None = None  # at most this many bytes held (RunContext.held_bytes)
        self._written = threading.Condition(threading.Lock())
        self._stopped = False

    def make_room(self, nbytes: int) -> None:
        """Wait until `nbytes` of records fit beside those the thread has not written yet
        (see `H5PYSaverCallback.make_room`)."""
        if not self._handed:
            return
        with self._written:
            self._wait_for_room(nbytes)

    def _wait_for_room(self, nbytes: int) -> None:
        """Wait until the thread holds no records, or `nbytes` more fit beside its
        records (see `make_room`), or a job failed; called holding `_written`."""
        bound = max(self._largest, _BACKGROUND_BYTES)
        if self.limit is not None:
            bound = min(bound, self.limit)
        while self._handed and self._handed + nbytes > bound and not self._stopped:
            self._written.wait(TICK)

    def submit(
        self,
        batch: list[tuple[str, Item]],
        write: Callable[[Handed], None],
        *,
        name: str,
        at_exit: Callable[[], None],
    ) -> None:
        """Hand `batch` (emptied) to the thread, once it fits beside the records the thread
        has not written yet (see `make_room`); the thread calls `write` with it.

        The thread lets go of each site's records (of large records, each record) as
        soon as they are written, and counts them out then.  A tracer that made room
        for its records finds room here; a caller that did not waits here instead.
        A call that starts the thread names it `name`, and has `at_exit` (the saver's
        `close`) run at exit until `stop`.
        """
        if self._worker is None:
            self._worker = _Worker(name)
            self._at_exit = at_exit
            _exit.close_at_exit(at_exit)
        jobs = collections.deque(batch)
        batch.clear()
        sizes = collections.deque(
            held_bytes(item.values) if isinstance(item, Trace) else 0 for _, item in jobs
        )
        nbytes = sum(sizes)
        with self._written:
            self._largest = max(self._largest, nbytes)
            self._wait_for_room(nbytes)  # a job raised: the worker's submit raises its error
            self._handed += nbytes
        self._worker.submit(functools.partial(write, self._handed_over(jobs, sizes)))

    @contextlib.contextmanager
    def _handed_over(
        self, jobs: collections.deque[tuple[str, Item]], sizes: collections.deque[int]
    ) -> Iterator[Iterator[tuple[str, Item]]]:
        """The pieces of a batch's items (see `_pieces`); on leaving, the bytes of those
        left are counted out and they are dropped; an exception also ends the waits for
        room (the thread skips later jobs)."""
        try:
            yield self._pieces(jobs, sizes)
        except BaseException:
            with self._written:
                self._stopped = True
                self._written.notify_all()
            raise
        finally:
            self._written_out(sum(sizes))
            jobs.clear()

    def _pieces(
        self, jobs: collections.deque[tuple[str, Item]], sizes: collections.deque[int]
    ) -> Iterator[tuple[str, Item]]:
        """Each item of `jobs` taken out, one piece at a time (see `one_by_one`): a piece
        is counted out when the next is taken (the taker lets go of it first), an item's
        rest when it is done."""
        while jobs:
            name, item = jobs.popleft()
            held = 0  # bytes of the piece written last, freed by taking the next
            for piece in one_by_one(item) if isinstance(item, Trace) else (item,):
                sizes[0] -= held
                self._written_out(held)  # room for the tracer's next record
                held = held_bytes(piece.values) if isinstance(piece, Trace) else 0
                yield name, piece
                del piece  # the record goes now, not when the job ends
            del item
            self._written_out(sizes.popleft())

    def _written_out(self, nbytes: int) -> None:
        """The thread let go of `nbytes` of the records handed to it."""
        if nbytes:
            with self._written:
                self._handed -= nbytes
                self._written.notify_all()

    def join(self) -> None:
        """Wait until the thread wrote every batch handed to it; raise a job's error."""
        if self._worker is not None:
            self._worker.join()

    def settle(self) -> None:
        """Wait until the thread wrote every batch handed to it; a job's error is raised
        later, by `submit`, `join` or `stop`."""
        if self._worker is not None:
            self._worker.settle()

    def stop(self) -> None:
        """Write what is queued and end the thread (no longer run at exit); raise a job's
        error."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            if self._at_exit is not None:
                _exit.keep_open_at_exit(self._at_exit)
                self._at_exit = None
            worker.stop()


def one_by_one(trace: Trace) -> Iterator[Trace]:
    """`trace` as it is, or, when it holds a list of records of `vartrace._support.memory.MAP_FROM`
    bytes or more, its records one at a time, each taken out of `trace.values` as it is
    handed on: a record written is freed (its pages unmapped) while the next is written."""
    values = trace.values
    if (
        not isinstance(values, list)
        or len(values) < 2
        or trace.shapes is not None
        or held_bytes(values[:1]) < _memory.MAP_FROM
    ):
        yield trace
        return
    iterations, ranks, order = (int64(tag) for tag in (trace.iterations, trace.ranks, trace.order))
    for row in range(len(values)):
        rows = slice(row, row + 1)
        piece = Trace([values[row]], iterations[rows], ranks[rows], order[rows])
        values[row] = None
        yield piece
        del piece
