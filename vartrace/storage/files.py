"""Opening run files safely and reading their small pieces: signatures, retries on a live
writer, format version, /meta, filters, and the integer and text attributes of sites.

Every read here is bounded (see `_guard`): a damaged or crafted file raises
`RunFileError` (or `ValueError` for a file that is no vartrace file) rather than
hanging, crashing or reading without end.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import math
import os
import time
from pathlib import Path
from stat import S_ISBLK, S_ISCHR, S_ISDIR, S_ISFIFO, S_ISREG, S_ISSOCK
from typing import Any

import h5py
import numpy as np

from vartrace.storage.guard import (
    FREE_READ_BYTES,
    RunFileError,
    check_link,
    check_read,
    check_storage,
    file_name,
    open_object,
)
from vartrace.storage.layout import (
    FORMAT_ATTR,
    FORMAT_VERSION,
    SIGNATURE,
    TAGGED,
    has_write_flags,
    unescape,
)
from vartrace.storage.swmr import open_swmr

__all__ = [
    "checked_version",
    "int_attr",
    "leading_rows",
    "load_filters",
    "open_file",
    "read_tree",
    "text_attr",
    "too_few",
]

_OPEN_TRIES = 5  # opening a file a live writer is flushing: tries, this far apart
_OPEN_PAUSE_S = 0.1


def _missing(path: Path) -> FileNotFoundError:
    shards = sorted(glob.glob(glob.escape(str(path.with_name(path.stem))) + ".rank*" + path.suffix))
    hint = f"; shards of a sharded run exist: open {path.stem}.rank*{path.suffix}" if shards else ""
    return FileNotFoundError(errno.ENOENT, f"no such run file{hint}", str(path))


def _has_signature(path: Path) -> bool:
    """Whether an HDF5 superblock signature starts the file or a user block's end."""
    size = path.stat().st_size
    offsets = [0, *(512 << k for k in range(40) if (512 << k) < size)]
    with open(path, "rb") as handle:
        for offset in offsets:
            handle.seek(offset)
            if handle.read(len(SIGNATURE)) == SIGNATURE:
                return True
    return False


def _open_hdf5(path: Path) -> h5py.File:
    """`path` opened read-only: plainly, else in SWMR mode (a running or killed writer's).

    A running writer may be mid-flush, its file's end not yet written out: such a
    file is retried a few times before it is called damaged.
    """
    plain: OSError | None = None
    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        plain = error
    else:
        if not handle.id.get_intent() & h5py.h5f.ACC_SWMR_READ:
            return handle
        handle.close()  # it shares a live run's earlier handle, and its view: see open_swmr
    # Only a file a writer holds (or held when killed) is worth SWMR mode, where HDF5 retries
    # each unreadable piece of the file (see open_swmr).
    tries = _OPEN_TRIES if plain is None or has_write_flags(path) else 0
    swmr = plain
    for attempt in range(tries):
        if attempt:
            time.sleep(_OPEN_PAUSE_S)
        try:
            return open_swmr(path)
        except OSError as error:
            swmr = error
    plain = plain or swmr
    if "already open for write" in str(plain):
        raise OSError(
            errno.EBUSY,
            "a process holds the file open for writing outside SWMR mode, or was killed "
            "then; once no process writes it, vartrace.storage.recover(path, force=True) "
            f"makes it readable ({swmr})",
            str(path),
        ) from None
    if _has_signature(path):
        raise ValueError(f"{path} is a damaged HDF5 file: {plain}") from None
    raise ValueError(f"{path} is not a vartrace file: not an HDF5 file ({plain})") from None


#: What a path that is not a regular file is, for the error refusing it.
_NOT_FILES = (
    (S_ISDIR, "a directory"),
    (S_ISFIFO, "a named pipe (FIFO)"),
    (S_ISSOCK, "a socket"),
    (S_ISCHR, "a character device"),
    (S_ISBLK, "a block device"),
)


def open_file(path: str | os.PathLike[str]) -> h5py.File:
    """Open one vartrace file read-only with h5py, checking its format version.

    A file whose writer is running or was killed is opened in SWMR mode.
    Raises `ValueError` naming the path for a file that is not a vartrace
    file or was written by a newer vartrace.
    """
    path = Path(path)
    if not path.exists():
        raise _missing(path)
    mode = path.stat().st_mode
    if not S_ISREG(mode):  # a FIFO would block the open until something writes to it
        what = next((name for test, name in _NOT_FILES if test(mode)), "no regular file")
        raise ValueError(f"{path} is not a vartrace file: it is {what}, not a regular file")
    return checked_version(_open_hdf5(path), path)


def checked_version(handle: h5py.File, path: str | os.PathLike[str]) -> h5py.File:
    """`handle`, the file at `path` just opened, once its format version is one this
    vartrace reads; else it is closed and `ValueError` (`RunFileError`) names `path`."""
    try:
        version = handle.attrs.get(FORMAT_ATTR)
    except KeyError as error:  # the root group's header is damaged
        handle.close()
        raise RunFileError(f"{path} is a damaged HDF5 file: {error.args[0]}") from None
    if not isinstance(version, (int, np.integer)):
        handle.close()
        what = "no" if version is None else "no integer"
        raise ValueError(f"{path} is not a vartrace file: {what} {FORMAT_ATTR!r} root attribute")
    if int(version) > FORMAT_VERSION:
        handle.close()
        raise ValueError(
            f"{path} has vartrace format version {int(version)}, newer than this vartrace "
            f"reads ({FORMAT_VERSION}); upgrade vartrace to read it"
        )
    return handle


