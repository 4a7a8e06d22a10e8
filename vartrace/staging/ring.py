"""Host memory for records leaving an accelerator: allocated once, reused, never copied out.

A `HostRing` owns a few large host segments (pinned where the device
can pin, ordinary memory where it cannot: the stand-in device of the tests
runs the same code).  A record's host copy is a *slot*, a byte range of a
segment, handed out as a zero-copy tensor view.  The slot returns to the ring
when the last tensor (or numpy array) viewing it dies, whoever holds it: the
saver writing it, a background writer, a user's callback, the tracer's
`results`.  So no record is copied out of the ring to be kept, and no record's
memory is freed while something still reads it.

Segments come in on demand, up to `capacity` bytes; a record that finds no
room gets ordinary memory of its own (counted as an overflow), so the staging
thread never waits for a consumer that itself waits behind it.

Example:
    ```python
    ring = HostRing(capacity=1 << 30, pin=True)
    host = ring.tensor((1024, 768), torch.bfloat16)   # a view of a pinned slot
    host.copy_(device_tensor, non_blocking=True)
    del host                                          # the slot is free again
    ```
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["HostRing"]

_ALIGN = 256  # bytes: every slot starts at a multiple of this
_SEGMENT = 256 << 20  # bytes of one segment, unless the capacity is smaller
_BOOKKEEPING = 64 << 10  # bytes of the segment of the stager's own small tensors


class _Segment:
    """One host buffer, and its free byte ranges (sorted, disjoint, coalesced)."""

    __slots__ = ("array", "free_ends", "free_starts")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # bytes of a host tensor (a numpy view holds the tensor)
        self.free_starts = [0]
        self.free_ends = [array.nbytes]

    def take(self, size: int) -> int | None:
        """The offset of `size` free bytes (first fit), now taken; `None` when none."""
        for index, (start, end) in enumerate(zip(self.free_starts, self.free_ends, strict=True)):
            if end - start >= size:
                if end - start == size:
                    del self.free_starts[index], self.free_ends[index]
                else:
                    self.free_starts[index] = start + size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        """Return `[start, start + size)`, merging it with its free neighbours."""
        end = start + size
        index = bisect.bisect_left(self.free_starts, start)
        starts, ends = self.free_starts, self.free_ends
        if index < len(starts) and starts[index] == end:  # merges with the range after
            end = ends[index]
            del starts[index], ends[index]
        if index and ends[index - 1] == start:  # merges with the range before
            ends[index - 1] = end
        else:
            starts.insert(index, start)
            ends.insert(index, end)


class HostRing:
    """Host slots for records, out of segments allocated once (see the module's docstring).

    Args:
        capacity: the most bytes of segments the ring allocates.
        pin: page-lock the segments (`torch.empty(..., pin_memory=True)`); where
            the build or the device cannot, the segments are ordinary memory.

    Attributes:
        pinned: whether the segments are pinned (`None` before the first one).
        used: bytes of slots in use now; `peak`: the most at once.
        overflows: records that found no room and got memory of their own.

    The stager's own small tensors (a batch's change flags) take slots of a segment of
    their own (`bookkeeping`), beside `capacity`: where they took a record's room, a ring
    holding exactly the records its capacity was sized for would overflow.
    """

    def __init__(self, capacity: int, *, pin: bool = True) -> None:
        self.capacity = capacity
        self.pinned: bool | None = None if pin else False
        self.used = 0
        self.peak = 0
        self.overflows = 0
        self._segment_bytes = max(_ALIGN, min(_SEGMENT, capacity))
        self._segments: list[_Segment] = []
        self._bookkeeping: _Segment | None = None
        self._allocated = 0
        self._lock = threading.Lock()  # slots return on whatever thread drops the last view

    def tensor(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape` and `dtype`: a slot's view, or, when
        the ring is full, a tensor of its own (an overflow)."""
        nbytes, size = _sizes(shape, dtype)
        if not nbytes:
            return torch.empty(shape, dtype=dtype)  # no bytes to hold
        with self._lock:
            place = self._take(size)
            if place is None:
                self.overflows += 1
            else:
                self.used += size
                self.peak = max(self.peak, self.used)
        if place is None:
            return torch.empty(shape, dtype=dtype)
        segment, start = place
        return self._slot(segment, start, size, nbytes, shape, dtype, counted=True)

    def bookkeeping(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised small host tensor of the stager's own (a batch's change flags):
        a slot of a segment of `_BOOKKEEPING` bytes beside the records' capacity, so that
        it never takes a record's room; from the records' segments (`tensor`) when that
        one has no room for it."""
        nbytes, size = _sizes(shape, dtype)
        with self._lock:
            segment = self._bookkeeping or self._with_bookkeeping(0)[1]
            start = segment.take(size) if nbytes else None
        if start is None:
            return self.tensor(shape, dtype)
        return self._slot(segment, start, size, nbytes, shape, dtype, counted=False)

    def _slot(
        self,
        segment: _Segment,
        start: int,
        size: int,
        nbytes: int,
        shape: Any,
        dtype: torch.dtype,
        *,
        counted: bool,
    ) -> torch.Tensor:
        """The tensor viewing the slot `[start, start + size)` of `segment`, taken; it
        returns when the tensor's last view dies (`counted`: out of `used`)."""
        # A numpy view of its own per slot: when the last tensor built on it dies, so does
        # it, and its finalizer returns the slot.
        window = segment.array[start : start + nbytes]
        weakref.finalize(window, self._give, segment, start, size, size if counted else 0)
        return torch.from_numpy(window).view(dtype).view(shape)

    def _take(self, size: int) -> tuple[_Segment, int] | None:
        for segment in self._segments:
            start = segment.take(size)
            if start is not None:
                return segment, start
        grow = max(self._segment_bytes, size)
        if self._allocated + grow > self.capacity:
            return None
        segment = _Segment(self._with_bookkeeping(grow)[0])
        self._segments.append(segment)
        self._allocated += grow
        start = segment.take(size)
        assert start == 0
        return segment, start

    def _with_bookkeeping(self, nbytes: int) -> tuple[np.ndarray, _Segment]:
        """`nbytes` of new host memory, and the bookkeeping segment: the first call
        allocates it in the same buffer, after the `nbytes` (one allocation)."""
        if self._bookkeeping is not None:
            return self._allocate(nbytes).numpy(), self._bookkeeping
        buffer = self._allocate(nbytes + _BOOKKEEPING).numpy()
        self._bookkeeping = _Segment(buffer[nbytes:])
        return buffer[:nbytes], self._bookkeeping

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pinned is not False:
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no pinning in this build or for this device
                self.pinned = False
            else:
                self.pinned = True
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give(self, segment: _Segment, start: int, size: int, used: int) -> None:
        with self._lock:
            segment.give(start, size)
            self.used -= used


def _sizes(shape: Any, dtype: torch.dtype) -> tuple[int, int]:
    """The bytes of a tensor of `shape` and `dtype`, and of its slot (whole `_ALIGN`s)."""
    nbytes = _numel(shape) * dtype.itemsize
    return nbytes, max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def _numel(shape: Any) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
