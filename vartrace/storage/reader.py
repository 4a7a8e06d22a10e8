"""Reading run files offline: `vartrace.open`.

Example:
    ```python
    import vartrace

    with vartrace.open("run.h5") as run:
        site = run["layers.0.attn.forward.scores"]
        site.values            # the h5py dataset (records x padded shape), read lazily
        site.iterations        # numpy int64 array, one entry per record
        site.get(iteration=8)  # the value the site held at iteration 8 (rank 0): its last
                               # record at or before 8, exact shape and dtype
        site.calls(iteration=8)  # every record of iteration 8, in capture order (a list)
        run.to_frame(stat="norm")
    ```

Opening reads nothing but the root attributes; records are read when asked
for.  Shards of a run written with `ModelTracer(gather=False)` open as one
run: `vartrace.open("run.rank*.h5")`.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import glob
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cache, cached_property
from pathlib import Path
from stat import S_ISBLK, S_ISCHR, S_ISDIR, S_ISFIFO, S_ISREG, S_ISSOCK
from typing import Any

import h5py
import numpy as np

from vartrace._support.text import missing_site
from vartrace._support.warnings import warn
from vartrace.reduced import ReducedFrom
from vartrace.statistics.named import STATS, SUMMARY_FIELDS, reduce_block
from vartrace.storage._codec import (
    IN_OTHER,
    KIND_NAMES,
    Kind,
    PickleNotAllowedError,
    from_array,
    from_blob,
    in_values,
    raw_dtype,
    row_shapes,
)
from vartrace.storage._guard import (
    FREE_READ_BYTES,
    RunFileError,
    check_link,
    check_read,
    check_storage,
    child,
    file_name,
    held_bytes,
    open_object,
    size_text,
)
from vartrace.storage._layout import (
    COMMITTED,
    FORMAT_ATTR,
    FORMAT_VERSION,
    NAME_END,
    NAME_START,
    NO_TARGET,
    RUN_ID_ATTR,
    SHARD_ATTR,
    SIGNATURE,
    SITE_INDEX,
    SITE_NAMES,
    TAGGED,
    TAGS,
    TARGET,
    has_write_flags,
    reduced_from,
    unescape,
    writer_alive,
)
from vartrace.storage._swmr import open_swmr

__all__ = [
    "STATS",
    "PickleNotAllowedError",
    "Run",
    "RunFileError",
    "Site",
    "open_file",
    "open_run",
]

_READ_BLOCK = 64 << 20  # bytes read at once by to_frame
_REDUCE_BYTES = 16 << 20  # bytes (as float64) a statistic of records of one shape takes at once
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
    try:
        return h5py.File(path, "r")
    except OSError as error:
        plain = error
    # Only a file a writer holds (or held when killed) is worth SWMR mode, where HDF5 retries
    # each unreadable piece of the file (see open_swmr).
    tries = _OPEN_TRIES if has_write_flags(path) else 0
    swmr = plain
    for attempt in range(tries):
        if attempt:
            time.sleep(_OPEN_PAUSE_S)
        try:
            return open_swmr(path)
        except OSError as error:
            swmr = error
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
    handle = _open_hdf5(path)
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


def _read_tree(group: h5py.Group, seen: set[int] | None = None) -> dict[str, Any]:
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
            tree[key] = _read_tree(item, seen)
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


def _load_filters(dataset: h5py.Dataset) -> str | None:
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


def _leading_rows(group: h5py.Group, name: str, rows: int) -> np.ndarray:
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
        raise _too_few(group, name, dims[0], rows)
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


def _int_attr(group: h5py.Group, name: str) -> int | None:
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


def _text_attr(dataset: h5py.Dataset, name: str, default: str | None = None) -> str:
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


#: The kinds of record a ``values`` dataset of each storage holds (others are kept in
#: ``other``); a blob dataset holds any kind but None.
_KINDS_HELD = {
    "array": frozenset(
        {
            Kind.TENSOR,
            Kind.TENSOR_RAW,
            Kind.NDARRAY,
            Kind.NPSCALAR,
            Kind.INT,
            Kind.FLOAT,
            Kind.BOOL,
            Kind.COMPLEX,
            Kind.STATISTICS,
        }
    ),
    "str": frozenset({Kind.STR}),
}


@cache
def _kind_table(kinds: frozenset[int]) -> np.ndarray:
    """Whether each kind code is one of `kinds` (a lookup costs less than `np.isin`)."""
    table = np.zeros(len(KIND_NAMES), bool)
    table[list(kinds)] = True
    table.flags.writeable = False
    return table


def _check_statistics(dtype: np.dtype, what: str, where: Any) -> None:
    """Refuse statistics records of `dtype` that lack a summary field or hold a
    non-number (`what` names them, `where` is the id of an object of their file)."""
    fields: dict[str, tuple[Any, ...]] = dict(dtype.fields or {})
    missing = [name for name in SUMMARY_FIELDS if name not in fields]
    odd = [name for name, (field, *_) in fields.items() if field.kind not in "biuf"]
    if missing or odd:
        problem = (
            f"without the field {missing[0]!r}"
            if missing
            else f"whose field {odd[0]!r} is no number"
        )
        raise RunFileError(
            f"{file_name(where)}: {what} holds statistics records {problem} ({dtype}): "
            "a damaged file"
        )


#: The numpy dtype kinds of a values dataset of numbers (and compound rows of statistics).
_NUMERIC_KINDS = "biufcV"


def _too_few(group: h5py.Group, name: str, held: int, rows: int) -> RunFileError:
    return RunFileError(
        f"{file_name(group.id)}: {group.name}/{name} holds {held} records where /committed "
        f"counts {rows}: a damaged file"
    )


class _ReadAhead:
    """Blocks of consecutive rows read ahead for record-by-record loops, a few per run.

    A loop reading a site's records one after another (`site.record(i)`,
    [`Site.calls`][vartrace.Site.calls]) is served from blocks read in one go: the first
    consecutive read fetches `_AHEAD_FIRST` rows, each next block twice
    as many, up to `_AHEAD_BYTES`.  A read elsewhere reads its row
    alone.  The run keeps the `_AHEAD_BLOCKS` blocks used last, so loops
    over a few sites at once each keep theirs; a part whose block was dropped
    starts again small.
    """

    def __init__(self) -> None:
        # id(part) -> (part, first row, rows), the block used last at the end; thread-safe
        # (compare reads sites of one run from several threads).
        self._blocks: dict[int, tuple[_Part, int, np.ndarray]] = {}
        self._lock = threading.Lock()

    def find(self, part: _Part, row: int) -> np.ndarray | None:
        """Row `row` of `part` from its block (a view), or `None` if not read ahead."""
        with self._lock:
            held = self._blocks.pop(id(part), None)
            if held is None or held[0] is not part:
                return None
            self._blocks[id(part)] = held  # the most recently used: last
        _, first, block = held
        return block[row - first] if 0 <= row - first < len(block) else None

    def holds(self, part: _Part) -> bool:
        with self._lock:
            held = self._blocks.get(id(part))
        return held is not None and held[0] is part

    def keep(self, part: _Part, first: int, block: np.ndarray) -> None:
        with self._lock:
            self._blocks.pop(id(part), None)
            self._blocks[id(part)] = (part, first, block)
            while len(self._blocks) > _AHEAD_BLOCKS:
                del self._blocks[next(iter(self._blocks))]


#: Read-ahead of record-by-record loops (see :class:`_ReadAhead`).
_AHEAD_FIRST = 8
_AHEAD_BYTES = 1 << 20
_AHEAD_BLOCKS = 8


class _Part:
    """One file's datasets of one site.

    Made when a run lists its sites, from the file's root index (reading nothing of
    the site) or, in a file without one, from the site's group and its `slot`
    attribute; its group and datasets are opened (and checked) when the site is used.
    """

    def __init__(
        self,
        sites: h5py.Group,
        link: str,
        slot: int,
        rows: int,
        ahead: _ReadAhead,
        first_order: int | None = None,
        *,
        tagged: bool,
    ) -> None:
        """The site `/vars/<link>` (`sites` is `/vars`) of slot `slot`, holding `rows`
        committed records; `first_order` as the root index gives it; `tagged`: laid out
        as format version 2 says (one `tags` dataset, `shapes` only where needed)."""
        self._sites = sites
        self.tagged = tagged
        self._link = link
        self.slot = slot
        self.rows = rows
        self._first_order = first_order
        self._ahead = ahead
        self._next_row = -1  # the row after the one read last: a loop reads it next
        self._ahead_rows = 0  # rows the next block read ahead holds

    @classmethod
    def walked(
        cls,
        sites: h5py.Group,
        link: str,
        committed: np.ndarray,
        ahead: _ReadAhead,
        *,
        tagged: bool,
    ) -> _Part:
        """The site `/vars/<link>` of a file read without its root index: its group is
        opened for its `slot` attribute."""
        group = child(sites, link, h5py.Group)
        slot = _int_attr(group, "slot")
        if slot is None:
            raise RunFileError(
                f"{file_name(group.id)}: {group.name} has no integer 'slot' attribute: a "
                "damaged file"
            )
        rows = max(0, int(committed[slot])) if 0 <= slot < len(committed) else 0
        part = cls(sites, link, slot, rows, ahead, tagged=tagged)
        part.__dict__["group"] = group  # (the cached property, already known)
        return part

    @cached_property
    def group(self) -> h5py.Group:
        """The site's group, checked to be the one of its slot."""
        group = child(self._sites, self._link, h5py.Group)
        slot = _int_attr(group, "slot")
        if slot != self.slot:
            raise RunFileError(
                f"{file_name(group.id)}: {group.name} has the slot attribute {slot} where "
                f"/{SITE_INDEX} gives it slot {self.slot}: a damaged file"
            )
        return group

    def open(self) -> None:
        """Open the site's values and check their attributes (done once, when the site is used)."""
        _ = self.written_dtype

    @property
    def first_order(self) -> int:
        """The capture order of the part's first record."""
        if self._first_order is None:
            if self.tagged:
                self._first_order = int(self._tag_table(1)[0, TAGS.index("order")])
            else:
                self._first_order = int(_leading_rows(self.group, "order", 1)[0])
        return self._first_order

    @cached_property
    def reduced_from(self) -> ReducedFrom | None:
        """What a pre-save callback made the part's records from (its group's attributes)."""
        group = self.group
        try:
            return reduced_from(group.attrs)
        except ValueError as error:
            raise RunFileError(f"{file_name(group.id)}: {group.name}: {error}") from None

    @cached_property
    def values(self) -> h5py.Dataset | None:
        """The `values` dataset; uncompressed chunks are read without a chunk cache, so a
        row is read alone rather than its whole chunk (a read of one row anywhere in a long
        site costs what reading its bytes costs)."""
        group = self.group
        if not group.id.links.exists(b"values"):
            return None
        check_link(group, "values")
        # HDF5 keeps a dataset's chunk cache while it is open: it is opened without one,
        # and anew with one only when its chunks are compressed.
        access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        access.set_chunk_cache(0, 0, 1.0)
        try:
            dataset = h5py.h5d.open(group.id, b"values", access)
        except KeyError:  # not a dataset, or a damaged one: the checked open names which
            dataset = child(group, "values", h5py.Dataset).id
        plist = check_storage(dataset)  # its data kept in the file
        if plist.get_layout() == h5py.h5d.CHUNKED and plist.get_nfilters():
            dataset.close()
            dataset = h5py.h5d.open(group.id, b"values")
        shape = dataset.shape
        held = shape[0] if shape else 0  # () or None: a scalar or empty one
        if held < self.rows:
            raise _too_few(group, "values", held, self.rows)
        # Read-only: h5py keeps its shape and fast reader (the run is read as of its opening).
        return h5py.Dataset(dataset, readonly=True)

    @cached_property
    def unreadable(self) -> str | None:
        return None if self.values is None else _load_filters(self.values)

    @cached_property
    def storage(self) -> str:
        _ = self.unreadable
        return "" if self.values is None else _text_attr(self.values, "storage")

    @cached_property
    def torch_dtype(self) -> str:
        _ = self.storage
        return "" if self.values is None else _text_attr(self.values, "torch_dtype", "")

    @cached_property
    def written_dtype(self) -> np.dtype | None:
        """The dtype the records were written with: h5py reads non-native byte orders as
        native."""
        _ = self.torch_dtype
        key = "" if self.values is None else _text_attr(self.values, "key", "")
        return self._written(key) if key and not self.torch_dtype else None

    def _written(self, key: str) -> np.dtype:
        """The dtype a values dataset's `key` names: its own, in some byte order."""
        assert self.values is not None
        try:
            written = np.dtype(key.split("/")[0])
        except (TypeError, ValueError):
            written = None
        if written is None or written.itemsize != self.values.dtype.itemsize:
            raise RunFileError(
                f"{file_name(self.group.id)}: {self.values.name} has the key {key!r}, which "
                f"does not name its dtype ({self.values.dtype}): a damaged file"
            )
        return written

    def _records(self, name: str) -> h5py.Dataset:
        """The dataset `name` of the site, which must hold a row for each committed record."""
        dataset = child(self.group, name, h5py.Dataset)
        held = dataset.shape[0] if dataset.shape else 0  # () or None: a scalar or empty one
        if held < self.rows:
            raise _too_few(self.group, name, held, self.rows)
        return dataset

    @cached_property
    def tags(self) -> dict[str, np.ndarray]:
        """The records' iterations, ranks, capture orders (int64) and kinds (uint8)."""
        if not self.tagged:
            tags = {name: _leading_rows(self.group, name, self.rows) for name in TAGS}
        else:
            table = self._tag_table(self.rows)
            tags = {name: np.ascontiguousarray(table[:, n]) for n, name in enumerate(TAGS)}
            kinds = tags["kinds"]
            outside = np.flatnonzero((kinds < 0) | (kinds > np.iinfo(np.uint8).max))
            if len(outside):
                raise RunFileError(
                    f"{file_name(self.group.id)}: {self.group.name}/{TAGGED} gives record "
                    f"{outside[0]} the kind {int(kinds[outside[0]])}, not a byte: a damaged file"
                )
            tags["kinds"] = kinds.astype(np.uint8)
        self._check_kinds(tags["kinds"])
        return tags

    def _tag_table(self, rows: int) -> np.ndarray:
        """The first `rows` rows of a version-2 site's `tags`: a column a tag (`TAGS`)."""
        table = _leading_rows(self.group, TAGGED, rows)
        if table.shape[1] != len(TAGS):
            raise RunFileError(
                f"{file_name(self.group.id)}: {self.group.name}/{TAGGED} has {table.shape[1]} "
                f"columns where it holds {len(TAGS)} ({', '.join(TAGS)}): a damaged file"
            )
        return table

    def _check_kinds(self, kinds: np.ndarray) -> None:
        """Refuse kind codes vartrace never writes: unknown ones, a None said to be kept in
        `other`, and kinds the `values` dataset cannot hold (a statistics record in a
        dataset of plain numbers, a number in one of statistics rows, ...)."""
        column = f"{TAGGED} (column kinds)" if self.tagged else "kinds"
        where = f"{file_name(self.group.id)}: {self.group.name}/{column}"
        unknown = (kinds & 0x7F) >= len(KIND_NAMES)
        if unknown.any():
            raise RunFileError(
                f"{where} holds the unknown kind {int(kinds[unknown][0])}: a damaged file"
            )
        none_apart = np.flatnonzero(kinds == IN_OTHER | Kind.NONE)
        if len(none_apart):
            raise RunFileError(
                f"{where} says record {none_apart[0]}, a None, is kept in {self.group.name}/other, "
                "where no None is kept: a damaged file"
            )
        held = _KINDS_HELD.get(self.storage)
        if self.values is None or held is None:
            return
        if self.values.dtype.names is None:
            held = held - {Kind.STATISTICS}
        elif self.storage == "array":  # rows of statistics records hold nothing else
            held = frozenset({Kind.STATISTICS})
            _check_statistics(self.values.dtype, self.values.name, self.group.id)
        allowed = _kind_table(held)
        held_here = in_values(kinds)
        code = kinds & 0x7F  # a known kind (checked above), the same as `kinds` if held
        misplaced = held_here & ((code != kinds) | ~allowed[code])
        if misplaced.any():
            row = int(np.flatnonzero(misplaced)[0])
            raise RunFileError(
                f"{where} says record {row} is a {KIND_NAMES[code[row]]} record (kind "
                f"{int(kinds[row])}), which {self.values.name} of {self.values.dtype} "
                "cannot hold: a damaged file"
            )

    @cached_property
    def shapes(self) -> np.ndarray:
        """Each record's true shape: one column per axis of a record in `values`."""
        axes = self.values.ndim - 1 if self.storage == "array" and self.values is not None else 0
        if self.group.id.links.exists(b"shapes"):
            shapes = _leading_rows(self.group, "shapes", self.rows)
        elif self.tagged and axes:  # version 2: every record in `values` has its row shape
            return row_shapes(self.tags["kinds"], self.padded)
        else:  # written only for records of one axis or more
            shapes = np.zeros((self.rows, 0), np.int64)
        if shapes.shape[1] != axes:
            raise RunFileError(
                f"{file_name(self.group.id)}: {self.group.name}/values holds records of {axes} "
                f"axes but its shapes give {shapes.shape[1]}: a damaged file"
            )
        return shapes

    def shape(self, row: int) -> tuple[int, ...]:
        """Record `row`'s true shape, checked to lie within the padded one of `values`."""
        assert self.values is not None
        shape = tuple(self.shapes[row].tolist())
        padded = self.padded
        if any(not 0 <= n <= most for n, most in zip(shape, padded, strict=True)):
            raise RunFileError(
                f"{file_name(self.group.id)}: {self.group.name}/shapes gives record {row} the "
                f"shape {shape}, outside its values' {padded}: a damaged file"
            )
        return shape

    @cached_property
    def padded(self) -> tuple[int, ...]:
        """The shape of a row of `values`: every record's padded shape."""
        assert self.values is not None
        return tuple(self.values.shape[1:])

    @cached_property
    def itemsize(self) -> int:
        """The bytes of one entry of `values`."""
        assert self.values is not None
        return int(self.values.dtype.itemsize)

    @property
    def dtype(self) -> str:
        if self.storage == "array":
            assert self.values is not None
            return self.torch_dtype or self.values.dtype.name
        return {"str": "str", "blob": "object"}.get(self.storage, "none")

    def check(self, name: str) -> None:
        """Raise `OSError` naming the missing filter when the values cannot be read."""
        if self.unreadable is not None:
            raise OSError(f"site {name!r}: {self.unreadable}")

    def read(self, row: int, allow_pickle: bool, where: str) -> Any:
        code = int(self.tags["kinds"][row])
        kind = code & 0x7F
        if kind == Kind.NONE:
            return None
        if code & IN_OTHER:
            return self._blob(self._records("other"), row, kind, allow_pickle, where)
        if self.values is None:
            raise RunFileError(f"{where} has no values dataset: a damaged file")
        self.check(where)
        if self.storage == "str":  # one entry a record: a crafted file declares more
            check_read(self.values, math.prod(self.values.shape[1:]))
            if not h5py.check_string_dtype(self.values.dtype):
                raise self._misstored(self.values, "str records")
            return self.values.asstr()[row]
        if self.storage == "blob":
            return self._blob(self.values, row, kind, allow_pickle, where)
        if self.values.dtype.kind not in _NUMERIC_KINDS:
            raise self._misstored(self.values, "numeric records")
        shape = self.shape(row)  # within the padded shape, one size per axis
        data = self._numbers(row, shape)
        written = self.written_dtype
        if kind in (Kind.NDARRAY, Kind.NPSCALAR) and written is not None:
            data = np.asarray(data).astype(written, copy=False)
        return from_array(kind, data, self.torch_dtype, where)

    def _numbers(self, row: int, shape: tuple[int, ...]) -> np.ndarray:
        """Row `row` of the numeric `values`, cut to `shape`: a fresh array.

        A row that follows the one read last is served from a block read ahead
        (see `_ReadAhead`); any other is read alone.
        """
        assert self.values is not None
        held = self._ahead.find(self, row)
        if held is None and row == self._next_row:
            held = self._read_ahead(row)
        self._next_row = row + 1
        if held is not None:
            return np.array(held[tuple(slice(0, n) for n in shape)])
        if math.prod(shape) * self.itemsize > FREE_READ_BYTES:
            check_read(self.values, math.prod(shape))
        return np.asarray(self.values[(row, *(slice(0, n) for n in shape))])

    def _read_ahead(self, row: int) -> np.ndarray | None:
        """Read rows from `row` on at full padded shape, keep them and return the first;
        `None` when a row is too large to read ahead."""
        assert self.values is not None
        record_bytes = math.prod(self.padded) * self.itemsize
        most = _AHEAD_BYTES // max(1, record_bytes)
        if most < 2:
            return None
        if not self._ahead.holds(self):  # a first block, or its block was dropped
            self._ahead_rows = 0
        self._ahead_rows = min(most, max(_AHEAD_FIRST, 2 * self._ahead_rows))
        count = min(self._ahead_rows, self.rows - row)
        if count < 1:
            return None
        check_read(self.values, count * math.prod(self.padded))
        block = self._read_rows(row, count, self.padded)
        self._ahead.keep(self, row, block)
        return block[0]

    def _read_rows(self, row: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
        """`count` rows of `values` from `row` on, cut to `shape`, as h5py reads them."""
        assert self.values is not None
        return np.asarray(self.values[(slice(row, row + count), *(slice(0, n) for n in shape))])

    def _misstored(self, dataset: h5py.Dataset, what: str) -> RunFileError:
        return RunFileError(
            f"{file_name(self.group.id)}: {dataset.name} holds {what} in a dataset of "
            f"{dataset.dtype}: a damaged file"
        )

    def _blob(
        self, dataset: h5py.Dataset, row: int, kind: int, allow_pickle: bool, where: str
    ) -> Any:
        """The record kept as bytes in row `row` of `dataset` (of variable-length uint8)."""
        if h5py.check_vlen_dtype(dataset.dtype) != np.uint8:
            raise self._misstored(dataset, "records as bytes")
        check_read(dataset, math.prod(dataset.shape[1:]))
        value = from_blob(kind, dataset[row].tobytes(), allow_pickle, where)
        if kind == Kind.STATISTICS:
            _check_statistics(value.dtype, f"{dataset.name} (record {row})", self.group.id)
        return value

    def describe(
        self, stat: str | Callable[[Any], Any], allow_pickle: bool, name: str
    ) -> list[tuple[Any, str, tuple[int, ...]]]:
        """Per row: the statistic of the record, its dtype name and its shape.

        Records in a numeric `values` dataset are read in blocks and a named
        statistic is taken of all records of one shape in a block at once; the
        others (and every record for a callable `stat`) one by one.
        """
        kinds = self.tags["kinds"]
        rows: list[Any] = [None] * len(kinds)
        if self.storage == "array":
            assert self.values is not None
            self.check(name)
            record_bytes = self.itemsize * math.prod(self.padded)
            step = max(1, _READ_BLOCK // max(1, record_bytes))
            held = np.flatnonzero(in_values(kinds))
            self._check_shapes(held)
            for begin in range(0, len(kinds), step):
                stop = min(begin + step, len(kinds))  # rows past the committed ones: unflushed
                check_read(self.values, (stop - begin) * record_bytes // self.itemsize)
                block = self.values[begin:stop]
                taken = held[(held >= begin) & (held < stop)]
                if callable(stat):
                    self._describe_each(stat, block, begin, taken, rows, name)
                else:
                    numeric = _decode_raw(block, self.torch_dtype, f"site {name!r}")
                    self._describe_block(stat, numeric, begin, taken, rows)
        for row, kind in enumerate(kinds & 0x7F):
            if rows[row] is not None:
                continue
            if kind == Kind.PICKLE and not allow_pickle and not callable(stat):
                rows[row] = (np.nan, "pickle", ())
                continue
            value = self.read(row, allow_pickle, f"row {row} of site {name!r}")
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                dtype, shape = str(value.dtype).removeprefix("torch."), tuple(value.shape)
            else:
                dtype, shape = KIND_NAMES[kind], ()
            rows[row] = (_apply(stat, value, _numeric(value)), dtype, shape)
        return rows

    def _check_shapes(self, rows: np.ndarray) -> None:
        """Check the true shapes of records `rows` of `values` as `shape` checks
        one: the first outside the padded shape raises its error."""
        shapes = self.shapes[rows]
        outside = ((shapes < 0) | (shapes > np.asarray(self.padded, np.int64))).any(axis=1)
        if outside.any():
            self.shape(int(rows[np.flatnonzero(outside)[0]]))

    def _describe_each(
        self,
        stat: Callable[[Any], Any],
        block: np.ndarray,
        begin: int,
        taken: np.ndarray,
        rows: list[Any],
        name: str,
    ) -> None:
        """The callable `stat` of each record `taken` of `block` (rows from `begin`)."""
        kinds = self.tags["kinds"].tolist()
        for row in taken.tolist():
            shape = tuple(self.shapes[row].tolist())
            cut = (row - begin, *(slice(0, n) for n in shape))
            value = from_array(kinds[row], block[cut], self.torch_dtype, f"row {row} of {name!r}")
            rows[row] = (stat(value), self.dtype, shape)

    def _describe_block(
        self, stat: str, numeric: np.ndarray, begin: int, taken: np.ndarray, rows: list[Any]
    ) -> None:
        """The statistic `stat` of the records `taken` of `numeric` (rows from
        `begin`): a field of each statistics record, or `STATS` of all records of
        one shape at once."""
        dtype = self.dtype
        shapes = self.shapes[taken]
        if numeric.dtype.names:  # statistics records: a field of each
            for row, shape in zip(taken.tolist(), shapes.tolist(), strict=True):
                cut = (row - begin, *(slice(0, n) for n in shape))
                rows[row] = (_apply(stat, None, numeric[cut]), dtype, tuple(shape))
            return
        if not len(shapes) or (shapes == shapes[0]).all():  # one shape: the usual case
            unique, group_of = shapes[:1], np.zeros(len(shapes), np.intp)
        else:
            unique, group_of = np.unique(shapes, axis=0, return_inverse=True)
        for group, shape in enumerate(unique.tolist()):
            members = taken if len(unique) == 1 else taken[group_of.reshape(-1) == group]
            found = self._reduced(stat, numeric, members - begin, tuple(shape))
            for row, value in zip(members.tolist(), found, strict=True):
                rows[row] = (value, dtype, tuple(shape))

    def _reduced(
        self, stat: str, numeric: np.ndarray, at: np.ndarray, shape: tuple[int, ...]
    ) -> list[float]:
        """`STATS` `stat` of the records at `at` of `numeric`, all of `shape`
        (NaN for a name that is no statistic), a slice of `_REDUCE_BYTES` at a time."""
        if stat not in STATS:
            return [np.nan] * len(at)
        cut = (slice(None), *(slice(0, n) for n in shape))
        step = max(1, _REDUCE_BYTES // max(1, 8 * math.prod(shape)))
        found: list[float] = []
        for first in range(0, len(at), step):
            some = at[first : first + step]
            whole = len(some) == some[-1] - some[0] + 1  # consecutive rows: a view
            records = numeric[some[0] : some[-1] + 1] if whole else numeric[some]
            found += reduce_block(STATS[stat], records[cut]).tolist()
        return found


class ValuesView:
    """The `values` of one site's records, lazily: across shards (in merged
    record order), or of a file whose `values` holds rows past the last
    flushed record (a killed or running writer's).

    Supports `len`, `shape`, `dtype`, `ndim`, indexing along records
    (an int, a slice or an index array, optionally followed by more indices)
    and `numpy.asarray`; records are zero-padded to the largest shape.
    """

    def __init__(self, parts: list[_Part], where: list[tuple[int, int]]) -> None:
        datasets = [part.values for part in parts if part.values is not None]
        self._parts = parts
        self._where = where
        self.dtype = datasets[0].dtype
        padded = np.max([dataset.shape[1:] for dataset in datasets], axis=0).astype(int)
        self.shape = (len(where), *(int(size) for size in padded))
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        index, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        rows = np.arange(len(self))[index]
        nbytes = rows.size * int(np.prod(self.shape[1:], dtype=object)) * self.dtype.itemsize
        if nbytes > FREE_READ_BYTES:
            held = sum(held_bytes(p.values.id) for p in self._parts if p.values is not None)
            if nbytes > held:
                raise RunFileError(
                    f"{rows.size} records of shape {self.shape[1:]} declare "
                    f"{size_text(nbytes)} to read but the files hold {size_text(held)} of "
                    "them: a damaged or crafted file"
                )
        out = np.zeros((rows.size, *self.shape[1:]), self.dtype)
        where = [self._where[record] for record in rows.reshape(-1)]
        parts = {part for part, _ in where}
        located = np.array([row for _, row in where], int)
        stored: list[Any] = [part.values for part in self._parts]  # (a site view has values)
        if len(parts) == 1 and located.size and (np.diff(located) == 1).all():
            block = stored[where[0][0]][located[0] : located[-1] + 1]
            out[(slice(None), *(slice(0, size) for size in block.shape[1:]))] = block
        else:
            for position, (part, row) in enumerate(where):
                data = stored[part][row]
                cut: tuple[int | slice, ...] = (position, *(slice(0, size) for size in data.shape))
                out[cut] = data
        return out.reshape(rows.shape + self.shape[1:])[(slice(None),) * rows.ndim + rest]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self[:]
        return data if dtype is None else data.astype(dtype)


class Site:
    """The records of one site in a run (one file or several shards).

    Attributes `iterations`, `ranks`, `order`, `kinds` and `shapes` are
    numpy arrays with one entry per record; `values` is the lazy h5py dataset
    (a `ValuesView` across shards).  Records are in file order for one
    file, sorted by (iteration, rank, order) across shards.

    Example:
        ```python
        site = run["forward.x"]
        first = site.get(site.iterations[0])
        ```
    """

    def __init__(self, name: str, parts: list[_Part], allow_pickle: bool) -> None:
        self.name = name
        self._parts = parts
        self._allow_pickle = allow_pickle
        for part in parts:
            part.open()
        part_of = np.concatenate([np.full(len(p.tags["kinds"]), i) for i, p in enumerate(parts)])
        row_of = np.concatenate([np.arange(len(p.tags["kinds"])) for p in parts])
        tags = {
            field: np.concatenate([p.tags[field] for p in parts])
            for field in ("iterations", "ranks", "order", "kinds")
        }
        order = (
            np.lexsort((tags["order"], tags["ranks"], tags["iterations"]))
            if len(parts) > 1
            else np.arange(len(row_of))
        )
        self._where = list(zip(part_of[order].tolist(), row_of[order].tolist(), strict=True))
        self.iterations: np.ndarray = tags["iterations"][order]
        self.ranks: np.ndarray = tags["ranks"][order]
        self.order: np.ndarray = tags["order"][order]
        self._kinds = tags["kinds"][order]

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"<Site {self.name!r} records={len(self)} dtype={self.dtype}>"

    @property
    def values(self) -> h5py.Dataset | ValuesView | None:
        """The stored values (records x padded shape); `None` if every record is None.

        Rows of records not in it (see `in_values`) hold the fill value, and
        numeric records are zero-padded to the largest shape (see [`shapes`][vartrace.Site.shapes]);
        [`record`][vartrace.Site.record] and [`get`][vartrace.Site.get] give each record exactly.
        """
        for part in self._parts:
            part.check(self.name)
        return self.raw_values

    @property
    def raw_values(self) -> h5py.Dataset | ValuesView | None:
        """`values` without checking that its compression filter is available.

        Its shape, dtype and size read without the filter (`vartrace ls` lists a
        Blosc file without hdf5plugin); reading its data needs the filter.
        """
        if all(part.values is None for part in self._parts):
            return None
        single = self._parts[0].values if len(self._parts) == 1 else None
        if single is not None and single.shape[0] == len(self):
            return single
        return ValuesView(self._parts, self._where)

    @cached_property
    def shapes(self) -> np.ndarray:
        """The true shape of each record, (records, ndim); -1 rows: record not in `values`."""
        shapes = [part.shapes for part in self._parts]
        if len(shapes) == 1:
            return shapes[0]
        width = max(s.shape[1] for s in shapes)
        rows = [np.pad(s, ((0, 0), (0, width - s.shape[1])), constant_values=-1) for s in shapes]
        return np.concatenate(rows)[[self._index(p, r) for p, r in self._where]]

    def _index(self, part: int, row: int) -> int:
        return sum(len(p.tags["kinds"]) for p in self._parts[:part]) + row

    @property
    def kinds(self) -> np.ndarray:
        """The kind of each record: `"tensor"`, `"ndarray"`, `"int"`, `"none"`..."""
        return np.array(KIND_NAMES)[self._kinds & 0x7F]

    @property
    def in_values(self) -> np.ndarray:
        """Whether each record's value sits in `values` (numeric ones at their `shapes`).

        False for None records and for records that did not fit `values`
        (another dtype or kind than the site's first), which `record` reads.
        """
        return in_values(self._kinds)

    @property
    def dtype(self) -> str:
        """The dtype name of `values` (e.g. `"bfloat16"`, `"float32"`, `"str"`)."""
        return next((p.dtype for p in self._parts if p.values is not None), "none")

    @property
    def reduced_from(self) -> ReducedFrom | None:
        """The dtype and shape of the values a pre-save callback replaced by the records
        (statistics mode's rows), -1 on axes whose size differed; `None` where the
        records are the values themselves.

        Example:
            ```python
            run["blocks.0.forward"].reduced_from  # ReducedFrom('bfloat16', (8, -1, 768))
            ```
        """
        found = [origin for part in self._parts if (origin := part.reduced_from) is not None]
        return functools.reduce(ReducedFrom.merged, found) if found else None

    def record(self, index: int) -> Any:
        """The value of record `index`: exact shape, dtype and Python type."""
        part, row = self._where[index]
        where = f"record {index} of site {self.name!r}"
        return self._parts[part].read(row, self._allow_pickle, where)

    @cached_property
    def _by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        """Rank -> (iterations, record indices) of its records, by (iteration, capture order).

        Built once, on the first `get` or `calls`, from the tags read when
        the site was opened: a run is read as of its opening (a live writer's later
        records need a reopen), so the index cannot go stale.  Python lists: a
        `bisect.bisect` of one costs less than a numpy search.
        """
        by_key = np.lexsort((self.order, self.iterations, self.ranks))
        ranks = self.ranks[by_key]
        cuts = np.flatnonzero(np.diff(ranks)) + 1
        return {
            int(ranks[first]): (self.iterations[rows].tolist(), rows.tolist())
            for first, rows in zip([0, *cuts.tolist()], np.split(by_key, cuts), strict=True)
            if len(rows)
        }

    def _rows(self, rank: int) -> tuple[list[int], list[int]]:
        """(iterations, indices) of `rank`'s records, by (iteration, capture order)."""
        try:
            found = self._by_rank.get(rank)
        except TypeError:  # unhashable: no rank
            found = None
        return found if found is not None else ([], [])

    def _nothing_before(self, iteration: int, rank: int, rows: list[int]) -> KeyError:
        if not rows:
            ranks = np.unique(self.ranks).tolist()
            return KeyError(
                f"site {self.name!r} has no record on rank {rank} (it has records of "
                f"rank(s) {', '.join(map(str, ranks)) or 'none'})"
            )
        return KeyError(
            f"site {self.name!r} has no record at or before iteration {iteration} on rank "
            f"{rank}: its first record is at iteration {int(self.iterations[rows[0]])}"
        )

    def get(self, iteration: int, rank: int = 0) -> Any:
        """The value the site held at `iteration` on `rank`: its last record at or before it.

        Change detection stores a value only when it changes, so a weight
        recorded at iteration 1 and never changed afterwards is its value at
        every later iteration: `get(5)` returns it.  When iteration
        `iteration` holds several records (a method called twice in one
        step), the last one in capture order: the value at the end of that
        iteration; [`calls`][vartrace.Site.calls] gives all of them.  Always one value: a torch
        tensor for tensor records (any dtype, bfloat16 included), the Python or
        numpy value otherwise.  `KeyError` when `rank` recorded nothing at
        or before `iteration`.

        Example:
            ```python
            run["head.weight"].get(iteration=5)   # recorded at 1, unchanged since
            ```
        """
        iterations, rows = self._rows(rank)
        if isinstance(iteration, (int, np.integer)):
            upto = bisect.bisect_right(iterations, int(iteration))
        else:  # as numpy compares them (a NaN is at no iteration)
            upto = int(np.count_nonzero(np.asarray(iterations) <= iteration))
        if not upto:
            raise self._nothing_before(iteration, rank, rows)
        return self.record(rows[upto - 1])

    def calls(self, iteration: int, rank: int = 0) -> list[Any]:
        """Every record tagged `iteration` on `rank`, in capture order: always a list.

        One entry per recorded call of the iteration (a shared layer called
        twice gives two).  An empty list when the iteration recorded nothing
        on that rank: with change detection, nothing changed, and [`get`][vartrace.Site.get]
        gives the value then held.

        Example:
            ```python
            first, second = run["shared.forward.x"].calls(iteration=3)
            ```
        """
        iterations, rows = self._rows(rank)
        if isinstance(iteration, (int, np.integer)):
            key = int(iteration)
            first, stop = bisect.bisect_left(iterations, key), bisect.bisect_right(iterations, key)
            tagged = rows[first:stop]
        else:  # as numpy compares them
            tagged = np.asarray(rows, np.int64)[np.asarray(iterations) == iteration].tolist()
        return [self.record(r) for r in tagged]

    def to_xarray(self) -> Any:
        """The site's records as an xarray `DataArray` named after the site.

        Dimension `record` is indexed by `iteration` and `rank` (a
        MultiIndex: `da.sel(iteration=3, rank=0)`; several calls of one
        iteration stay separate records) with `order` as a coordinate, then
        the record's axes `dim_1`, `dim_2`... at the padded shape (ragged
        records are zero-padded as in `values`; `shapes` has the true ones).
        Numeric records only; bfloat16 and float8 come as float32 / float64.
        Needs `pip install 'torch-vartrace[xarray]'`.

        Example:
            ```python
            da = run["layers.0.attn.forward.scores"].to_xarray()
            da.sel(rank=0).mean(["dim_1", "dim_2"])      # one number per record
            ```
        """
        try:
            import xarray as xr
        except ImportError as exc:
            hint = "pip install 'torch-vartrace[xarray]'"
            raise ImportError(f"Site.to_xarray() needs xarray: {hint}") from exc
        values = self.values
        if values is None or values.dtype.kind not in "biufc" or not self.in_values.all():
            raise TypeError(
                f"site {self.name!r}: to_xarray() takes sites of numeric records only "
                f"(dtype {self.dtype}); read the others with Site.record()"
            )
        data = all_values(values)
        torch_dtype = next((p.torch_dtype for p in self._parts if p.torch_dtype), "")
        if torch_dtype:
            data = _decode_raw(data, torch_dtype, f"site {self.name!r}")
        coords = {"iteration": ("record", self.iterations), "rank": ("record", self.ranks)}
        array = xr.DataArray(
            data,
            dims=("record", *(f"dim_{axis}" for axis in range(1, data.ndim))),
            coords={**coords, "order": ("record", self.order)},
            name=self.name,
        )
        return array.set_index(record=["iteration", "rank"])


def all_values(values: h5py.Dataset | ValuesView) -> np.ndarray:
    """All of a site's `values` in one array, the read bounded like every other
    (`check_read`; a `ValuesView` bounds its own reads)."""
    if isinstance(values, h5py.Dataset):
        check_read(values, values.size)
    return np.asarray(values[:])


def _first_order(parts: list[_Part]) -> int:
    """The capture order of a site's first record (each file's records are in capture order)."""
    return min(part.first_order for part in parts)


def _numeric(value: Any) -> np.ndarray | None:
    """A numeric record as a numpy array (tensors of any dtype included), else `None`."""
    from vartrace.statistics.records import Statistics

    if isinstance(value, Statistics):
        return value.row
    if hasattr(value, "detach"):  # a tensor
        import torch

        tensor = value.detach()
        if tensor.is_complex():
            return tensor.to(torch.complex128).numpy()
        return tensor.numpy() if tensor.dtype == torch.bool else tensor.double().numpy()
    if isinstance(value, (bool, int, float, complex)):
        try:
            return np.asarray(value, complex if isinstance(value, complex) else float)
        except OverflowError:  # an int beyond float64: no float statistic of it
            return None
    if isinstance(value, (np.ndarray, np.generic)) and np.asarray(value).dtype.kind in "biufc":
        return np.asarray(value)
    return None


def _apply(stat: str | Callable[[Any], Any], value: Any, numeric: np.ndarray | None) -> Any:
    if callable(stat):
        return stat(value)
    if numeric is not None and numeric.dtype.names:  # a statistics record: its own field
        from vartrace.statistics.records import Statistics

        return Statistics(numeric).statistic(stat)
    if numeric is None or stat not in STATS:
        return np.nan
    return float(reduce_block(STATS[stat], numeric.reshape(1, -1))[0])


def _decode_raw(block: np.ndarray, torch_dtype: str, where: str) -> np.ndarray:
    """Numbers of a block stored as the raw bits of `torch_dtype` (bfloat16, float8...);
    `where` names the site in errors."""
    if torch_dtype == "bfloat16" and block.dtype.itemsize == 2:  # without importing torch
        block = (block.astype(np.uint32) << 16).view(np.float32)
    elif torch_dtype and not block.dtype.names:  # (compound rows of statistics stay as they are)
        import torch

        raw = torch.from_numpy(np.ascontiguousarray(block).view(f"i{block.dtype.itemsize}"))
        converted = raw.view(raw_dtype(torch_dtype, block.dtype.itemsize, where))
        block = (
            converted.to(torch.complex128) if converted.is_complex() else converted.double()
        ).numpy()
    return block


def _expand(path_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(path_or_glob, (str, os.PathLike)):
        text = os.fspath(path_or_glob)
        if not os.path.exists(text) and glob.has_magic(text):
            paths = sorted(glob.glob(text))
            if not paths:
                raise FileNotFoundError(errno.ENOENT, "no file matches the pattern", text)
            return [Path(p) for p in paths]
        return [Path(text)]
    given = [Path(p) for p in path_or_glob]
    if not given:
        raise ValueError("open_run needs at least one path")
    return given


def _indexed(handle: h5py.File, counts: np.ndarray) -> list[tuple[int, str, int, int]] | None:
    """(slot, link name, first capture order, alias target slot) of each counted slot of
    `handle`'s root index (see `_layout`); `None` for a file without a complete one (written
    by an older vartrace, or appended to by one: its sites are found by walking `/vars`).

    A root index that cannot be what vartrace writes is a `RunFileError`.
    """
    links = handle.id.links
    if not links.exists(SITE_INDEX.encode()) or not links.exists(SITE_NAMES.encode()):
        return None
    index = child(handle, SITE_INDEX, h5py.Dataset)
    names = child(handle, SITE_NAMES, h5py.Dataset)
    where = f"{file_name(handle.id)}: /{SITE_INDEX}"
    if index.ndim != 2 or index.shape[1] != 4 or index.dtype.kind not in "iu":
        raise RunFileError(f"{where} is not a (slots, 4) dataset of integers: a damaged file")
    if names.ndim != 1 or names.dtype != np.uint8:
        raise RunFileError(
            f"{file_name(handle.id)}: /{SITE_NAMES} is not a dataset of bytes: a damaged file"
        )
    counted = np.flatnonzero(counts > 0)
    if len(counted) and counted[-1] >= len(index):
        return None  # counted slots past the index: an older vartrace appended
    check_read(index, index.size)
    rows = np.asarray(index[()], np.int64)[counted]
    if len(rows) and not rows[:, NAME_END].all():
        return None  # counted slots the index never named: likewise
    check_read(names, names.size)
    data = np.asarray(names[()], np.uint8).tobytes()
    starts, ends = rows[:, NAME_START], rows[:, NAME_END]
    bad = (starts < 0) | (starts >= ends) | (ends > len(data))
    bad |= (rows[:, TARGET] < NO_TARGET) | (rows[:, TARGET] >= len(counts))
    if bad.any():
        slot = int(counted[np.flatnonzero(bad)[0]])
        raise RunFileError(f"{where} holds an impossible row for slot {slot}: a damaged file")
    found = []
    for slot, (start, end, first, target) in zip(counted.tolist(), rows.tolist(), strict=True):
        try:
            link = data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise RunFileError(
                f"{where} names slot {slot} with bytes that are no UTF-8: a damaged file"
            ) from None
        found.append((slot, link, first, target))
    return found


def _aliases(indexed: list[tuple[int, str, int, int]]) -> dict[str, str]:
    """Alias name -> target name of a file's counted index rows (`_indexed`): the later
    slot of a name wins (a commit cut short between two); an alias whose target is no
    counted site of the file is left out."""
    sites = {slot: link for slot, link, _, target in indexed if target == NO_TARGET}
    return {
        unescape(link): unescape(sites[target])
        for _, link, _, target in indexed
        if target != NO_TARGET and target in sites
    }


#: HDF5's errors for an object that a running writer made after a SWMR reader opened the
#: file (past the end of the file as the reader saw it): the site is left out until a reopen.
_BEYOND_VIEW = re.compile(
    "address of object past end of allocation|actual len exceeds EOA"
    "|len not positive after adjustment for EOA"  # (an object header starting at the end)
)


def _writer_alive(handle: h5py.File) -> bool:
    """Whether the process that last opened `handle`'s file for writing may still run."""
    host, pid = handle.attrs.get("writer_host", ""), handle.attrs.get("writer_pid", 0)
    if not isinstance(host, str) or not isinstance(pid, (int, np.integer)) or pid <= 0:
        return False
    return writer_alive(host, int(pid)) is not False


def _shard(path: Path, handle: h5py.File) -> tuple[str, int, int | None]:
    """(run id, rank, world size or None) of a shard; `ValueError` for a run of its own."""
    shard = handle.attrs.get(SHARD_ATTR)
    if shard is not None:
        rank, world = (int(n) for n in np.asarray(shard).reshape(-1)[:2])
        return str(handle.attrs.get(RUN_ID_ATTR, "")), rank, world
    named = re.search(r"\.rank(\d+)$", path.stem)
    if RUN_ID_ATTR in handle.attrs or named is None:  # older files: shards are named so
        raise ValueError(
            f"{path} holds a run of its own, not a shard of a sharded run: open it alone"
        )
    return "", int(named.group(1)), None


def _check_shards(paths: list[Path], files: list[h5py.File]) -> list[int]:
    """Refuse files that are not shards of one run; return the ranks missing from them."""
    if len(files) == 1 and SHARD_ATTR not in files[0].attrs:
        return []  # a run of its own
    shards = [_shard(path, handle) for path, handle in zip(paths, files, strict=True)]
    by_rank: dict[int, Path] = {}
    for path, (_, rank, world) in zip(paths, shards, strict=True):
        if rank in by_rank:
            raise ValueError(
                f"{by_rank[rank]} and {path} are both rank {rank}: shards of different runs"
            )
        if world is not None and not 0 <= rank < world:
            raise ValueError(f"{path} says it is rank {rank} of {world}: a damaged file")
        by_rank[rank] = path
    first, (run_id, _, world) = paths[0], shards[0]
    bases = {re.sub(r"\.rank\d+$", "", path.stem) + path.suffix for path in paths}
    for path, (other_id, _, other_world) in zip(paths[1:], shards[1:], strict=True):
        if ((run_id or other_id) and other_id != run_id) or (not run_id and len(bases) > 1):
            raise ValueError(f"{first} and {path} are shards of different runs")
        if other_world != world:
            raise ValueError(
                f"{first} and {path} are shards of runs of different world sizes "
                f"({world} and {other_world})"
            )
    missing = [] if world is None else sorted(set(range(world)) - set(by_rank))
    if missing:
        warn(
            f"vartrace: the shards of rank(s) {', '.join(map(str, missing))} of a "
            f"{world}-rank run are missing: reading the other {len(paths)}",
            RuntimeWarning,
            stacklevel=4,
        )
    return missing


class Run:
    """A run read from one file, or from the shards of a sharded run.

    `run.names` lists the sites, `run[name]` is a [`Site`][vartrace.Site], `run.meta`
    the metadata dict.  Close it (or use `with`) to release the files.
    """

    def __init__(self, paths: list[Path], allow_pickle: bool = False) -> None:
        self.paths = paths
        self.allow_pickle = allow_pickle
        self._files: list[h5py.File] = []
        try:
            for path in paths:
                self._files.append(open_file(path))
            #: Ranks of a sharded run whose shard is not among the files opened.
            self.missing_ranks = _check_shards(paths, self._files)
        except BaseException:
            self.close()
            raise
        self._sites: dict[str, Site] = {}
        self._ahead = _ReadAhead()

    @property
    def live(self) -> bool:
        """Whether a writer still runs on one of the files (or that cannot be told).

        Such a file is read in SWMR mode, as of the writer's last flush; reopen
        the run to see the records it flushes later.
        """
        return any(handle.swmr_mode and _writer_alive(handle) for handle in self._files)

    @property
    def _links(self) -> dict[str, list[_Part]]:
        """Site name -> its parts (one a file holding it), aliases left out."""
        return self._catalogue[0]

    @cached_property
    def _catalogue(self) -> tuple[dict[str, list[_Part]], dict[str, str]]:
        """The sites (name -> parts) and the aliases (name -> target name) of the files."""
        links: dict[str, list[_Part]] = {}
        aliases: dict[str, str] = {}
        for handle in self._files:
            committed = child(handle, COMMITTED, h5py.Dataset)
            check_read(committed, committed.size)
            counts = np.asarray(committed[()], np.int64).reshape(-1)
            sites = child(handle, "vars", h5py.Group)
            tagged = int(handle.attrs[FORMAT_ATTR]) >= 2  # (checked by open_file)
            live = handle.swmr_mode and _writer_alive(handle)
            try:
                indexed = _indexed(handle, counts)
            except RunFileError as error:
                if not (live and _BEYOND_VIEW.search(str(error))):
                    raise
                indexed = None  # the writer grew the index after this reader's view of the file
            if indexed is None:
                parts = [
                    _Part.walked(sites, link, counts, self._ahead, tagged=tagged) for link in sites
                ]
            else:
                parts = [
                    _Part(sites, link, slot, int(counts[slot]), self._ahead, first, tagged=tagged)
                    for slot, link, first, target in indexed
                    if target == NO_TARGET
                ]
                aliases = _aliases(indexed) | aliases  # the first file's, where shards differ
            for part in parts:
                if not part.rows:  # a site a killed writer created but never flushed is left out
                    continue
                if live:  # its datasets may lie past this reader's view
                    try:
                        part.open()
                        _ = part.first_order
                    except RunFileError as error:
                        if _BEYOND_VIEW.search(str(error)):
                            continue  # the writer made the site after this reader's view
                        raise
                links.setdefault(unescape(part._link), []).append(part)
        # A site of its own wins over an alias (a commit cut short between them); an alias
        # whose target was never committed is left out.
        kept = {
            name: target
            for name, target in aliases.items()
            if target in links and name not in links
        }
        return links, kept

    @property
    def aliases(self) -> dict[str, str]:
        """Alias name -> the name of the site whose records it reads (stored once); empty
        when the run has none.  See [`H5PYSaverCallback.alias`][vartrace.H5PYSaverCallback.alias].

        Example: `run[alias].values is run[run.aliases[alias]].values`.
        """
        return dict(self._catalogue[1])

    @cached_property
    def names(self) -> list[str]:
        """The site names in execution order: by the capture order of each site's first record.

        `blocks.2` comes before `blocks.10` when the model ran it first.
        Ties (sites of shards with independent counters) go by name.
        """
        links, aliases = self._catalogue

        def key(name: str) -> tuple[int, str]:
            return _first_order(links[aliases.get(name, name)]), name

        return sorted([*links, *aliases], key=key)

    def __getitem__(self, name: str) -> Site:
        site = self._sites.get(name)
        if site is None:
            links, aliases = self._catalogue
            parts = links.get(aliases.get(name, name))
            if parts is None:
                raise missing_site(name, [*links, *aliases], self._describe())
            site = self._sites[name] = Site(name, parts, self.allow_pickle)
        return site

    def __contains__(self, name: object) -> bool:
        links, aliases = self._catalogue
        return name in links or name in aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        links, aliases = self._catalogue
        return len(links) + len(aliases)

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The run metadata (of the first file for shards); empty if none was written."""
        handle = self._files[0]
        if not handle.id.links.exists(b"meta"):
            return {}
        return _read_tree(child(handle, "meta", h5py.Group))

    def to_frame(
        self,
        stat: str | Callable[[Any], Any] | Sequence[str] = "mean",
        names: Sequence[str] | None = None,
    ) -> Any:
        """A pandas DataFrame with one row per record and a column per statistic.

        Columns: site, iteration, rank, order, shape, dtype and the statistic
        (named after `stat`).  `stat` is a name of
        `vartrace.analysis.sources.STATS` (`mean`, `std`, `var`, `min`, `max`,
        `absmax`, `norm` over the finite values; `nan`, `posinf`, `neginf`,
        `zeros`, `count`: float64, NaN for non-numeric records), a field of
        statistics records (`q0.5`; records of [`vartrace.stats`][vartrace.stats] give their
        stored fields) or a callable receiving each record's value as
        [`Site.get`][vartrace.Site.get] returns it; a list of names gives a column each
        (`run.to_frame(["absmax", "nan"])`).

        Example: `run.to_frame("absmax").groupby("site")["absmax"].max()`.
        """
        try:
            import pandas as pd
        except ImportError as exc:
            hint = "pip install 'torch-vartrace[pandas]'"
            raise ImportError(f"Run.to_frame() needs pandas: {hint}") from exc

        wanted = [stat] if callable(stat) or isinstance(stat, str) else list(stat)
        for one in wanted:
            if not callable(one) and one not in STATS and not one.startswith(("q", "log2|x|")):
                raise ValueError(
                    f"unknown statistic {one!r}; use one of {sorted(STATS)}, a field of "
                    "statistics records (q0.5, log2|x|=3...) or a callable"
                )
        named = [
            one if isinstance(one, str) else getattr(one, "__name__", "stat") for one in wanted
        ]
        stat_columns = ["stat" if column == "<lambda>" else column for column in named]
        frames = []
        for name in self.names if names is None else names:
            site = self[name]
            table: dict[str, Any] = {}
            for one, column in zip(wanted, stat_columns, strict=True):
                described = [part.describe(one, self.allow_pickle, name) for part in site._parts]
                merged = (
                    described[0]
                    if len(described) == 1
                    else [described[part][row] for part, row in site._where]
                )
                stats, dtypes, shapes = zip(*merged, strict=True) if merged else ((), (), ())
                table[column] = stats
            frames.append(
                pd.DataFrame(
                    {
                        "site": name,
                        "iteration": site.iterations,
                        "rank": site.ranks,
                        "order": site.order,
                        "shape": shapes,
                        "dtype": dtypes,
                        **table,
                    }
                )
            )
        columns = ["site", "iteration", "rank", "order", "shape", "dtype", *stat_columns]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)

    def _describe(self) -> str:
        return str(self.paths[0]) if len(self.paths) == 1 else f"{len(self.paths)} shards"

    def close(self) -> None:
        """Close the files."""
        for handle in self._files:
            handle.close()
        self._files = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Run {self._describe()} sites={len(self)}>"


def open_run(
    path_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    allow_pickle: bool = False,
) -> Run:
    """Open a run file read-only (`vartrace.open`), lazily.

    `path_or_glob` is a path, a glob pattern (`"run.rank*.h5"`) or a list
    of paths; several files are read as the shards of one run.  Pickled
    records are refused unless `allow_pickle=True`, since unpickling runs
    code stored in the file.

    Example:
        ```python
        with vartrace.open("run.h5") as run:
            print(run.names, run.meta["git"].get("commit"))
        ```
    """
    return Run(_expand(path_or_glob), allow_pickle=allow_pickle)
