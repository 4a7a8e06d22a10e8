"""Host memory of large records under glibc: blocks of their own, and freed pages given back.

glibc's allocator serves a block above its mmap threshold with `mmap` and returns
it at `free`, but the threshold rises to the size of each such block freed (up to
32 MiB): from the second chunk of 10-100 MB records on, the copies come from the
heap, stay there once freed, and the holes they leave do not fit the next
chunk's records beside the model's own tensors.  The process then grows by most
of a chunk a gather.  After a gather that freed many bytes, `malloc_trim(0)`
hands the free pages back; elsewhere (musl, macOS, Windows) nothing is done.

The heap also makes the peak grow while a chunk fills.  torch allocates with
`posix_memalign`, which asks glibc for a block a little larger than the tensor
and hands the rest to the next small allocations: the hole a freed tensor leaves
never fits the next tensor of its size.  Once a step keeps anything (a record and
its tensor object) while its own 30 MiB output is alive, every step's output lands
on fresh pages, and the process peaks near twice the chunk, though the untraced
step reuses one block in place.  So the first record of `MAP_FROM` bytes or more
(`map_large_blocks`) fixes glibc's mmap threshold at `MAP_FROM` for the rest of
the process: such blocks (records, and the step's own tensors that large) get a
mapping of their own, unmapped when freed, as glibc does anyway above 32 MiB.

Example:
    ```python
    map_large_blocks()          # a record of 30 MiB is about to be copied
    release(freed=chunk_bytes)  # after the chunk's records were written and dropped
    ```
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vartrace._support.native import load

__all__ = [
    "MAP_FROM",
    "TRIM_ABOVE",
    "build_memcmp",
    "held_bytes",
    "map_large_blocks",
    "memcmp",
    "release",
]

#: A gather that freed at least this many bytes gives the free pages back.
TRIM_ABOVE = 64 << 20
#: Blocks of at least this many bytes get mappings of their own once a record is as large.
MAP_FROM = 8 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


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


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's `memcmp`, where ctypes can reach it (not on Windows)."""
    try:
        function = ctypes.CDLL(None).memcmp
    except (OSError, TypeError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return function  # type: ignore[no-any-return]


#: `memcmp(address_a, address_b, nbytes)` of the C library (0: the bytes are equal), or
#: `None` where there is none to call.  It stops at the first differing byte, and other
#: threads run meanwhile.  Through ctypes until `build_memcmp`; read it as `memory.memcmp`.
memcmp = _libc_memcmp()
#: `memcpy(destination, source, nbytes)` of the C library through the compiled module, or
#: `None` where it cannot be built (then torch copies); read it as `memory.memcpy`.
memcpy: Callable[[int, int, int], None] | None = None
_memcmp_built = False


def build_memcmp() -> None:
    """Call `memcmp` through the compiled module `bytes.c` from now on (about a tenth of
    ctypes' instructions a call; built first where no build is cached, see
    `vartrace._support.native`), and `memcpy` with it, where it can be built: before
    any step compares."""
    global memcmp, memcpy, _memcmp_built
    if not _memcmp_built:
        _memcmp_built = True
        module = load(Path(__file__).with_name("bytes.c"), "vartrace_bytes")
        if module is not None:
            memcmp, memcpy = module.memcmp, module.memcpy


@functools.cache
def map_large_blocks() -> bool:
    """Make glibc serve every block of `MAP_FROM` bytes or more with a mapping of its own.

    Called before copying a record that large; the first call sets glibc's mmap
    threshold (for the rest of the process), later ones cost a cache lookup.
    Returns whether it did: on glibc, unless the user chose a threshold of their own
    (`MALLOC_MMAP_THRESHOLD_` in the environment, read by glibc at start).
    """
    if _malloc_trim() is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MAP_FROM))


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


def held_bytes(values: Any) -> int:
    """The bytes of the records `values` holds (a list of records, or one stacked tensor
    or array): dense tensors and arrays; sparse and nested tensors, and other values,
    count 0."""
    torch = sys.modules.get("torch")
    if isinstance(values, np.ndarray) or (torch is not None and isinstance(values, torch.Tensor)):
        return _dense_bytes(values)
    plain, strided = (torch.Tensor, torch.strided) if torch is not None else (None, None)
    total = 0
    for value in values:  # a loop, not sum() of a generator: a call less a record
        if type(value) is plain and value.layout is strided and not value.is_nested:
            total += value.nbytes  # the common record, a plain dense tensor
        else:
            total += _dense_bytes(value)
    return total


def _dense_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and not value.is_nested
    ):
        return int(value.nbytes)
    return 0