#: Most groups read under /meta (vartrace writes 4), and most entries of one of its datasets.
_META_GROUPS = 64
_META_ENTRIES = 1 << 16


def read_tree(group: h5py.Group, seen: set[int] | None = None) -> dict[str, Any]:
    """A /meta group as a nested dict, every read bounded (in entries and in bytes: see
    `check_read`) and inside the file.

    Each group is read once: a group linked twice (a loop) is refused.
    """
    seen = set() if seen is None else seen
    if hash(group.id) in seen or len(seen) > _META_GROUPS:
        raise RunFileError(
            f"{file_name(group.id)}: {group.name} is linked twice or nests too deep: a crafted file"
        )
    seen.add(hash(group.id))
    tree: dict[str, Any] = {}
    for link in group:
        check_link(group, link)
        item = group[link]
        key = unescape(link)
        if isinstance(item, h5py.Group):
            tree[key] = read_tree(item, seen)
            continue
        check_storage(item.id)
        if item.size > _META_ENTRIES:
            raise RunFileError(
                f"{file_name(group.id)}: {item.name} holds {item.size} entries, more than "
                f"metadata ever does ({_META_ENTRIES}): a crafted file"
            )
        check_read(item, item.size)  # few entries may still declare wide ones (a 1 MiB string)
        if h5py.check_string_dtype(item.dtype):
            value = item.asstr(errors="replace")[()]
            tree[key] = list(value) if item.ndim else value
        else:
            value = item[()]
            tree[key] = value.tolist() if item.ndim else value.item()
    return tree


def load_filters(dataset: h5py.Dataset) -> str | None:
    """Register hdf5plugin's filters (Blosc & co.) when `dataset` uses a plugin filter.

    Returns why the values cannot be read when a filter stays unavailable
    (hdf5plugin not installed), naming the filter and how to install it;
    `None` when they can.
    """
    plist = dataset.id.get_create_plist()
    filters = [plist.get_filter(i) for i in range(plist.get_nfilters())]
    plugins = [(code, name) for code, _, _, name in filters if code >= 256]
    if not plugins:
        return None
    with contextlib.suppress(ImportError):
        import hdf5plugin  # noqa: F401
    missing = [(code, name) for code, name in plugins if not h5py.h5z.filter_avail(code)]
    if not missing:
        return None
    names = ", ".join(
        f"{name.decode(errors='replace') or 'unnamed'} (HDF5 filter {code})"
        for code, name in missing
    )
    return (
        f"its values are compressed with {names}, a filter this Python lacks: "
        "install hdf5plugin (pip install 'torch-vartrace[compress]') to read them"
    )


def leading_rows(group: h5py.Group, name: str, rows: int) -> np.ndarray:
    """The first `rows` rows of the dataset `name` of `group`; it must hold that many.

    Read through h5py's low-level calls: opening a site reads five such small
    datasets, and the high-level ones cost several times more than the read.
    """
    dataset = open_object(group, name)
    if not isinstance(dataset, h5py.h5d.DatasetID):
        where = f"{group.name}/{name}"
        raise RunFileError(f"{file_name(group.id)}: {where} is not a dataset: a damaged file")
    check_storage(dataset)
    space = dataset.get_space()
    dims = space.get_simple_extent_dims()
    dtype = dataset.dtype  # (made anew by each use of the attribute)
    if len(dims) != (2 if name in ("shapes", TAGGED) else 1) or dtype.kind not in "iu":
        raise RunFileError(
            f"{file_name(group.id)}: {group.name}/{name} is not a dataset of integers of the "
            "expected rank: a damaged file"
        )
    if dims[0] < rows:
        raise too_few(group, name, dims[0], rows)
    shape = (rows, *dims[1:])
    if math.prod(shape) * dtype.itemsize > FREE_READ_BYTES:  # the common case: small
        check_read(dataset, math.prod(shape))
    out = np.empty(shape, dtype)
    if not out.size:
        return out
    if shape == dims:
        dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
    else:
        space.select_hyperslab((0,) * len(shape), shape)
        dataset.read(h5py.h5s.create_simple(shape), space, out)
    return out


def int_attr(group: h5py.Group, name: str) -> int | None:
    """The integer scalar attribute `name` of `group`; `None` if it is missing or none.

    Read through h5py's low-level calls: listing a run reads one of each site.
    """
    try:
        attr = h5py.h5a.open(group.id, name.encode())
    except KeyError:
        return None
    if attr.get_space().get_simple_extent_type() != h5py.h5s.SCALAR or attr.dtype.kind not in "iu":
        return None
    out = np.empty((), attr.dtype)
    attr.read(out)
    return int(out)


def text_attr(dataset: h5py.Dataset, name: str, default: str | None = None) -> str:
    """The attribute `name` of `dataset` as text; `default` if it is missing (`KeyError`
    without one).

    The scalar variable-length strings vartrace writes are read through h5py's
    low-level calls (a site has three); any other attribute as h5py reads it, through
    `str`.
    """
    try:
        attr = h5py.h5a.open(dataset.id, name.encode())
    except KeyError:
        if default is None:
            raise
        return default
    dtype = attr.dtype
    text = h5py.check_string_dtype(dtype)
    scalar = attr.get_space().get_simple_extent_type() == h5py.h5s.SCALAR
    if not scalar or text is None or text.length is not None:
        return str(dataset.attrs[name])
    out = np.empty((), dtype)
    attr.read(out)
    value = out[()]
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def too_few(group: h5py.Group, name: str, held: int, rows: int) -> RunFileError:
    return RunFileError(
        f"{file_name(group.id)}: {group.name}/{name} holds {held} records where /committed "
        f"counts {rows}: a damaged file"
    )
