"""Giving the memory of large written records back to the system (glibc's `malloc_trim`).

glibc's allocator serves a block above its mmap threshold with `mmap` and returns
it at `free`, but the threshold rises to the size of each such block freed (up to
32 MiB): from the second chunk of 10-100 MB records on, the copies come from the
heap, stay there once freed, and the holes they leave do not fit the next
chunk's records beside the model's own tensors.  The process then grows by most
of a chunk a gather.  After a gather that freed many bytes, `malloc_trim(0)`
hands the free pages back; elsewhere (musl, macOS, Windows) nothing is done.

Example:
    ```python
    release(freed=chunk_bytes)  # after the chunk's records were written and dropped
    ```
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

__all__ = ["TRIM_ABOVE", "release"]

#: A gather that freed at least this many bytes gives the free pages back.
TRIM_ABOVE = 64 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or `None` where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl: no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release(freed: int) -> bool:
    """Give free heap pages back to the system after `freed` bytes of records went.

    Returns whether it did (`freed` at least `TRIM_ABOVE`, on glibc).
    """
    if freed < TRIM_ABOVE:
        return False
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
