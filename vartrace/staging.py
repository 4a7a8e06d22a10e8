"""Asynchronous staging: records of accelerator tensors reach the host with no sync in the step.

On a GPU, a blocking ``.cpu()`` per record drains the launch queue: the CPU
can no longer run ahead of the device, and a Python-heavy step becomes CPU
time plus GPU time.  A :class:`Stager` takes every record off the capturing
thread instead:

1. **Admission** (the capturing thread: the training thread, or autograd's
   device thread for ``@grad``) reserves the record's bytes against
   ``max_inflight_bytes``, clones the tensor on the device, on the producer's
   current stream, and records an event after the clone.  That clone and
   event are the only device work left in the step.  Values that are not
   accelerator tensors (CPU tensors, Python scalars, markers) are copied at
   once and queued behind the others, so that records keep capture order.
2. **Copy** (one ``vartrace-staging-N`` thread per tracer): a side stream
   waits for the event, copies the clone into pinned host memory
   (``non_blocking``), and records a second event.
3. **Completion** (the same thread, in admission order): the thread polls
   that event with ``query()`` -- never a blocking wait, which a user's
   ``torch.cuda.set_sync_debug_mode("error")`` would see -- then frees the
   clone and hands the host copy to ``deliver(site, record, iteration)``
   (the tracer's change detection and chunk).  Jobs queued with
   :meth:`Stager.call` (the tracer's gathers) run in the same order, after
   every record admitted before them.

Memory in flight (device clones not yet copied out, and their host buffers)
is bounded by bytes at admission: when a record would exceed the bound the
capturing thread waits for earlier records to land (``on_full="wait"``,
counted, warned once), or the record is dropped (``on_full="drop"``,
counted per site) and a :class:`~vartrace.Unstored` marker takes its place,
so that "the last record at or before step k" is never silently stale.
Pinned buffers come from torch's caching host allocator, which reuses
them; kept records are copied out of them into ordinary memory, so pinned
memory stays within the bound too.  Where pinning is unavailable the copy
goes to pageable memory (it then blocks the staging thread, never the step).

A stream that is capturing a CUDA graph skips the record with one warning: a
replay of the graph runs no Python, so there would be nothing to record.

Example::

    stager = Stager(lambda site, record, iteration, host: print(site, record))
    stager.admit("forward.x", torch.ones(3, device="cuda"), iteration=1)
    stager.call(lambda: print("every record admitted so far was delivered"))
    stager.close()
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vartrace._warnings import warn
from vartrace.record import Unstored
from vartrace.tensors import copy_leaf

__all__ = ["OnFull", "Stager", "StagingStats", "stageable"]

OnFull = Literal["wait", "drop"]
Deliver = Callable[[str, Any, int, Any], None]
"""``deliver(site, record, iteration, host)``: a record, in admission order, and its host copy.

The record lives on the stager's ``device``; ``host`` is the same value on
the host, for change detection without touching the device.
"""

_CPU = torch.device("cpu")
_STREAM_API = ("Stream", "Event", "current_stream", "stream")
_POLL_FIRST, _POLL_MAX = 2e-5, 1e-3  # seconds between event polls: doubling, capped
_names = itertools.count(1)


@dataclass
class StagingStats:
    """What a :class:`Stager` did, for ``tracer.staging_stats``.

    Attributes:
        admitted: records admitted (staged or copied at once).
        staged: records cloned on a device and copied to the host asynchronously.
        kept: records that changed and were recorded (counted by the tracer).
        unchanged: records equal to the site's last one, left out (counted by the tracer).
        dropped: records dropped because the bound was reached (``on_full="drop"``).
        dropped_by_site: ``dropped`` per site.
        waits: admissions that waited for memory in flight (``on_full="wait"``).
        wait_seconds: the time those waits took, in total.
        max_inflight_bytes: the most bytes in flight at once.
        skipped_capturing: records skipped while a stream was capturing a graph.
        pinned: whether host buffers are pinned (``None`` before the first copy).
    """

    admitted: int = 0
    staged: int = 0
    kept: int = 0
    unchanged: int = 0
    dropped: int = 0
    dropped_by_site: dict[str, int] = field(default_factory=dict)
    waits: int = 0
    wait_seconds: float = 0.0
    max_inflight_bytes: int = 0
    skipped_capturing: int = 0
    pinned: bool | None = None


_stream_modules: dict[str, ModuleType | None] = {}


def _stream_module(device: torch.device) -> ModuleType | None:
    """The device's torch module (``torch.cuda``...) when it has streams and events."""
    kind = device.type
    if kind not in _stream_modules:
        try:
            module = torch.get_device_module(kind)
        except (RuntimeError, AttributeError):
            module = None
        usable = module is not None and all(hasattr(module, n) for n in _STREAM_API)
        _stream_modules[kind] = module if usable else None
    return _stream_modules[kind]


