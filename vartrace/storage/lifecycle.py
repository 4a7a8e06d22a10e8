"""A saver's file from creation to close: opening, the caches, failed writes and recovery.

Example:
    ```python
    handle, created = open_for_writing(path, overwrite=False, append=True, create=create)
    last = None if created else last_tags(handle)  # appended records continue these
    size_metadata_cache(handle)
    handle.swmr_mode = True
    ...
    with interrupts_held():  # Ctrl-C waits for the write
        ...
    shrink_metadata_cache(handle)
    handle.close()
    ```

`open_for_writing` replaces, continues or creates the file (`create_file`); an
existing one is refused while its writer still runs.  A killed writer leaves a
consistent file whose superblock still says "open for writing": `recover`
clears that.  A write that fails (a full disk) ends the file
(`close_after_failure`), which keeps what it held, readable.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # CPython's: no enum conversion a call
import contextlib
import errno
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vartrace._support.warnings import warn
from vartrace._version import __version__
from vartrace.storage.files import leading_rows, open_file
from vartrace.storage.filters import STR
from vartrace.storage.guard import RunFileError, file_name
from vartrace.storage.layout import (
    FORMAT_ATTR,
    LAST_TAGS,
    LIBVER,
    TAGGED,
    TAGS,
    clear_write_flags,
    escape,
    has_write_flags,
    node_attrs,
    node_shard_path,
    run_attrs,
    shard_path,
    writer_alive,
)
from vartrace.storage.root_index import RootIndex
from vartrace.storage.root_rows import committed_counts, site_slots
from vartrace.storage.site_writer import CACHE_BYTES, int64
from vartrace.storage.swmr import open_swmr
from vartrace.trace import RunContext, Trace

__all__ = [
    "close_after_failure",
    "create_file",
    "idle_error",
    "interrupts_held",
    "last_tags",
    "open_for_writing",
    "os_error",
    "recover",
    "shift_past",
    "shrink_metadata_cache",
    "size_metadata_cache",
    "written_path",
]

#: The largest iteration or capture order an appended file may hold: the records of a
#: session of 2**62 more still fit in int64.
_LARGEST_TAG = 1 << 62

# HDF5's metadata cache of the file (bytes it starts at, least, most: HDF5's own ceiling).
# With HDF5's default cache (2 MiB at first) SWMR mode fails ("Child entry doesn't have a
# flush dependency parent array") once a few hundred sites are open while new ones are
# created: an eviction bug that a cache holding the open objects' metadata does not meet.
_METADATA_CACHE = (64 << 20, 32 << 20, 128 << 20)
_CLOSING_CACHE = 1 << 20  # bytes of it that a closing file keeps (see shrink_metadata_cache)
# Hash slots of each open dataset's chunk cache (of CACHE_BYTES): few, as each of HDF5's
# default 521 costs memory in every open dataset.
_CACHE_SLOTS = 17
# Chunks of 4 KiB and more start at a multiple of 64 bytes in the file (a cache line; under
# 2% more bytes): a reader's memory map then sees aligned arrays, which numpy reduces in
# place, where it copies unaligned ones piece by piece through a buffer first.
_FILE_OPTIONS = {
    "libver": LIBVER,
    "rdcc_nbytes": CACHE_BYTES,
    "rdcc_nslots": _CACHE_SLOTS,
    "alignment_threshold": 4 << 10,
    "alignment_interval": 64,
}


def open_for_writing(
    path: Path, *, overwrite: bool, append: bool, create: Callable[[Path], h5py.File]
) -> tuple[h5py.File, bool]:
    """The file a saver writes and whether `create` created it: `path` replaced
    (`overwrite`, unless its writer still runs), continued (`append`: a vartrace file
    this version can continue) or created; `FileExistsError` if it exists otherwise."""
    if path.exists() and overwrite:
        # replacing a live run's file would lose that run
        _refuse_live_writer(path, by_saver=True)
        path.unlink()
    if path.exists() and not append:
        raise FileExistsError(
            errno.EEXIST,
            "the file exists; pass overwrite=True to replace it or append=True to "
            "continue it (it was left untouched)",
            str(path),
        )
    if path.exists():
        _check_appendable(path)
        return h5py.File(path, "r+", **_FILE_OPTIONS), False
    return create(path), True


def create_file(
    path: Path, version: int, context: RunContext, meta: Mapping[str, Any] | None
) -> h5py.File:
    """Create the file `path` (`FileExistsError` if it exists) of format `version` for the
    run of `context`: its root attributes, `/vars`, the empty root index and, unless
    `None`, the metadata `meta` under `/meta`."""
    handle = h5py.File(path, "x", **_FILE_OPTIONS)
    handle.attrs[FORMAT_ATTR] = version
    handle.attrs["vartrace_version"] = __version__
    if context.node is None:
        attrs = run_attrs(path, context.rank, context.world_size, context.sharded)
    else:
        attrs = node_attrs(
            path, context.node, context.nodes, context.node_ranks, context.world_size
        )
    handle.attrs.update(attrs)
    handle.create_group("vars")
    RootIndex.create(handle)
    if meta is not None:
        _write_tree(handle.create_group("meta"), meta)
    return handle


def _text(value: str) -> str:
    """`value` as an HDF5 UTF-8 string can hold it (NULs and undecodable bytes escaped)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")


