"""simgpu: a CPU stand-in accelerator for the tests, with a sync log and asynchronous copies.

Importing this module registers torch's PrivateUse1 backend under the name ``"simgpu"``
(once per process) with a CUDA-like device module, ``torch.simgpu`` (also what
``torch.get_device_module("simgpu")`` returns).  Tensors on :data:`DEVICE` are
:class:`SimTensor` wrappers (``__torch_dispatch__``) around an ordinary CPU tensor:

* **Kernels are synchronous.**  Every aten op runs at once on the inner CPU tensors, on the
  calling thread, and its results are wrapped again.  Factory functions work with
  ``device=DEVICE`` (``torch.zeros``, ``torch.arange``, ``torch.tensor``, ``t.to(DEVICE)``...),
  and random ops draw from the CPU default generator, so a seeded run gives the numbers a CPU
  run gives.  Whole models train: backward runs on an autograd device thread (not
  ``MainThread``), as on CUDA.
* **Syncs are logged.**  :data:`LOG` records, with the thread's name and the innermost frame in
  the ``vartrace`` package, every operation that would make the host wait for the device on
  CUDA: ``_local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()``),
  ``torch.equal``, ops whose output shape depends on the data (``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, boolean-mask
  indexing), device-to-host and host-to-device copies with ``non_blocking=False`` (``.cpu()``,
  ``.to("cpu")``, ``.tolist()``, ``copy_``, ``t.to(DEVICE)``, ``torch.tensor(..., device=...)``),
  ``Event.synchronize()``, ``Stream.synchronize()``, ``torch.simgpu.synchronize()`` and the
  ``repr`` of a device tensor.  A blocking copy or scalar read also waits for the copies queued
  on the calling thread's current stream, as ``cudaStreamSynchronize`` does.
* **Device-to-host copies with ``non_blocking=True`` are asynchronous.**  ``host.copy_(dev,
  non_blocking=True)`` and ``dev.to("cpu", non_blocking=True)`` return at once with the
  destination filled with ``0xFF`` bytes (NaN for floats, -1 for signed integers) and queue the
  copy on the calling thread's current :class:`Stream`.  A per-stream worker thread
  (``simgpu-stream-N``) performs the queued copies in order, each no earlier than a random delay
  after it was issued (:func:`set_copy_delay`), **reading the source when it lands**: a source
  written in place after the copy was issued is copied with that write, and a destination read
  before its event completed holds the poison.  :meth:`Stream.wait_event` holds the later copies
  of a stream until the event's work landed; :meth:`Event.record` marks the work queued on a
  stream so far; :meth:`Event.query` says whether it all landed.  Host-to-device copies with
  ``non_blocking=True`` happen at once and are not logged.
* **Graph capture** is stood in for by :func:`capturing`: on the calling thread,
  ``is_current_stream_capturing()`` is True and every logged sync, and every copy between host
  and device, raises (none of them is allowed during a CUDA graph capture with pageable memory).

What it does not model: timing, and real concurrency between streams or between kernels and
copies (kernels finish before the call returns, so only copies are ever "in flight"); device
memory (no allocator, no use-after-free of a copy's source: a queued copy keeps its source
alive); events recorded by kernels (only deferred copies and ``wait_event`` are stream work);
other threads' restrictions during a capture (CUDA's default ``"global"`` capture mode also
forbids unsafe calls from other threads); cross-device checks beyond "a CPU tensor with more
than 0 dimensions mixed with device tensors" (raised as CUDA raises it).

Pinned memory: there is none.  With the backend registered, ``torch.empty(n,
pin_memory=True)`` and ``t.pin_memory()`` raise ``NotImplementedError`` (a ``RuntimeError``)
from the PrivateUse1 hooks ("... implement `getPinnedMemoryAllocator` ..."), and ``is_pinned()``
is False.  This is not faked: code under test must fall back to pageable host memory.

Process-wide effects of the import: PrivateUse1 is renamed ``"simgpu"`` (for good: torch cannot
undo it), so ``torch.accelerator.current_accelerator()`` is ``simgpu`` and
``torch.get_device_module()`` is ``torch.simgpu``.  To keep CPU-only tests in the same process
on the CPU, :func:`is_available` answers False to torch's own device discovery
(``torch.accelerator.is_available()``, ``torch._utils._get_available_device_type()``, which
``nn.DataParallel`` and ``DataLoader(pin_memory=True)`` use) and True to everyone else.  CPU
tensors and ``torch.manual_seed`` are not affected.  Importing the module again under another
name returns the first import's module.

What works, and what does not: factories with ``device=DEVICE`` (window functions included);
``tolist()``, ``f"{t:.3f}"``, ``copy.deepcopy``, pickling (not logged), ``t.data = other``;
AdamW/Adam/SGD/RMSprop with ``foreach`` False or True equal to CPU; ``fused=True`` equal to
``fused=True`` on CPU; ``capturable=True`` runs (CPU has no reference).  A device tensor cannot
be resized (``resize_``, an ``out=`` tensor of the wrong size) nor have its strides changed in
place (``t_``, ``transpose_``...): both raise ``NotImplementedError``.  ``untyped_storage()``
and ``record_stream`` raise, ``data_ptr()`` is 0, ``torch.Generator(device="simgpu")``
does not exist, ``torch.compile`` was not tried, and an op on a device tensor with torch's
Python dispatch key excluded (torch internals only) fails an internal assert.
``torch.autocast("simgpu")`` runs but casts nothing (no autocast rules for PrivateUse1 on a CPU
build): use explicit dtypes.

Example::

    from tests import simgpu

    x = simgpu.to_device(torch.randn(4))
    simgpu.LOG.clear()
    host = torch.empty(4)
    host.copy_(x, non_blocking=True)  # not a sync; host is poisoned until the copy lands
    done = simgpu.current_stream().record_event()
    done.synchronize()  # a sync (logged); host == x now
    assert [e.op for e in simgpu.LOG.events] == ["Event.synchronize"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import os
import random
import sys
import threading
import time
import types
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "BACKEND",
    "DEVICE",
    "EVENTS_RECORDED",
    "LOG",
    "OUTSIDE",
    "Event",
    "SimTensor",
    "Stream",
    "SyncEvent",
    "SyncLog",
    "capturing",
    "copy_delay",
    "current_stream",
    "default_stream",
    "is_current_stream_capturing",
    "peek",
    "set_copy_delay",
    "set_stream",
    "stream",
    "synchronize",
    "to_device",
    "to_device_module",
]

NAME = "simgpu"
CPU = torch.device("cpu")
aten = torch.ops.aten


def _claim_backend() -> tuple[types.ModuleType, types.ModuleType | None]:
    """``(torch.simgpu, None)`` after registering it, or ``(it, first)`` if imported before.

    The device module is filled in at the end of this file; renaming PrivateUse1 comes first
    because ``torch.device("simgpu")`` needs it.
    """
    existing = getattr(torch, NAME, None)
    first = getattr(existing, "_impl_module", None)
    if first is not None:  # imported before under another name (``simgpu``, ``tests.simgpu``)
        return existing, first
    taken = torch._C._get_privateuse1_backend_name()
    if taken != "privateuseone" or existing is not None:
        raise ImportError(
            f"simgpu: PrivateUse1 is already taken (named {taken!r}, torch.{NAME}="
            f"{existing!r}); import tests/simgpu.py before anything else registers one"
        )
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    backend = types.ModuleType(f"torch.{NAME}")
    backend.__doc__ = "The simgpu stand-in accelerator's device module (tests/simgpu.py)."
    backend._impl_module = sys.modules[__name__]  # type: ignore[attr-defined]
    _setup_privateuseone_for_python_backend(NAME, backend_module=backend)
    return backend, None


BACKEND, _FIRST_IMPORT = _claim_backend()
"""``torch.simgpu``: the device module that ``torch.get_device_module("simgpu")`` returns."""
DEVICE = torch.device(NAME, 0)

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _vartrace_dir() -> str | None:
    """The ``vartrace`` package's folder, found without importing it."""
    try:
        spec = importlib.util.find_spec("vartrace")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(next(iter(spec.submodule_search_locations))) + os.sep