def stageable(value: Any) -> bool:
    """Whether ``value`` is a dense accelerator tensor that a :class:`Stager` copies asynchronously.

    CPU and meta tensors, sparse, quantized and nested tensors, tensor
    subclasses that flatten into other tensors (``DTensor``, float8
    wrappers) and functorch wrappers are copied at admission instead.
    """
    return (
        isinstance(value, torch.Tensor)
        and not value.is_cpu
        and not value.is_meta
        and value.layout is torch.strided
        and not value.is_quantized
        and not value.is_nested
        and not is_traceable_wrapper_subclass(value)
        and not torch._C._functorch.is_functorch_wrapped_tensor(value)
        and _stream_module(value.device) is not None
    )


class _Item:
    """One entry of the staging queue, completed in admission order."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int = 0) -> None:
        self.nbytes = nbytes

    def issue(self, stager: Stager) -> None:
        """Start this item's device work (staging thread)."""

    def landed(self) -> bool:
        return True

    def finish(self, stager: Stager) -> None:
        raise NotImplementedError


class _Ready(_Item):
    """A value copied at admission, queued to keep capture order."""

    __slots__ = ("host", "iteration", "record", "site")

    def __init__(self, site: str, record: Any, iteration: int, host: Any = None) -> None:
        super().__init__()
        self.site, self.record, self.iteration = site, record, iteration
        self.host = record if host is None else host

    def finish(self, stager: Stager) -> None:
        stager._deliver(self.site, self.record, self.iteration, self.host)


class _Job(_Item):
    __slots__ = ("job",)

    def __init__(self, job: Callable[[], None]) -> None:
        super().__init__()
        self.job = job

    def finish(self, stager: Stager) -> None:
        self.job()


class _Staged(_Item):
    """A device clone on its way to the host."""

    __slots__ = ("clone", "done", "host", "iteration", "module", "ready", "side", "site")

    def __init__(
        self,
        site: str,
        iteration: int,
        clone: torch.Tensor,
        ready: Any,
        side: Any,
        module: ModuleType,
    ) -> None:
        super().__init__(clone.nbytes)
        self.site, self.iteration = site, iteration
        self.clone: torch.Tensor | None = clone
        self.ready, self.side, self.module = ready, side, module
        self.host: torch.Tensor | None = None
        self.done: Any = None

    def issue(self, stager: Stager) -> None:
        clone = self.clone
        assert clone is not None
        host = stager._host_buffer(clone)
        module, side = self.module, self.side
        with module.stream(side):
            side.wait_event(self.ready)
            host.copy_(clone, non_blocking=True)
            done = module.Event()
            done.record(side)
        self.host, self.done = host, done

    def landed(self) -> bool:
        if _SANITIZED:
            self.done.synchronize()  # the only wait the CUDA sanitizer understands
            return True
        return bool(self.done.query())

    def finish(self, stager: Stager) -> None:
        # Dropped here, once the side stream is done reading it: its memory may be reused.
        clone, self.clone = self.clone, None
        host, self.host = self.host, None
        record = host if stager.device == _CPU else clone
        assert record is not None, "finish() runs once, after start()"
        if record.device != stager.device:
            record = record.to(stager.device, non_blocking=True)
        stager._deliver(self.site, record, self.iteration, host)


