"""A pool of reusable buffers for blocks read from files."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["BufferPool"]


class BufferPool:
    """Reusable memory for blocks read from files.

    Fresh memory costs the kernel a page fault per 4 KiB; reading gigabytes
    into new arrays can take longer than the read itself.  A pool hands out
    arrays carved from buffers that earlier blocks gave back.  Thread-safe.

    Example:
        ```python
        pool = BufferPool()
        block = view.read(rows, shape, pool)
        ...
        pool.give(block)
        ```
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype`, from a free buffer when one fits."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if buffer is None:
            buffer = np.empty(max(nbytes, 1), np.uint8)
        array = buffer[:nbytes].view(dtype).reshape(shape)
        with self._lock:
            self._lent[id(array)] = buffer
        return array

    def give(self, array: np.ndarray) -> None:
        """Return an array from `take` (anything else is ignored)."""
        with self._lock:
            buffer = self._lent.pop(id(array), None)
            if buffer is not None:
                self._free.append(buffer)