VARTRACE_DIR = _vartrace_dir()
"""Frames in files under this folder are "inside vartrace" for :attr:`SyncEvent.where`."""


# -- the sync log ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SyncEvent:
    """One operation that would make the host wait for the device on CUDA.

    Attributes:
        op: what synchronised: an aten op (``"aten._local_scalar_dense.default"``), a copy
            (``"d2h aten._to_copy.default"``, ``"h2d aten.copy_.default"``),
            ``"Event.synchronize"``, ``"Stream.synchronize"``, ``"synchronize"`` or ``"repr"``.
        thread: the name of the thread that did it (autograd's device threads are ``Dummy-N``).
        where: the innermost frame inside the ``vartrace`` package, ``"tensors.py:120
            copy_leaf"``, or ``"(outside vartrace)"``.
        stack: the innermost vartrace frames, innermost last (up to 8); outside vartrace, the
            innermost frames outside torch and this module instead (up to 4).
    """

    op: str
    thread: str
    where: str
    stack: tuple[str, ...] = ()


OUTSIDE = "(outside vartrace)"


def _frame_label(path: str, line: int, name: str) -> str:
    if VARTRACE_DIR is not None and path.startswith(VARTRACE_DIR):
        path = path[len(VARTRACE_DIR) :].replace(os.sep, "/")
    else:
        path = os.path.basename(path)
    return f"{path}:{line} {name}"


