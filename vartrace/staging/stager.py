"""Asynchronous staging: records of accelerator tensors reach the host with no sync in the step.

On a GPU, a blocking `.cpu()` per record drains the launch queue: the CPU
can no longer run ahead of the device, and a Python-heavy step becomes CPU
time plus GPU time.  A `Stager` takes every record off the capturing
thread instead, and costs that thread one clone per record:

1. **Admission** (the capturing thread: the training thread, or autograd's
   device thread for `@grad`) counts the record's bytes against
   `max_inflight_bytes`, clones the tensor on the device, on the producer's
   current stream, and appends it to the open batch: no event, no lock, no
   wake-up.  Values that are not accelerator tensors (CPU tensors, Python
   scalars, markers) are copied at once and join the batch too, so that
   records keep capture order.
2. **Flush** (any thread, at the end of each iteration, at the end of a
   backward pass, every `FLUSH_BYTES` or `FLUSH_RECORDS`, and
   before a job): one event per producer stream after the batch's clones,
   and one hand-off to the staging thread.
3. **Copy** (one `vartrace-staging-N` thread per tracer): a side stream
   waits for those events, compares each clone with the site's previous one
   on the device (bit for bit, into one flag per record: no host pass over
   unchanged records; the previous clones held within `max_device_bytes`, a
   site past it compared on the host at delivery instead, its host copy with
   its previous one, bit for bit too), copies the clones into slots of a `HostRing`
   (pinned memory allocated once and reused: no copy-out, no allocation per
   record), and records one event.
4. **Delivery** (the same thread, in admission order): once that event has
   completed (a blocking wait that releases the GIL, or polls where a user's
   `torch.cuda.set_sync_debug_mode` watches for syncs), the changed records
   go to `deliver(site, record, iteration, host)` -- the tracer's chunk --
   as views of their slots; a slot returns to the ring when its last view
   dies (after the saver wrote it).  Jobs queued with `Stager.call`
   (the tracer's gathers) run in the same order, after every record admitted
   before them.

The staging thread runs no torch CPU kernel on records (views and
device-to-host `copy_` only) and uses one OpenMP thread of its own, so it
never wakes a team of spinning workers on the training thread's cores.

Memory in flight (records between admission and delivery) is bounded by
bytes at admission: when a record would exceed the bound the capturing thread
waits for earlier records to land (`on_full="wait"`, counted, warned once),
or the record is dropped (`on_full="drop"`, counted per site) and a
[`Unstored`][vartrace.Unstored] marker takes its place, so that "the last record
at or before step k" is never silently stale.  `deliver` may block (the tracer's
does while a background saver's writer falls behind): delivery pauses, records in
flight pile up to the bound, and only then does the capturing thread wait or drop.

A stream that is capturing a CUDA graph skips the record with one warning: a
replay of the graph runs no Python, so there would be nothing to record.

Example:
    ```python
    stager = Stager(lambda site, record, iteration, host: print(site, record))
    stager.admit("forward.x", torch.ones(3, device="cuda"), iteration=1)
    stager.call(lambda: print("every record admitted so far was delivered"))
    stager.close()
    ```
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import torch

from vartrace._support.waiting import TICK, join
from vartrace._support.warnings import warn
from vartrace.markers import Unstored
from vartrace.staging.device import stageable, stream_module
from vartrace.staging.items import Batch, Job, Ready, Staged, bit_view, same_bytes
from vartrace.staging.ring import HostRing
from vartrace.staging.stats import StagingStats
from vartrace.staging.threads import one_openmp_thread
from vartrace.tensors import copy_leaf, failed_copy, refused_copy

__all__ = ["FLUSH_BYTES", "FLUSH_RECORDS", "OnFull", "Stager", "check_device_bytes"]

OnFull = Literal["wait", "drop"]
Deliver = Callable[[str, Any, int, Any], None]
"""`deliver(site, record, iteration, host)`: a changed record, in admission order.