def _write_tree(group: h5py.Group, tree: Mapping[str, Any]) -> None:
    """Store a nested dict of str / numbers / bools / str lists as datasets under `group`."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _write_tree(group.create_group(escape(key)), value)
        elif isinstance(value, str):
            group.create_dataset(escape(key), data=_text(value), dtype=STR)
        elif isinstance(value, (list, tuple)):
            rows = [_text(item) for item in value]
            group.create_dataset(escape(key), data=rows, shape=(len(rows),), dtype=STR)
        else:
            group.create_dataset(escape(key), data=value)


# Set with WORLD_SIZE by launchers (torchrun, accelerate, Lightning's DDP) before
# torch.distributed starts.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def written_path(path: Path, context: RunContext) -> Path | None:
    """The file a saver given `path` writes on this rank of the run of `context`; `None`
    where another rank writes the records this rank gathers to it.

    `gather=False`: each rank its shard (`run.rank3.h5`); `gather="node"`: each node's
    first rank the node's shard (`run.node1.h5`, beside `path` on that node's own disk);
    otherwise rank 0 `path`.
    """
    if context.sharded:
        return shard_path(path, context.rank)
    if context.node is not None:
        first = context.node_ranks[0] if context.node_ranks else context.rank
        return node_shard_path(path, context.node) if context.rank == first else None
    if context.rank != 0 or (context.world_size == 1 and _launched_as_other_rank()):
        return None
    return path


def idle_error(path: Path, context: RunContext) -> RuntimeError:
    """The error for records handed to the saver of a rank that `written_path` left idle."""
    rank = f"rank {context.rank}"
    if context.node is not None:
        return RuntimeError(
            f"H5PYSaverCallback for {path} received records on {rank} of node {context.node} "
            f"of a run gathered per node, where only the node's first rank "
            f"({context.node_ranks[0]}) writes"
        )
    if context.world_size == 1:
        rank = (
            "a process that its launcher started as a rank other than 0 (RANK / "
            "LOCAL_RANK / NODE_RANK, WORLD_SIZE), with no torch.distributed group to "
            "gather to"
        )
    return RuntimeError(
        f"H5PYSaverCallback for {path} received records on {rank} of a gathered "
        "run, where only rank 0 writes"
    )


def _launched_as_other_rank() -> bool:
    """Whether a launcher started this process as a rank other than 0 of several, whose
    process group is not initialised yet (a tracer around Lightning's `trainer.fit`, which
    initialises it inside): the file is rank 0's to create, and this process must not
    touch it."""
    if not _number(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    return any(_number(os.environ.get(name, "0")) > 0 for name in _RANK_VARIABLES)


def _number(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


def interrupts_held() -> AbstractContextManager[object]:
    """Hold Ctrl-C (SIGINT) back while the file is written, then raise it at the end.

    A `KeyboardInterrupt` raised inside a write lands wherever Python code runs
    next, often in a weakref callback of h5py's objects, where Python ignores it
    ("Exception ignored in ... KeyboardInterrupt"): training would go on, and a
    write cut short could leave the file's records half written.  So the signal
    is noted and the previous handler called once the write is complete.  Only on
    the main thread (where signal handlers run) and where a Python handler is set.
    """
    if threading.current_thread() is not threading.main_thread():
        return _NOT_HELD
    # `_signal`'s functions, not `signal`'s: those convert the handlers to and from enums
    # (a ValueError caught for each function handler), most of a hold's cost.
    previous = _signal.getsignal(signal.SIGINT)
    return _Held(previous) if callable(previous) else _NOT_HELD


_NOT_HELD = contextlib.nullcontext()


class _Held:
    """A hold of SIGINT (see `interrupts_held`): a class, not a generator, as it is taken
    for each call of a saver."""

    __slots__ = ("_frames", "_previous")

    def __init__(self, previous: Callable[[int, Any], Any]) -> None:
        self._previous = previous
        self._frames: list[Any] = []  # the frame of each SIGINT held

    def __enter__(self) -> None:
        _signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self._frames.append(frame)

    def __exit__(self, *exc: object) -> None:
        _signal.signal(signal.SIGINT, self._previous)
        if self._frames:
            self._previous(signal.SIGINT, self._frames[0])


_HDF5_OS_ERROR = re.compile(r"errno = (\d+), error message = '([^']*)'")


def os_error(error: Exception) -> tuple[int, str] | None:
    """`(errno, message)` of the operating-system failure behind an HDF5 write error."""
    found = _HDF5_OS_ERROR.search(str(error))
    if found is not None:
        return int(found.group(1)), found.group(2)
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return error.errno, os.strerror(error.errno)
    return None


def size_metadata_cache(handle: h5py.File) -> None:
    """Give `handle` the metadata cache of `_METADATA_CACHE` (holds many open sites)."""
    config = handle.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size, config.min_size, config.max_size = _METADATA_CACHE
    handle.id.set_mdc_config(config)


def shrink_metadata_cache(handle: h5py.File) -> None:
    """Evict what `handle`'s metadata cache holds beyond `_CLOSING_CACHE` bytes, once the
    file is flushed and its sites closed, before the file is closed.

    HDF5 empties the cache at the close in passes that start over after each entry
    whose eviction takes others along: time quadratic in the entries (4,000 sites: 4 s
    for the close, 0.2 s after this).  Evicting clean entries to make room is linear:
    the smaller size takes effect at the next metadata access, the root's attribute read.
    """
    config = handle.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size = config.min_size = config.max_size = _CLOSING_CACHE
    handle.id.set_mdc_config(config)
    handle.attrs.get(FORMAT_ATTR)


def _claimed_size(handle: h5py.File) -> int:
    """The size HDF5 believes the file has (its superblock may already say so)."""
    try:
        return int(handle.id.get_filesize())
    except Exception:
        return 0


def close_after_failure(handle: h5py.File, path: Path, close_objects: Callable[[], None]) -> None:
    """Close `handle` after a failed write, its objects closed by `close_objects`, without
    writing to `path`: it keeps what it held, readable."""
    size = _claimed_size(handle)
    _discard_writes(handle)
    close_objects()
    with contextlib.suppress(Exception):
        handle.close()
    _pad_to(path, size)


def _pad_to(path: Path, size: int) -> None:
    """Extend `path` to `size` bytes with a hole (no disk space taken), so that HDF5,
    which refuses a file shorter than its superblock records, opens it."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) < size:
            os.truncate(path, size)