def _caller_frames() -> tuple[str, tuple[str, ...]]:
    """``(where, stack)`` for the current call stack (see :class:`SyncEvent`)."""
    ours: list[str] = []
    others: list[str] = []
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if VARTRACE_DIR is not None and path.startswith(VARTRACE_DIR):
            if len(ours) < 8:
                ours.append(_frame_label(path, frame.f_lineno, frame.f_code.co_name))
        elif path != _HERE and not path.startswith(_TORCH_DIR) and len(others) < 4:
            others.append(_frame_label(path, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    if ours:
        return ours[0], tuple(reversed(ours))
    return OUTSIDE, tuple(reversed(others))


class SyncLog:
    """A thread-safe record of :class:`SyncEvent`; :meth:`paused` stops it on one thread."""

    def __init__(self) -> None:
        self._events: list[SyncEvent] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def events(self) -> list[SyncEvent]:
        """A copy of the events so far, in order."""
        with self._lock:
            return list(self._events)

    def enabled(self) -> bool:
        """Whether the calling thread's syncs are recorded (not inside :meth:`paused`)."""
        return not getattr(self._local, "paused", 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing from the calling thread inside (set-up code); nests."""
        self._local.paused = getattr(self._local, "paused", 0) + 1
        try:
            yield
        finally:
            self._local.paused -= 1

    def add(self, op: str) -> None:
        """Record ``op`` for the calling thread, unless it is paused."""
        if not self.enabled():
            return
        where, stack = _caller_frames()
        event = SyncEvent(op, threading.current_thread().name, where, stack)
        with self._lock:
            self._events.append(event)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def syncs(self, exclude_threads_prefix: str | None = "vartrace-") -> list[SyncEvent]:
        """The events, but those of threads whose name starts with ``exclude_threads_prefix``.

        vartrace's own background threads (``vartrace-...``) may wait for the device; the
        threads of the step (``MainThread``, autograd's) may not.
        """
        return [
            e
            for e in self.events
            if not (exclude_threads_prefix and e.thread.startswith(exclude_threads_prefix))
        ]

    def summary(self, exclude_threads_prefix: str | None = None) -> Counter[tuple[str, str, str]]:
        """``Counter`` of ``(op, where, thread)``: readable in an assertion message."""
        return Counter((e.op, e.where, e.thread) for e in self.syncs(exclude_threads_prefix))

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


LOG = SyncLog()
"""Every sync of every thread since the last :meth:`SyncLog.clear`."""


# -- graph capture stand-in --------------------------------------------------------------------

_thread = threading.local()


def is_current_stream_capturing() -> bool:
    """True on a thread inside :func:`capturing`."""
    return bool(getattr(_thread, "capturing", 0))


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Behave, on the calling thread only, as if its current stream captured a CUDA graph.

    Inside, :func:`is_current_stream_capturing` is True and every sync and every copy between
    host and device raises ``RuntimeError`` (pageable memory cannot be copied during a capture).
    """
    _thread.capturing = getattr(_thread, "capturing", 0) + 1
    try:
        yield
    finally:
        _thread.capturing -= 1


def _forbid_in_capture(what: str) -> None:
    if is_current_stream_capturing():
        raise RuntimeError(
            f"simgpu: {what} is not permitted while the current stream is capturing a graph"
        )


def _sync(op: str, drain: bool = True) -> None:
    """A host-device sync: refused in a capture, logged, and the current stream drained."""
    _forbid_in_capture(op)
    LOG.add(op)
    if drain:
        current_stream()._wait_for(None)


# -- streams, events, asynchronous copies ------------------------------------------------------

_cond = threading.Condition()  # guards every stream's queue and counters, and the delay rng
_streams: weakref.WeakSet[Stream] = weakref.WeakSet()
_stream_ids = itertools.count()
_delay_max = 0.003
_delay_seed: int | None = 0
_delay_rng = random.Random(0)
_LINGER = 0.05  # seconds a stream's idle worker thread waits for more work before it exits


def set_copy_delay(max_seconds: float, seed: int | None = 0) -> tuple[float, int | None]:
    """Make each deferred copy land a uniform random ``[0, max_seconds]`` after it is issued.

    ``seed`` seeds the ``random.Random`` drawing the delays (``None``: from the OS).  Returns
    the previous ``(max_seconds, seed)``.  The default is 3 ms, seed 0.
    """
    global _delay_max, _delay_seed, _delay_rng
    if max_seconds < 0:
        raise ValueError(f"max_seconds must be >= 0, got {max_seconds}")
    with _cond:
        previous = (_delay_max, _delay_seed)
        _delay_max, _delay_seed, _delay_rng = max_seconds, seed, random.Random(seed)
    return previous


@contextlib.contextmanager
def copy_delay(max_seconds: float, seed: int | None = 0) -> Iterator[None]:
    """:func:`set_copy_delay` inside the block, the previous setting after it."""
    previous = set_copy_delay(max_seconds, seed)
    try:
        yield
    finally:
        set_copy_delay(*previous)


def _check_device(device: Any) -> torch.device:
    if device is None or (isinstance(device, int) and device == 0):
        return DEVICE
    device = torch.device(device)
    if device.type != NAME or device.index not in (None, 0):
        raise ValueError(f"simgpu: expected a {NAME} device (index 0), got {device}")
    return DEVICE


@dataclasses.dataclass
class _Copy:
    """A queued device-to-host copy; ``src`` is the device tensor's inner CPU tensor."""

    dst: torch.Tensor
    src: torch.Tensor
    not_before: float


@dataclasses.dataclass
class _Wait:
    """A queued wait for ``stream`` to have completed ``target`` items."""

    stream: Stream
    target: int


class Stream:
    """A queue of deferred copies and waits, performed in order by a worker thread.

    Kernels do not go through streams (they run at once); ``priority`` is kept, not used.
    """

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = _check_device(device)
        self.device_type = NAME
        self.device_index = 0
        self.priority = priority
        self.stream_id = next(_stream_ids)
        self._work: deque[_Copy | _Wait] = deque()
        self._queued = 0  # items ever queued
        self._done = 0  # items completed (in order)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        with _cond:
            _streams.add(self)

    def __repr__(self) -> str:
        return f"<simgpu.Stream {self.stream_id} queued={self._queued} done={self._done}>"

    # The queue (callers hold ``_cond``).

    def _enqueue(self, item: _Copy | _Wait) -> None:
        self._work.append(item)
        self._queued += 1
        _cond.notify_all()
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._drain, name=f"simgpu-stream-{self.stream_id}", daemon=True
            )
            try:
                self._worker.start()
            except RuntimeError:  # Python 3.12+ starts no thread at interpreter shutdown
                self._worker = None  # (an exit drain after the worker lingered out)
                while self._work:  # the queue performed here, in order, as a sync would
                    self._perform(self._work[0])

    def _drain(self) -> None:
        """The worker: perform the queue in order; exit once idle for :data:`_LINGER` s."""
        while True:
            with _cond:
                if not self._work and not _cond.wait_for(lambda: self._work, timeout=_LINGER):
                    self._worker = None
                    return
                item = self._work[0]
            self._perform(item)
            item = None  # a stream holds no memory once a copy landed (its host buffer may go)

    def _perform(self, item: _Copy | _Wait) -> None:
        """Perform the queue's first item `item` (a copy once it is due, or a wait), and
        pop it; `_cond` may be held (it is released while waiting)."""
        if isinstance(item, _Wait):
            with _cond:
                _cond.wait_for(lambda: item.stream._done >= item.target)
        else:
            pause = item.not_before - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                item.dst.copy_(item.src)
            except BaseException as error:  # kept and raised at the next query/sync
                with _cond:
                    self._error = error
        with _cond:
            self._work.popleft()
            self._done += 1
            _cond.notify_all()

    def _raise_error(self) -> None:
        """Raise (once) a deferred copy's failure, as CUDA reports errors at the next sync."""
        with _cond:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"simgpu: a deferred copy on {self!r} failed: {error}") from error

    def _wait_for(self, target: int | None) -> None:
        """Block until ``target`` items (``None``: all queued now) completed."""
        with _cond:
            goal = self._queued if target is None else target
            _cond.wait_for(lambda: self._done >= goal)
        self._raise_error()

    # The CUDA-like API.

    def query(self) -> bool:
        """Whether all work queued on the stream completed (no sync)."""
        self._raise_error()
        with _cond:
            return self._done >= self._queued

    def synchronize(self) -> None:
        """Wait for all work queued on the stream (a logged sync)."""
        _sync("Stream.synchronize", drain=False)
        self._wait_for(None)

    def wait_event(self, event: Event) -> None:
        """Make the work queued on this stream later wait until ``event``'s work completed."""
        with _cond:
            if event._stream is None or event._stream._done >= event._target:
                return
            self._enqueue(_Wait(event._stream, event._target))

    def wait_stream(self, stream: Stream) -> None:
        """Make the work queued on this stream later wait for all work queued on ``stream``."""
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if ``None``) on this stream; return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def __enter__(self) -> Stream:
        stack = _thread.__dict__.setdefault("entered", [])
        stack.append(current_stream())
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(_thread.entered.pop())


EVENTS_RECORDED: Counter[str] = Counter()
"""Events recorded so far, by the name of the thread that recorded them (clear it to count)."""


class Event:
    """Marks the work queued on a stream when it was recorded; never recorded: complete."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._stream: Stream | None = None
        self._target = 0

    def __repr__(self) -> str:
        return f"<simgpu.Event on {self._stream!r} target={self._target}>"

    def record(self, stream: Stream | None = None) -> None:
        """Mark all work queued so far on ``stream`` (``None``: the thread's current stream)."""
        stream = current_stream() if stream is None else stream
        if not isinstance(stream, Stream):
            raise TypeError(f"simgpu: Event.record needs a simgpu Stream, got {stream!r}")
        with _cond:
            self._stream, self._target = stream, stream._queued
            EVENTS_RECORDED[threading.current_thread().name] += 1

    def query(self) -> bool:
        """Whether the recorded work completed (no sync)."""
        if self._stream is None:
            return True
        self._stream._raise_error()
        with _cond:
            return self._stream._done >= self._target

    def synchronize(self) -> None:
        """Wait until the recorded work completed (a logged sync)."""
        _sync("Event.synchronize", drain=False)
        if self._stream is not None:
            self._stream._wait_for(self._target)

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (``None``: the current one) wait for this event."""
        (current_stream() if stream is None else stream).wait_event(self)

    def elapsed_time(self, end_event: Event) -> float:
        raise NotImplementedError("simgpu: events do not time anything")


_default_stream = Stream()


def default_stream(device: Any = None) -> Stream:
    """The stream every thread starts on."""
    _check_device(device)
    return _default_stream


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream (the default stream unless set)."""
    _check_device(device)
    return getattr(_thread, "stream", None) or _default_stream


def set_stream(stream: Stream) -> None:
    """Make ``stream`` the calling thread's current stream."""
    if not isinstance(stream, Stream):
        raise TypeError(f"simgpu: expected a simgpu Stream, got {stream!r}")
    _thread.stream = stream


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[Stream | None]:
    """Make ``stream`` current on the calling thread inside the block (``None``: no change)."""
    if stream is None:
        yield None
        return
    previous = current_stream()
    set_stream(stream)
    try:
        yield stream
    finally:
        set_stream(previous)


def synchronize(device: Any = None) -> None:
    """Wait for the work queued now on every stream (a logged sync)."""
    _check_device(device)
    _sync("synchronize", drain=False)
    with _cond:
        goals = [(s, s._queued) for s in _streams]
    for s, goal in goals:
        s._wait_for(goal)


def _poison(t: torch.Tensor) -> None:
    """Fill ``t``'s bytes with 0xFF."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(0xFF)
    else:
        filled = torch.empty(t.shape, dtype=t.dtype)
        filled.view(-1).view(torch.uint8).fill_(0xFF)
        t.copy_(filled)


def _defer_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``dst.copy_(src)`` on the current stream; ``dst`` is poisoned until it lands."""
    _forbid_in_capture("a copy between host and device")
    # Shape and dtype errors are raised now, as a launch would raise them.
    torch.empty_like(dst, device="meta").copy_(torch.empty_like(src, device="meta"))
    _poison(dst)
    target = current_stream()
    with _cond:
        delay = _delay_rng.uniform(0.0, _delay_max) if _delay_max else 0.0
        target._enqueue(_Copy(dst, src, time.monotonic() + delay))


# -- the tensor --------------------------------------------------------------------------------


class SimTensor(torch.Tensor):
    """A tensor on :data:`DEVICE` whose data is ``elem``, a CPU tensor of the same layout.

    Read ``elem`` (or :func:`peek`) in assertions only: it bypasses the sync log.
    """

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> SimTensor:
        if elem.device.type != "cpu" or isinstance(elem, SimTensor):
            raise TypeError(f"simgpu: the inner tensor must be a plain CPU tensor, not {elem!r}")
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=requires_grad,
        )
        self.elem = elem
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        _sync("repr")  # printing reads the values: a D2H copy on CUDA
        text = repr(self.elem)
        extra = f", device='{DEVICE}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return text[:-1] + extra + ")" if text.endswith(")") else text

    def tolist(self) -> Any:  # torch refuses subclasses; CUDA copies to the host first
        return self.cpu().tolist()

    def __format__(self, format_spec: str) -> str:  # torch formats plain tensors only
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return repr(self).__format__(format_spec)

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # torch moves the metadata, not ``elem``
        torch._C.TensorBase.data.__set__(self, value)
        self.elem = value.elem

    @classmethod
    def __torch_dispatch__(
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        if _is_sync(func, args, kwargs):
            _sync(str(func))
        return _run(func, args, kwargs)


def _is_sim(t: object) -> bool:
    return isinstance(t, SimTensor)


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, SimTensor) else t