The record lives on the stager's `device`.  `host` is the record's host
copy for the receiver's own change detection (values copied at admission), or
`None` when the stager already compared it with the site's last record.
"""

FLUSH_BYTES = 64 << 20
"""Bytes admitted after which the open batch is flushed, so copies start during a long step."""
FLUSH_RECORDS = 256
"""Records admitted after which the open batch is flushed."""

_CPU = torch.device("cpu")
_POLL_FIRST, _POLL_MAX = 2e-5, 1e-3  # seconds between event polls: doubling, capped
_DEVICE_BYTES_CAP = 2 << 30  # the default max_device_bytes: a twentieth of the memory, at most
_DEVICE_BYTES_UNKNOWN = 1 << 30  # ... this where torch cannot tell the device's memory
_names = itertools.count(1)
_graph_task_id = torch._C._current_graph_task_id  # -1 outside autograd's backward


def _default_device_bytes(device: torch.device) -> int:
    """`max_device_bytes` by default: a twentieth of `device`'s memory, at most 2 GiB; 1 GiB
    where torch cannot tell the memory (a device module with no `get_device_properties`)."""
    try:
        total = torch.get_device_module(device.type).get_device_properties(device).total_memory
    except Exception:  # no such query for this device type, or one that fails: a fixed default
        return _DEVICE_BYTES_UNKNOWN
    return min(_DEVICE_BYTES_CAP, int(total) // 20)


# Under torch's CUDA sanitizer, event polls look like unsynchronised reads: wait instead.
_SANITIZED = bool(os.environ.get("TORCH_CUDA_SANITIZER"))


def check_device_bytes(max_device_bytes: Any) -> int | None:
    """`max_device_bytes` if it is `None` or a byte count (an int >= 0), else `ValueError`."""
    if max_device_bytes is not None and (
        not isinstance(max_device_bytes, int)
        or isinstance(max_device_bytes, bool)
        or max_device_bytes < 0
    ):
        raise ValueError(
            f"max_device_bytes must be None or an integer >= 0, not {max_device_bytes!r}"
        )
    return max_device_bytes


class Stager:
    """Admits records on any thread and delivers them, in order, on a thread of its own.

    Args:
        deliver: `deliver(site, record, iteration, host)`, called on the
            staging thread for each changed record, in admission order (see `Deliver`).
        max_inflight_bytes: the most bytes of records between admission and
            delivery; a record larger than that alone is admitted when
            nothing else is in flight.
        on_full: `"wait"` (the admitting thread waits) or `"drop"` (the
            record becomes a marker) when the bound would be exceeded.
        device: where delivered records live: the host (the default), or a
            device, where the record is the clone itself (then nothing is copied
            to the host at all).
        compare: leave out a staged record equal, bit for bit, to the site's
            previous one (compared on the device, or past `max_device_bytes` on the host).
        max_device_bytes: the most bytes of previous records that change detection holds
            on the devices, all together.  Sites take them first come, first served; a
            site whose record does not fit is compared on the host instead (its host
            copy with its previous host copy, bit for bit: the same records are kept),
            at the cost of a host pass on the staging thread and of that previous host
            copy.  `0`: every site is compared on the host.  Default: a twentieth of
            the memory of the first staged record's device, at most 2 GiB (1 GiB where
            torch cannot tell the memory).
        host_bytes: the most bytes of host memory the ring of host slots allocates
            (default: twice `max_inflight_bytes`).
        name: the thread's name.
    """

    def __init__(
        self,
        deliver: Deliver,
        *,
        max_inflight_bytes: int = 1 << 30,
        on_full: OnFull = "wait",
        device: torch.device = _CPU,
        compare: bool = True,
        max_device_bytes: int | None = None,
        host_bytes: int | None = None,
        name: str | None = None,
    ) -> None:
        if on_full not in ("wait", "drop"):
            raise ValueError(f"on_full must be 'wait' or 'drop', not {on_full!r}")
        if not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 1:
            raise ValueError(
                f"max_inflight_bytes must be a positive integer, not {max_inflight_bytes!r}"
            )
        check_device_bytes(max_device_bytes)
        self.stats = StagingStats()
        self.device = device
        self.max_device_bytes = max_device_bytes  # the default set at the first staged record
        self.ring = HostRing(2 * max_inflight_bytes if host_bytes is None else host_bytes)
        self._deliver = deliver
        self._bound = max_inflight_bytes
        self._on_full = on_full
        self._compare = compare
        self._cv = threading.Condition()
        self._queue: collections.deque[Batch | Job] = collections.deque()
        self._open: collections.deque[Ready | Staged] = collections.deque()
        self._open_bytes = 0  # admitted into the open batch (approximate across threads)
        self._flush_lock = threading.Lock()  # batches reach the queue in admission order
        self._unfinished = 0
        # Bytes in flight = sum of each admitting thread's count - bytes delivered: each
        # counter has one writer, so admission takes no lock.
        self._admitted: list[list[int]] = []
        self._local = threading.local()
        self._delivered = 0
        self._waiting = 0
        self._task = -1  # the backward pass whose end flushes the open batch
        self._closing = False
        self._errors: collections.deque[BaseException] = collections.deque()  # not yet raised
        self._streams: dict[torch.device, Any] = {}
        # Change detection (the staging thread): site -> its last clone on the device; the
        # sites compared on the host, as `_issue` sees them; site -> its last host copy
        # kept, as `_finish` sees them (after the earlier batches' deliveries).
        self._prev: dict[str, torch.Tensor] = {}
        self._on_host: set[str] = set()
        self._host_prev: dict[str, torch.Tensor] = {}
        self._warned_wait = False
        self._warned_capture = False
        self._warned_overflow = False
        self._thread = threading.Thread(
            target=self._run, name=name or f"vartrace-staging-{next(_names)}", daemon=True
        )
        self._thread.start()

    # -- any capturing thread -------------------------------------------------------------

    def admit(self, site: str, value: Any, iteration: int, *, fresh: bool = False) -> None:
        """Queue `value`'s record: a device clone for an accelerator tensor, else a copy.

        `fresh`: `value` is a new tensor that nothing else holds or writes (a
        statistics row), taken as it is, without a clone.  Never raises a failure of the
        staging thread (that is for `call`, `drain` and `close`,
        outside the traced code).
        """
        stats = self.stats
        if not stageable(value):
            host = copy_leaf(value, _CPU, site)
            record = host if self.device == _CPU else copy_leaf(value, self.device, site)
            nbytes = host.nbytes if isinstance(host, torch.Tensor) else 0
            if not self._reserve(site, nbytes):
                record = host = self._dropped(nbytes)
                nbytes = 0
            self._append(Ready(site, record, iteration, host, nbytes))
            return
        module = stream_module(value.device)
        assert module is not None
        capturing = getattr(module, "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            self._skip_capturing(site)
            return
        marker = refused_copy(value, site)  # an expanded view of gigabytes
        if marker is not None:
            self._append(Ready(site, marker, iteration, marker, 0))
            return
        nbytes = value.nbytes
        if not self._reserve(site, nbytes):
            marker = self._dropped(nbytes)
            self._append(Ready(site, marker, iteration, marker, 0))
            return
        try:
            if fresh and value.is_contiguous() and not value.requires_grad:
                clone = value
            else:
                clone = value.detach().resolve_conj().resolve_neg()
                clone = clone.clone(memory_format=torch.contiguous_format)
        except Exception as error:  # no device memory, a dtype torch cannot copy: a marker
            self._local.admitted[0] -= nbytes
            marker = failed_copy(value, site, error)
            self._append(Ready(site, marker, iteration, marker, 0))
            return
        stats.staged += 1
        self._append(Staged(site, iteration, clone, module.current_stream(value.device), module))
        task = _graph_task_id()
        if task != -1 and task != self._task:  # a @grad record: flush when backward ends
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    admit_plain = admit  # (the protocol's short path: a plain tensor takes admit's own)

    def flush(self) -> None:
        """Hand the open batch to the staging thread: one event per producer stream."""
        self._hand_off(None)

    def call(self, job: Callable[[], None]) -> None:
        """Run `job` on the staging thread once every record admitted before is delivered.

        Raises a failure of the staging thread that was not raised before.
        """
        self._raise()
        self._hand_off(Job(job))

    def drain(self) -> None:
        """Wait until everything admitted was delivered and every job ran; raise a failure.

        From the staging thread itself (a callback reading results) it returns at once.
        """
        if threading.current_thread() is not self._thread:
            self.flush()
            with self._cv:
                while self._unfinished and self._thread.is_alive():
                    self._cv.wait(TICK)
        self._raise()

    def close(self, last: Callable[[], None] | None = None) -> None:
        """Run `last` (if given) as `call` would, drain, and end the staging thread.

        Raises the oldest failure of the thread not raised before (by `call`
        or `drain`); any later ones are warnings: every failure reaches the
        caller once.
        """
        try:
            if last is not None:
                self._hand_off(Job(last))
            self.drain()
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            if threading.current_thread() is not self._thread:
                join(self._thread)
            for error in self._errors:  # after the one raised: said, not lost
                warn(
                    f"vartrace: the staging thread also failed with "
                    f"{type(error).__name__}: {error}",
                    RuntimeWarning,
                )
            self._errors.clear()

    @property
    def inflight(self) -> int:
        """Bytes admitted and not yet delivered."""
        return sum(counter[0] for counter in self._admitted) - self._delivered

    def _raise(self) -> None:
        """Raise the staging thread's oldest failure not raised yet."""
        if self._errors:
            raise self._errors.popleft()

    def _append(self, item: Ready | Staged) -> None:
        self.stats.admitted += 1
        self._open.append(item)
        self._open_bytes += item.nbytes
        if self._open_bytes >= FLUSH_BYTES or len(self._open) >= FLUSH_RECORDS:
            self.flush()

    def _hand_off(self, job: Job | None) -> None:
        """One hand-off: the open batch (if any), with an event after its clones on each
        producer stream, then `job` (if any).  Batches reach the queue in admission order."""
        with self._flush_lock:
            items: list[Ready | Staged] = []
            pop = self._open.popleft
            while True:
                try:
                    items.append(pop())
                except IndexError:
                    break
            self._open_bytes = 0
            entries: list[Batch | Job] = []
            if items:
                ready: dict[Any, Any] = {}
                for item in items:
                    if isinstance(item, Staged) and item.stream not in ready:
                        event = item.module.Event()
                        event.record(item.stream)
                        ready[item.stream] = event
                entries.append(Batch(items, ready))
            if job is not None:
                entries.append(job)
            if not entries:
                return
            with self._cv:
                stats = self.stats
                stats.handoffs += 1
                stats.flushes += bool(items)
                self._queue.extend(entries)
                self._unfinished += len(entries)
                self._cv.notify_all()

    def _reserve(self, site: str, nbytes: int) -> bool:
        """Count `nbytes` in flight, waiting or refusing (`False`) when over the bound."""
        counter = getattr(self._local, "admitted", None)
        if counter is None:
            counter = self._local.admitted = [0]
            with self._cv:
                self._admitted.append(counter)
        inflight = self.inflight
        if inflight and inflight + nbytes > self._bound:
            if self._on_full == "drop":
                stats = self.stats
                stats.dropped += 1
                stats.dropped_by_site[site] = stats.dropped_by_site.get(site, 0) + 1
                return False
            self._wait_for_room(nbytes)
            inflight = self.inflight
        counter[0] += nbytes
        inflight += nbytes
        if inflight > self.stats.max_inflight_bytes:
            self.stats.max_inflight_bytes = inflight
        return True

    def _wait_for_room(self, nbytes: int) -> None:
        stats = self.stats
        started = time.perf_counter()
        stats.waits += 1
        self._warn_wait(nbytes)
        self.flush()  # what this thread admitted must land for room to come
        with self._cv:
            self._waiting += 1
            try:
                while (inflight := self.inflight) and inflight + nbytes > self._bound:
                    if not self._thread.is_alive():
                        break
                    self._cv.wait(TICK)
            finally:
                self._waiting -= 1
        stats.wait_seconds += time.perf_counter() - started

    def _dropped(self, nbytes: int) -> Unstored:
        return Unstored(
            f"dropped: {nbytes} bytes would exceed max_inflight_bytes={self._bound} "
            "(on_full='drop')"
        )

    def _warn_wait(self, nbytes: int) -> None:
        if not self._warned_wait:
            self._warned_wait = True
            warn(
                f"vartrace: the step waited for records in flight to reach the host "
                f"({self.inflight} bytes in flight, {nbytes} more, max_inflight_bytes="
                f"{self._bound}); waits are counted in tracer.staging_stats.  Raise "
                "max_inflight_bytes, record less, or pass on_full='drop'",
                RuntimeWarning,
            )

    def _warn_overflow(self, site: str) -> None:
        self._warned_overflow = True
        warn(
            f"vartrace: the ring of host memory for records is full ({self.ring.capacity} "
            f"bytes, the tracer's max_host_bytes): {site!r}, and any later record that finds "
            "no slot, gets memory of its own, which a GPU copies into at the pageable rate "
            "while the staging thread waits (counted in tracer.staging_stats.overflows).  "
            "The records of a gathering interval stay in the ring until the gather, and with "
            "no saver until the results go: raise max_host_bytes, gather more often, or "
            "record less",
            RuntimeWarning,
        )

    def _skip_capturing(self, site: str) -> None:
        self.stats.skipped_capturing += 1
        if not self._warned_capture:
            self._warned_capture = True
            warn(
                f"vartrace: not recording {site} (and later records) while a stream captures "
                "a graph: a replay of the graph runs no Python; record outside the capture",
                RuntimeWarning,
            )

    # -- the staging thread -----------------------------------------------------------------

    def _run(self) -> None:
        one_openmp_thread()
        pending: collections.deque[Batch | Job] = collections.deque()
        issued = 0  # pending[:issued] have their device work started
        stats = self.stats
        while True:
            with self._cv:
                while not self._queue and not pending:
                    if self._closing:
                        self._prev.clear()
                        self._on_host.clear()
                        self._host_prev.clear()  # their slots go back to the ring
                        stats.device_compare_bytes = 0
                        return
                    self._cv.wait()
                    stats.wakeups += 1
                pending.extend(self._queue)
                self._queue.clear()
            while issued < len(pending):
                head = pending[issued]
                if isinstance(head, Batch):
                    head.failed = not self._attempt(self._issue, head)
                issued += 1
            head = pending.popleft()
            issued -= 1
            if isinstance(head, Batch):
                # A batch whose copies did not all start, or did not land, delivers nothing.
                if not head.failed and self._attempt(self._wait, head):
                    self._attempt(self._finish, head)
                self._release(head)
            else:
                self._attempt(head.job)
            with self._cv:
                self._unfinished -= 1
                self._cv.notify_all()

    def _attempt(self, step: Callable[..., Any], *args: Any) -> bool:
        """`step(*args)`, and whether it succeeded; its exception is kept for
        `call`, `drain` or `close` to raise, once, and the staging
        thread goes on with what comes after (as a failed gather does without staging)."""
        try:
            step(*args)
        except BaseException as error:
            with self._cv:
                self._errors.append(error)
                self._cv.notify_all()
            return False
        return True

    def _issue(self, batch: Batch) -> None:
        """Start the batch's device work on the side stream: compare, copy, one event."""
        to_host = self.device == _CPU
        flags: list[torch.Tensor] = []
        module = side = None
        for index, item in enumerate(batch.items):
            if isinstance(item, Ready):
                self._forget_on_device(item.site)  # compared on the host from now on
                self._on_host.discard(item.site)
                continue
            clone = item.clone
            assert clone is not None
            if item.module is not module or clone.device != getattr(side, "device", None):
                module, side = item.module, self._side(clone.device, item.module)
                for stream, event in batch.ready.items():
                    if stream.device == clone.device:
                        side.wait_event(event)
            with module.stream(side):
                if self._compare:
                    self._place(item, clone)
                    if item.prev is not None:
                        batch.flags[index] = len(flags)
                        flags.append(torch.ne(bit_view(clone), bit_view(item.prev)).any())
                if to_host or item.on_host:
                    item.host = self.ring.tensor(clone.shape, clone.dtype)
                    if self.ring.overflows and not self._warned_overflow:
                        self._warn_overflow(item.site)
                    item.host.copy_(clone, non_blocking=True)
        if module is None:
            return  # values copied at admission only
        batch.module = module
        with module.stream(side):
            if flags:
                batch.slot = self.ring.bookkeeping((len(flags),), torch.bool)
                batch.slot.copy_(torch.stack(flags), non_blocking=True)
            batch.done = module.Event(blocking=True)
            batch.done.record(side)
        self.stats.pinned = self.ring.pinned

    def _place(self, item: Staged, clone: torch.Tensor) -> None:
        """Decide where `item`'s record is compared, and keep its clone for the next.

        On the device, with the site's last clone (`item.prev`) when that one has the
        record's dtype and shape; the clone then takes its place.  A site with no such
        clone keeps this one if it fits in `max_device_bytes` (first come, first served);
        otherwise the site is compared on the host, at delivery (`item.on_host`), until
        one of its records is copied at admission.  A record of another dtype or shape
        than its site's last differs anyway, so a site on the device is placed again
        then, at no cost to the result.
        """
        site = item.site
        prev = self._prev.get(site)
        if prev is not None and prev.dtype == clone.dtype and prev.shape == clone.shape:
            item.prev = prev
            self._prev[site] = clone  # as many bytes as the one it replaces
            return
        if prev is not None:
            self._forget_on_device(site)
        if site not in self._on_host:
            if self.max_device_bytes is None:
                self.max_device_bytes = _default_device_bytes(clone.device)
            stats = self.stats
            held = stats.device_compare_bytes + clone.nbytes
            if held <= self.max_device_bytes:
                self._prev[site] = clone
                stats.device_compare_bytes = held
                stats.device_compare_bytes_peak = max(stats.device_compare_bytes_peak, held)
                return
            if not self._on_host:
                warn(
                    f"vartrace: change detection holds {stats.device_compare_bytes} bytes of "
                    f"previous records on the device, and site {site!r} ({clone.nbytes} bytes "
                    f"a record) would pass max_device_bytes={self.max_device_bytes}: it, and "
                    "any other site past the budget, is compared on the host instead, a byte "
                    "comparison of each of its records on the staging thread (the records "
                    "kept are the same; staging_stats.host_compares counts them); "
                    "ModelTracer(max_device_bytes=...) raises the budget",
                    UserWarning,
                    stacklevel=2,
                )
            self._on_host.add(site)
        item.on_host = True

    def _forget_on_device(self, site: str) -> None:
        """Let go of `site`'s last clone, if the device holds one for it."""
        prev = self._prev.pop(site, None)
        if prev is not None:
            self.stats.device_compare_bytes -= prev.nbytes

    def _unchanged_on_host(self, item: Staged) -> bool:
        """Whether `item`'s host copy equals, bit for bit, its site's last one compared on
        the host; if not, it is the site's last from now on."""
        host = item.host
        assert host is not None
        self.stats.host_compares += 1
        last = self._host_prev.get(item.site)
        if (
            last is not None
            and last.dtype == host.dtype
            and last.shape == host.shape
            and same_bytes(last, host)
        ):
            return True
        self._host_prev[item.site] = host  # its slot stays taken until the site's next
        return False

    def _side(self, device: torch.device, module: ModuleType) -> Any:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = module.Stream(device=device)
        return side

    def _wait(self, batch: Batch) -> None:
        """Until the batch's copies landed: a blocking wait (the GIL released), or polls
        where the device module watches for syncs."""
        done = batch.done
        if done is None:
            return
        watched = getattr(batch.module, "get_sync_debug_mode", None)
        if _SANITIZED or watched is None or not watched():
            done.synchronize()
            return
        pause = _POLL_FIRST
        while not done.query():
            self.stats.wakeups += 1
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX)

    def _finish(self, batch: Batch) -> None:
        """Deliver the batch's changed records, in order."""
        stats = self.stats
        changed = batch.slot.numpy().tolist() if batch.slot is not None else []
        deliver = self._deliver
        to_host = self.device == _CPU
        for index, item in enumerate(batch.items):
            if isinstance(item, Ready):
                self._host_prev.pop(item.site, None)  # as `_issue` took it off the host
                deliver(item.site, item.record, item.iteration, item.host)
                continue
            if item.on_host:
                if self._unchanged_on_host(item):
                    stats.unchanged += 1
                    continue
            else:
                position = batch.flags.get(index)
                if position is not None and not changed[position]:
                    stats.unchanged += 1
                    continue
            record = item.host if to_host else item.clone
            assert record is not None
            if record.device != self.device:
                record = record.to(self.device, non_blocking=True)
            deliver(item.site, record, item.iteration, None)
        stats.host_bytes_peak = self.ring.peak
        stats.overflows = self.ring.overflows

    def _release(self, batch: Batch) -> None:
        """Forget the batch (its clones may be reused: the side stream is done with them) and
        make room for the admissions waiting."""
        nbytes = 0
        for item in batch.items:
            nbytes += item.nbytes
            if isinstance(item, Staged):
                item.clone = item.prev = item.host = None
        batch.items = []
        batch.slot = None
        self._delivered += nbytes
        if self._waiting:
            with self._cv:
                self._cv.notify_all()