def _discard_writes(handle: h5py.File) -> None:
    """Send every later write of `handle` to the null device (its file keeps what it holds)."""
    try:
        fd = handle.id.get_vfd_handle()
        null = os.open(os.devnull, os.O_RDWR)
    except (AttributeError, OSError, TypeError, ValueError, RuntimeError):
        return  # not a plain file descriptor: the close is attempted as it is
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def last_tags(handle: h5py.File) -> tuple[int, int] | None:
    """The largest committed iteration and capture order of an open file; `None` if empty.

    Read from the root's `last_tags` where its sum of record counts is `/committed`'s
    (written before the counts, it is ahead of them after a killed flush; a writer
    without it may have appended since), else from every site's tags.  Tags so large
    that appended records would pass int64's largest are a `RunFileError`.
    """
    counts = committed_counts(handle)
    held = np.asarray(handle.attrs.get(LAST_TAGS, np.zeros(3, np.int64) - 1))
    if held.shape != (3,) or held.dtype.kind != "i":  # (rewritten at each flush: as 3 integers)
        raise RunFileError(
            f"{file_name(handle.id)}: the root attribute {LAST_TAGS} is not 3 integers: "
            "a damaged file"
        )
    if int(held[2]) == int(counts.sum()):
        last = (int(held[0]), int(held[1])) if held[2] else None
    else:
        last = _walked_tags(handle, counts)
    if last is not None and max(last) > _LARGEST_TAG:
        raise RunFileError(
            f"{file_name(handle.id)} holds iteration {last[0]} and capture order {last[1]}: "
            f"records appended after them would pass int64's largest: a damaged file"
        )
    return last