def peek(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding device tensor ``t``'s data: no sync, no log (for assertions)."""
    if not isinstance(t, SimTensor):
        raise TypeError(f"simgpu: peek takes a device tensor, got {type(t).__name__}")
    return t.elem


_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
}
_BOOL_INDEXED = {  # data-dependent shapes when an index is a mask
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_MIXED_OK = {  # ops that accept CPU tensors beside device tensors on CUDA
    aten.copy_.default,
    aten._to_copy.default,
    aten.index.Tensor,
    aten._unsafe_index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index_put.default,
    aten.is_same_size.default,
    aten._has_compatible_shallow_copy_type.default,
}


def _is_sync(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in _SYNC_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    return False


def _check_devices(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Any) -> None:
    """Refuse CPU tensors (other than 0-dim ones) mixed with device tensors, as CUDA does."""
    if func in _MIXED_OK or func.namespace != "aten":
        return
    host: list[torch.Tensor] = []

    def visit(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not _is_sim(t) and t.dim() > 0 and t.is_cpu:
            host.append(t)
        return t

    tree_map(visit, (args, kwargs))
    if host:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{DEVICE} and cpu! (simgpu stand-in, in {func})"
        )


def _run(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on the inner tensors; wrap its results (unless asked for the CPU)."""
    _check_devices(func, args, kwargs)
    to_host = False
    if kwargs.get("device") is not None:
        to_host = torch.device(kwargs["device"]).type == "cpu"
        kwargs = {**kwargs, "device": CPU}
    if to_host:
        _forbid_in_capture(f"{func} to the host")
    originals = {}

    def unwrap(t: Any) -> Any:
        if isinstance(t, SimTensor):
            originals[id(t.elem)] = t
            return t.elem
        return t

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, SimTensor):
            return t
        original = originals.get(id(t))
        if original is not None:  # in-place and out= ops return their argument
            if original.shape != t.shape or original.stride() != t.stride():
                raise NotImplementedError(
                    f"simgpu: {func} changed the shape or strides of a device tensor in place "
                    "(resize_, an out= tensor of the wrong size, transpose_...): unsupported"
                )
            return original
        return t if to_host else SimTensor(t)

    return tree_map(wrap, out)


def _to_copy(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    src = args[0]
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "cpu":
        return _run(func, args, kwargs)  # a copy on the device
    non_blocking = bool(kwargs.get("non_blocking", False))
    rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
    if not non_blocking:
        _sync(f"d2h {func}")
        return aten._to_copy.default(src.elem, **rest)
    out = torch.empty_like(
        src.elem,
        dtype=rest.get("dtype") or src.dtype,
        memory_format=rest.get("memory_format") or torch.preserve_format,
    )
    _defer_copy(out, src.elem)
    return out


def _copy_(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if _is_sim(dst) and not _is_sim(src) and not non_blocking:
        _sync(f"h2d {func}")
    elif _is_sim(dst) and not _is_sim(src):
        _forbid_in_capture("a copy between host and device")
    elif not _is_sim(dst) and _is_sim(src):
        if non_blocking:
            _defer_copy(dst, src.elem)
            return dst
        _sync(f"d2h {func}")
    _unwrap(dst).copy_(_unwrap(src))
    return dst


_SPECIAL: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
}


# -- kernels for the PrivateUse1 key: factories and host-to-device copies -----------------------


def _factory(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run a factory asked for ``device=simgpu`` on the CPU and wrap what it returns."""
    if kwargs.get("device") is not None:
        kwargs["device"] = CPU
    if kwargs.get("pin_memory"):
        raise NotImplementedError(f"simgpu: {op} with pin_memory=True")
    out = op(*args, **kwargs)
    return tree_map(lambda t: SimTensor(t) if isinstance(t, torch.Tensor) else t, out)


def _host_to_device(
    src: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
    non_blocking: bool = False,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor:
    """``aten._to_copy`` of a CPU tensor to the device (``t.to(DEVICE)``, ``torch.tensor``)."""
    if _is_sim(src):  # reached with the Python key excluded: a copy on the device
        src = src.elem
    elif non_blocking:
        _forbid_in_capture("a copy between host and device")
    else:
        _sync("h2d aten._to_copy.default")
    copied = aten._to_copy.default(src, dtype=dtype, layout=layout, memory_format=memory_format)
    return SimTensor(copied)


_RESIZING_FACTORIES = (
    "arange",
    "range",
    "eye",
    "bartlett_window",
    "blackman_window",
    "hamming_window",
    "hann_window",
    "kaiser_window",
)
"""Factories that resize an empty tensor, or call CPU kernels directly: kernels of their own."""


# -- the device module -------------------------------------------------------------------------


_DISCOVERY = ("torch._utils", "torch.accelerator")
"""Torch's modules that pick "the available accelerator" by themselves (``DataParallel``...)."""


def is_available() -> bool:
    """True, except to torch's own device discovery (:data:`_DISCOVERY`).

    ``torch.nn.DataParallel``, ``torch.accelerator.is_available()`` and the like would
    otherwise move CPU-only tests in the same process onto the stand-in.
    """
    return sys._getframe(1).f_globals.get("__name__") not in _DISCOVERY


class device:  # the torch.cuda.device spelling
    """``torch.simgpu.device(d)``: a context manager that does nothing (one device)."""

    def __init__(self, device: Any) -> None:
        self.idx = 0

    def __enter__(self) -> device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _module_functions() -> dict[str, Any]:
    cpu_rng = torch.default_generator

    def get_rng_state(device: Any = NAME) -> torch.Tensor:
        return cpu_rng.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = NAME) -> None:
        cpu_rng.set_state(new_state)

    def manual_seed(seed: int) -> None:
        cpu_rng.manual_seed(int(seed))

    def seed() -> None:
        cpu_rng.seed()

    def set_device(device: Any) -> None:
        _check_device(device)

    return {
        "is_available": is_available,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "_lazy_init": lambda: None,
        "_is_in_bad_fork": lambda: False,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": set_device,
        "get_device_name": lambda device=None: "simgpu (a CPU stand-in)",
        "device": device,
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "synchronize": synchronize,
        "is_current_stream_capturing": is_current_stream_capturing,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        # Random ops run on the CPU, so the device's generator is the CPU's.
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [cpu_rng.get_state()],
        "set_rng_state_all": lambda states: cpu_rng.set_state(states[0]),
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": seed,
        "seed_all": seed,
        "initial_seed": lambda: cpu_rng.initial_seed(),
    }


def _factory_overloads() -> Iterator[torch._ops.OpOverload]:
    """The overloads of :data:`_RESIZING_FACTORIES` that take no tensor (not ``out=``)."""
    for name in _RESIZING_FACTORIES:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if not any(isinstance(a.type, torch.TensorType) for a in op._schema.arguments):
                yield op


def _factory_kernel(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _factory(op, *args, **kwargs)

    return kernel


def _fill_backend() -> tuple[torch.library.Library, torch.library.Library]:
    """Give ``torch.simgpu`` its functions and PrivateUse1 its kernels (first import only)."""
    for key, value in _module_functions().items():
        setattr(BACKEND, key, value)
    fallback = torch.library.Library("_", "IMPL")  # kept alive: registrations die with it
    fallback.fallback(_factory, "PrivateUse1")
    kernels = torch.library.Library("aten", "IMPL")
    kernels.impl("_to_copy", _host_to_device, "PrivateUse1")
    for op in _factory_overloads():
        kernels.impl(op, _factory_kernel(op), "PrivateUse1")
    # ``torch.autocast("simgpu")``: torch registers neither rules nor a fallthrough for
    # PrivateUse1's autocast key on a CPU build; let every op through, uncast.
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    return fallback, kernels


if _FIRST_IMPORT is None:
    _LIBRARIES = _fill_backend()
else:
    sys.modules[__name__] = _FIRST_IMPORT


# -- moving tensors and modules ----------------------------------------------------------------


def to_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``t`` on :data:`DEVICE`: a leaf, keeping ``requires_grad``.

    Not logged (set-up); ``t.to(DEVICE)`` is the logged way (a blocking H2D copy).
    """
    if _is_sim(t):
        raise TypeError("simgpu: to_device takes a CPU tensor")
    return SimTensor(t.detach().clone(), requires_grad=t.requires_grad)


def to_device_module(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module``'s parameters and buffers to :data:`DEVICE` in place; return it.

    Parameters stay the same Python objects (``torch.utils.swap_tensors``), so an optimizer
    made before (with no state yet) or after sees them.  Not logged (set-up).
    """
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with LOG.paused():
            return module._apply(lambda t: t if _is_sim(t) else to_device(t))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