# Under torch's CUDA sanitizer, event polls look like unsynchronised reads: wait instead.
_SANITIZED = bool(os.environ.get("TORCH_CUDA_SANITIZER"))


class Stager:
    """Admits records on any thread and delivers them, in order, on a thread of its own.

    Args:
        deliver: ``deliver(site, record, iteration, host)``, called on the
            staging thread for each record, in admission order (see :data:`Deliver`).
        max_inflight_bytes: the most bytes of records between admission and
            delivery; a record larger than that alone is admitted when
            nothing else is in flight.
        on_full: ``"wait"`` (the admitting thread waits) or ``"drop"`` (the
            record becomes a marker) when the bound would be exceeded.
        device: where delivered records live: the host (the default), or a
            device, where the record is the clone itself (its host copy still
            serves change detection, so no comparison runs on the device).
        name: the thread's name.
    """

    def __init__(
        self,
        deliver: Deliver,
        *,
        max_inflight_bytes: int = 1 << 30,
        on_full: OnFull = "wait",
        device: torch.device = _CPU,
        name: str | None = None,
    ) -> None:
        if on_full not in ("wait", "drop"):
            raise ValueError(f"on_full must be 'wait' or 'drop', not {on_full!r}")
        if not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 1:
            raise ValueError(
                f"max_inflight_bytes must be a positive integer, not {max_inflight_bytes!r}"
            )
        self.stats = StagingStats()
        self.device = device
        self._deliver = deliver
        self._bound = max_inflight_bytes
        self._on_full = on_full
        self._cv = threading.Condition()
        self._queue: collections.deque[_Item] = collections.deque()
        self._unfinished = 0
        self._inflight = 0
        self._closing = False
        self._error: BaseException | None = None
        self._raised_once = False
        self._streams: dict[torch.device, Any] = {}
        self._warned_wait = False
        self._warned_capture = False
        self._thread = threading.Thread(
            target=self._run, name=name or f"vartrace-staging-{next(_names)}", daemon=True
        )
        self._thread.start()

    # -- any capturing thread -------------------------------------------------------------

    def admit(self, site: str, value: Any, iteration: int) -> None:
        """Queue ``value``'s record: a device clone for an accelerator tensor, else a copy."""
        self._raise()
        if not stageable(value):
            host = copy_leaf(value, _CPU, site)
            record = host if self.device == _CPU else copy_leaf(value, self.device, site)
            self._put(_Ready(site, record, iteration, host))
            return
        module = _stream_module(value.device)
        assert module is not None
        capturing = getattr(module, "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            self._skip_capturing(site)
            return
        nbytes = value.nbytes
        if not self._reserve(site, nbytes):
            marker = Unstored(
                f"dropped: {nbytes} bytes would exceed max_inflight_bytes={self._bound} "
                "(on_full='drop')"
            )
            self._put(_Ready(site, marker, iteration))
            return
        try:
            item = self._stage(site, value, iteration, module)
        except Exception as error:  # a device out of memory: a marker, never the step's error
            self._release(nbytes)
            marker = Unstored(f"cannot clone it on {value.device}: {error}")
            self._put(_Ready(site, marker, iteration))
            return
        self._put(item)

    @staticmethod
    def keep(record: Any) -> Any:
        """``record`` in ordinary host memory: a delivered record that is kept leaves the
        pinned staging buffer it arrived in (pinned memory stays within the bound)."""
        if isinstance(record, torch.Tensor) and record.is_pinned():
            return record.clone()
        return record

    def call(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the staging thread once every record admitted before is delivered."""
        self._raise()
        self._put(_Job(job))

    def drain(self) -> None:
        """Wait until everything admitted was delivered and every job ran; raise a failure.

        From the staging thread itself (a callback reading results) it returns at once.
        """
        if threading.current_thread() is not self._thread:
            with self._cv:
                while self._unfinished and self._error is None and self._thread.is_alive():
                    self._cv.wait()
        self._raise()

    def close(self, last: Callable[[], None] | None = None) -> None:
        """Run ``last`` (if given) as :meth:`call` would, drain, and end the staging thread.

        Raises a failure of the thread unless it was raised before (by
        :meth:`admit`, :meth:`call` or :meth:`drain`).
        """
        if last is not None and self._error is None:
            self._put(_Job(last))
        try:
            self.drain()
        except BaseException:
            if not self._raised_once:
                raise
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            self._raised_once = True
            raise self._error

    def _put(self, item: _Item) -> None:
        with self._cv:
            if not isinstance(item, _Job):
                self.stats.admitted += 1
                self.stats.staged += isinstance(item, _Staged)
            self._queue.append(item)
            self._unfinished += 1
            self._cv.notify_all()

    def _reserve(self, site: str, nbytes: int) -> bool:
        """Count ``nbytes`` in flight, waiting or refusing (``False``) when over the bound."""
        stats = self.stats
        with self._cv:
            if self._inflight and self._inflight + nbytes > self._bound:
                if self._on_full == "drop":
                    stats.dropped += 1
                    stats.dropped_by_site[site] = stats.dropped_by_site.get(site, 0) + 1
                    return False
                started = time.perf_counter()
                stats.waits += 1
                self._warn_wait(nbytes)
                while self._inflight and self._inflight + nbytes > self._bound:
                    if self._error is not None or not self._thread.is_alive():
                        break
                    self._cv.wait()
                stats.wait_seconds += time.perf_counter() - started
            self._inflight += nbytes
            stats.max_inflight_bytes = max(stats.max_inflight_bytes, self._inflight)
        return True

    def _release(self, nbytes: int) -> None:
        with self._cv:
            self._inflight -= nbytes
            self._cv.notify_all()

    def _stage(self, site: str, value: torch.Tensor, iteration: int, module: ModuleType) -> _Staged:
        device = value.device
        side = self._streams.get(device)
        if side is None:  # made on a capturing thread, as torch's own stagers do
            side = self._streams[device] = module.Stream(device=device)
        producer = module.current_stream(device)
        clone = value.detach().resolve_conj().resolve_neg()
        clone = clone.clone(memory_format=torch.contiguous_format)
        ready = module.Event()
        ready.record(producer)
        return _Staged(site, iteration, clone, ready, side, module)

    def _warn_wait(self, nbytes: int) -> None:
        if not self._warned_wait:
            self._warned_wait = True
            warn(
                f"vartrace: the step waited for records in flight to reach the host "
                f"({self._inflight} bytes in flight, {nbytes} more, max_inflight_bytes="
                f"{self._bound}); waits are counted in tracer.staging_stats.  Raise "
                "max_inflight_bytes, record less, or pass on_full='drop'",
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

    def _host_buffer(self, clone: torch.Tensor) -> torch.Tensor:
        if self.stats.pinned is not False:
            try:
                host = torch.empty(clone.shape, dtype=clone.dtype, pin_memory=True)
            except RuntimeError:  # no pinning in this build or on this device
                self.stats.pinned = False
            else:
                self.stats.pinned = True
                return host
        return torch.empty(clone.shape, dtype=clone.dtype)

    def _run(self) -> None:
        pending: collections.deque[_Item] = collections.deque()
        issued = 0  # pending[:issued] have their device work started
        pause = _POLL_FIRST
        while True:
            with self._cv:
                while not self._queue and not pending:
                    if self._closing:
                        return
                    self._cv.wait()
                pending.extend(self._queue)
                self._queue.clear()
            while issued < len(pending):
                self._attempt(pending[issued].issue, self)
                issued += 1
            head = pending[0]
            if self._error is None and not self._attempt(head.landed):
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX)
                continue
            pause = _POLL_FIRST
            pending.popleft()
            issued -= 1
            if self._error is None:
                self._attempt(head.finish, self)
            self._release(head.nbytes)
            with self._cv:
                self._unfinished -= 1
                self._cv.notify_all()

    def _attempt(self, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)``; its exception is kept for the admitting threads (then ``True``)."""
        if self._error is not None:
            return True
        try:
            return step(*args)
        except BaseException as error:
            with self._cv:
                self._error = error
                self._cv.notify_all()
            return True