def _walked_tags(handle: h5py.File, counts: np.ndarray) -> tuple[int, int] | None:
    """The largest committed iteration and capture order of every site's tags."""
    found: list[tuple[int, int]] = []
    sites = handle["vars"]
    for link, slot in site_slots(handle, counts).items():
        rows = int(counts[slot]) if slot < len(counts) else 0
        if not rows:
            continue
        group = sites[link]
        if TAGGED in group:
            tags = leading_rows(group, TAGGED, rows)
            iterations, order = tags[:, TAGS.index("iterations")], tags[:, TAGS.index("order")]
        else:
            iterations, order = (
                leading_rows(group, "iterations", rows),
                leading_rows(group, "order", rows),
            )
        found.append((int(np.max(iterations)), int(np.max(order))))
    if not found:
        return None
    return max(i for i, _ in found), max(o for _, o in found)


def shift_past(path: Path, last: tuple[int, int], trace: Trace) -> tuple[int, int]:
    """What is added to the (iterations, capture order) of the records appended to `path`,
    whose largest committed ones are `last`, so that they continue the file's: decided by
    the first records appended, `trace` (see `H5PYSaverCallback._continued`)."""
    last_iteration, last_order = last
    first = int(int64(trace.iterations).min())
    moved = last_iteration - first + 1 if first <= last_iteration else 0
    if moved:
        warn(
            f"vartrace: {path} already holds iterations up to {last_iteration} and "
            f"the appended records start at iteration {first}: they are stored as "
            f"iterations {first + moved}, ... To number them yourself, call "
            "tracer.set_iteration(step) each step",
            stacklevel=3,
        )
    first_order = int(int64(trace.order).min())
    orders = last_order - first_order + 1 if first_order <= last_order else 0
    return moved, orders


def _check_appendable(path: Path) -> None:
    """Raise unless `path` is a vartrace file this version can continue (a damaged one is a
    `RunFileError`, the file left unchanged); recover a crash."""
    open_file(path).close()
    _refuse_live_writer(path, by_saver=True)
    with open_file(path) as handle:  # what the append reads, checked as the reader checks it
        RootIndex.check(handle)
        last_tags(handle)
    recover(path, force=True)  # (checked above, with advice a saver's user can follow)


def recover(path: str | os.PathLike[str], *, force: bool = False) -> bool:
    """Make a file left by a killed writer openable by plain h5py (`h5clear -s`).

    A writer killed mid-run leaves a consistent file whose superblock still says
    "open for writing": `vartrace.open` and `h5py.File(path, "r", swmr=True)`
    read it as is, plain `h5py.File(path)` refuses it until this is called.
    It refuses while the recorded writer process still runs on this host, and
    when the writer ran on another host unless `force=True`.  Returns whether
    flags were cleared.  Example:

    ```python
    vartrace.storage.recover("run.h5")
    h5py.File("run.h5")
    ```
    """
    path = Path(path)
    if not has_write_flags(path):
        return False
    if not force:
        _refuse_live_writer(path)
    return clear_write_flags(path)


def _refuse_live_writer(path: Path, *, by_saver: bool = False) -> None:
    """Raise `OSError(EBUSY)` unless the writer that left `path` open for writing is gone.

    A file whose superblock does not say "open for writing" passes.  The message says
    what to do: for `recover`, pass `force=True`; for a saver (`by_saver`,
    which has no such option), wait for or stop the writer, write to another path, or
    clear the flag with `recover(path, force=True)` once the writer is known gone.
    """
    if not has_write_flags(path):
        return
    if by_saver:
        busy = "; wait for it to end or stop it, or write to another path"
        unknown = (
            "; once no process writes the file, vartrace.storage.recover(path, force=True) "
            "marks it closed, or write to another path"
        )
    else:
        busy, unknown = "", "; pass force=True once no process writes the file"
    try:
        with open_swmr(path) as handle:
            host = str(handle.attrs.get("writer_host", ""))
            pid = int(handle.attrs.get("writer_pid", -1))
    except OSError:
        raise OSError(
            errno.EBUSY,
            "the writer left the file outside SWMR mode, so whether it still runs cannot "
            f"be told{unknown}",
            str(path),
        ) from None
    alive = writer_alive(host, pid)
    if alive is not False:
        where = (
            f"still runs{busy}"
            if alive
            else f"ran on host {host!r}, so whether it still runs cannot be told{unknown}"
        )
        raise OSError(errno.EBUSY, f"the writer process {pid} {where}", str(path))
