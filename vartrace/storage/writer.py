"""The streaming HDF5 writer: a post-gather callback that appends every chunk to a file.

Example:
    ```python
    from vartrace import H5PYSaverCallback, ModelTracer

    with H5PYSaverCallback("run.h5", compression="blosc") as saver, ModelTracer(
        model, ["layers.*.attn.forward.scores"], post_gather_callbacks=[saver],
        gathering_interval=8,
    ):
        train(model)
    ```

Each call appends the chunk's records to the site's datasets and empties the
chunk, so memory stays bounded; the tracer calls [`flush`][vartrace.H5PYSaverCallback.flush]
once after each gather.  The file is written in HDF5's SWMR mode: a process
killed at any moment leaves a file holding every record flushed before, and
`vartrace.open` (or `h5py.File(path, "r", swmr=True)`) can read a file
while it is being written.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import difflib
import errno
import functools
import itertools
import math
import os
import re
import signal
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np

from vartrace._support import forks as _forks
from vartrace._support import memory as _memory
from vartrace._support.memory import held_bytes
from vartrace._support.warnings import release, warn
from vartrace.reduced import ReducedFrom
from vartrace.storage._codec import (
    IN_OTHER,
    Kind,
    Leaf,
    dtype_name,
    encode,
    row_shapes,
    to_blob,
    unstored,
)
from vartrace.storage._layout import (
    COMMITTED,
    FIRST_ORDER,
    FORMAT_ATTR,
    FORMAT_VERSION,
    LAST_TAGS,
    LIBVER,
    NAME_END,
    NAME_START,
    NO_TARGET,
    REDUCED_DTYPE,
    REDUCED_SHAPE,
    SITE_INDEX,
    SITE_NAMES,
    TAGGED,
    TAGS,
    TARGET,
    clear_write_flags,
    escape,
    has_write_flags,
    reduced_from,
    run_attrs,
    shard_path,
    unescape,
    writer_alive,
)
from vartrace.storage._swmr import open_swmr
from vartrace.storage._worker import Worker
from vartrace.storage.metadata import collect_metadata, metadata_options
from vartrace.trace import RunContext, Trace, report_during

__all__ = ["COMPRESSIONS", "H5PYSaverCallback", "recover", "unused_savers"]

_CHUNK_TARGET = 512 << 10  # bytes of a multi-record chunk
_CHUNK_MAX = 8 << 20  # a record bigger than this is split into several chunks
_TAG_CHUNK = 4096  # most rows of a chunk
# Bytes a chunk of small records holds at least.  Each new chunk of a dataset with several
# resizable axes costs 2-4 KiB of HDF5 B-tree nodes in SWMR mode (a node is rewritten
# elsewhere at each flush); one-axis datasets (0-d records) use a far cheaper index.
_CHUNK_MIN = 16 << 10
_CHUNK_MIN_0D = 4 << 10
_GATHERS_A_CHUNK = 2  # a chunk of tags holds about this many gathers' records
_TAG_ROWS_MIN = 256  # fewest rows of a chunk of per-record tags (2 KiB of int64)
# A record whose shape would make ``values`` allocate more than this many times its own
# bytes (plus one chunk and _SPREAD_SLACK) goes to ``other`` unpadded: chunks are shaped by
# the site's first record, and a (1, 4096) record in chunks shaped (4096, 1) fills 4096 of them.
_SPREAD = 4
_SPREAD_SLACK = 64 << 10
_UNFILTERED = 0xFFFFFFFF  # a chunk's filter mask: stored as it is, no filter applied
# Sites whose datasets stay open between gathers (about 200 KiB of HDF5 memory each).
# Beyond this the least recently written are closed and reopened when written (about 2 ms).
_OPEN_SITES = 2048
# HDF5's metadata cache of the file (bytes it starts at, least, most: HDF5's own ceiling).
# With HDF5's default cache (2 MiB at first) SWMR mode fails ("Child entry doesn't have a
# flush dependency parent array") once a few hundred sites are open while new ones are
# created: an eviction bug that a cache holding the open objects' metadata does not meet.
_METADATA_CACHE = (64 << 20, 32 << 20, 128 << 20)
_CLOSING_CACHE = 1 << 20  # bytes of it that a closing file keeps (see _shrink_metadata_cache)
_SLOTS = 4096  # record counts per chunk of /committed
_INDEX_ROWS = 128  # slots per chunk of /site_index (4 KiB: a small file stays small)
_NAME_BYTES = 4 << 10  # bytes per chunk of /site_names
# Chunk cache of each open dataset: small chunks (tags, small records) are written from it
# at the flush; bigger chunks go straight to the file (a compressed one whole, a partly
# filled one unfiltered, see _Site._put_records).  A cache keeps up to its size of every open
# dataset's chunks in memory (1 MiB: up to 10 GiB for 1,000 sites).  Few hash slots: each of
# HDF5's default 521 costs memory in every open dataset.
_CACHE_BYTES = 64 << 10
_CACHE_SLOTS = 17
# Chunks of 4 KiB and more start at a multiple of 64 bytes in the file (a cache line; under
# 2% more bytes): a reader's memory map then sees aligned arrays, which numpy reduces in
# place, where it copies unaligned ones piece by piece through a buffer first.
_FILE_OPTIONS = {
    "libver": LIBVER,
    "rdcc_nbytes": _CACHE_BYTES,
    "rdcc_nslots": _CACHE_SLOTS,
    "alignment_threshold": 4 << 10,
    "alignment_interval": 64,
}
_STACK_BELOW = 1 << 20  # smaller equally shaped records are written together, up to this many bytes
# With background=True, the records the writer thread holds and those the tracer gathers
# add up to at most the largest gather handed to the thread, or this many bytes if more
# (see make_room): a tracer's record, or a gather, waits for the thread until they fit.
_BACKGROUND_BYTES = 64 << 20
_WRITTEN = frozenset((*TAGS, TAGGED, "values", "shapes", "other"))  # datasets a gather writes
_BLOB = h5py.vlen_dtype(np.uint8)
_STR = h5py.string_dtype("utf-8")


def _blosc(version: int, cname: Literal["lz4", "zstd"]) -> dict[str, Any]:
    try:
        import hdf5plugin
    except ImportError as error:
        raise ImportError(
            "compression='blosc*' needs hdf5plugin: pip install 'torch-vartrace[compress]'"
        ) from error

    if version == 1:
        return dict(hdf5plugin.Blosc(cname=cname, clevel=1, shuffle=hdf5plugin.Blosc.SHUFFLE))
    return dict(hdf5plugin.Blosc2(cname=cname, clevel=1, filters=hdf5plugin.Blosc2.SHUFFLE))


COMPRESSIONS = {
    "blosc": lambda: _blosc(1, "lz4"),
    "blosc2": lambda: _blosc(2, "lz4"),
    "blosc2-zstd": lambda: _blosc(2, "zstd"),
}
"""Shortcut compression names, all level 1 with byte shuffle: `"blosc"` (Blosc + LZ4, the
fastest: the recommended one), `"blosc2"` (Blosc2 + LZ4), `"blosc2-zstd"` (Blosc2 +
Zstd: smaller files, about half the speed).  They need `pip install hdf5plugin`."""


#: Compression names HDF5 itself knows (h5py's), besides the shortcuts of :data:`COMPRESSIONS`.
_BUILTIN_COMPRESSIONS = ("gzip", "lzf", "szip")


def _filters(compression: Any, options: Any, shuffle: bool) -> dict[str, Any]:
    """The dataset filter options of a compression setting, checked: `ValueError` if unusable."""
    if isinstance(compression, str) and compression in COMPRESSIONS:
        filters = COMPRESSIONS[compression]()
    elif isinstance(compression, str) and compression not in _BUILTIN_COMPRESSIONS:
        known = [*COMPRESSIONS, *_BUILTIN_COMPRESSIONS]
        close = difflib.get_close_matches(compression, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown compression {compression!r}: {hint}use one of {', '.join(known)}, "
            "an HDF5 filter number or an hdf5plugin filter object"
        )
    elif isinstance(compression, Mapping):  # an hdf5plugin filter object
        filters = dict(compression)
    else:
        filters = {"compression": compression, "compression_opts": options}
    if shuffle:
        filters["shuffle"] = True
    filters = {key: value for key, value in filters.items() if value is not None}
    _probe(filters, compression)
    return filters


def _probe(filters: dict[str, Any], compression: Any) -> None:
    """Create a dataset with `filters` in memory, so a bad setting fails now, not at a gather."""
    if not filters:
        return
    try:
        with h5py.File(
            f"vartrace-probe-{id(filters)}", "w", driver="core", backing_store=False
        ) as f:
            f.create_dataset("probe", (1, 4), np.float32, chunks=(1, 4), **filters)
    except (ValueError, TypeError, OSError, KeyError) as error:
        plugin = isinstance(compression, int) and compression >= 256
        hint = " (a plugin filter: pip install 'torch-vartrace[compress]')" if plugin else ""
        raise ValueError(f"compression {compression!r} cannot be used{hint}: {error}") from None


class _Made:
    """Makes the groups, datasets and attributes of sites with HDF5's own calls.

    h5py's `create_group`, `create_dataset` and `attrs[...] = ...` build a new
    creation property list, datatype and dataspace at each call: most of the cost of
    a site's creation.  Here the first dataset of each layout (dtype, maximum shape,
    chunks, fill value, filters) and the first group are made by h5py, and the later
    ones reuse their creation property lists and datatypes: the same objects, made
    for a fraction of the time.  Example:

    ```python
    made = _Made({"compression": "gzip"})
    values = made.dataset(group, "values", (0, 4), np.dtype(np.float32),
                          chunks=(16, 4), filtered=True)
    made.attribute(values, "storage", "array")
    ```
    """

    def __init__(self, filters: Mapping[str, Any]) -> None:
        """`filters`: h5py's keyword arguments of the filters of datasets `filtered`."""
        self.filters = dict(filters)
        # layout -> (datatype, creation property list) of the first dataset made with it
        self.layouts: dict[tuple[Any, ...], tuple[h5py.h5t.TypeID, h5py.h5p.PropDCID]] = {}
        self.gcpl: h5py.h5p.PropGCID | None = None  # the first group's
        self.lcpls: dict[int, h5py.h5p.PropLCID] = {}  # character set of a link name -> its list
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        # Attribute types as h5py makes them: (stored type, type of the data written).
        self.types = {
            kind: (h5py.h5t.py_create(dtype, logical=True), h5py.h5t.py_create(dtype))
            for kind, dtype in ((int, np.dtype(np.int64)), (str, _STR))
        }

    def group(self, parent: h5py.Group, name: str) -> h5py.Group:
        """Create `parent`'s subgroup `name`, as `parent.create_group(name)` does."""
        if self.gcpl is None:
            group = parent.create_group(name)
            self.gcpl = group.id.get_create_plist()
            return group
        link, cset = (
            (name.encode("ascii"), h5py.h5t.CSET_ASCII)
            if name.isascii()
            else (name.encode("utf-8"), h5py.h5t.CSET_UTF8)
        )  # what h5py does
        lcpl = self.lcpls.get(cset)
        if lcpl is None:
            lcpl = self.lcpls[cset] = h5py.h5p.create(h5py.h5p.LINK_CREATE)
            lcpl.set_create_intermediate_group(True)
            lcpl.set_char_encoding(cset)
        return h5py.Group(h5py.h5g.create(parent.id, link, lcpl=lcpl, gcpl=self.gcpl))

    def dataset(
        self,
        group: h5py.Group,
        name: str,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        maxshape: tuple[int | None, ...] | None = None,
        chunks: tuple[int, ...] | None = None,
        fillvalue: int | None = None,
        filtered: bool = False,
    ) -> h5py.h5d.DatasetID:
        """Create `group`'s dataset `name` (ASCII) as `group.create_dataset` does, resizable
        along every axis unless `maxshape` says otherwise; `filtered` with the filters.

        It returns HDF5's identifier, which `h5py.Dataset(...)` wraps where needed: the
        wrapper makes three property lists of its own (a third of a dataset's creation)."""
        maxshape = (None,) * len(shape) if maxshape is None else maxshape
        # h5py guesses the chunks of a dataset given none from its shape; vlen types differ
        # in their metadata only
        layout = (
            dtype,
            repr(dtype.metadata),
            maxshape,
            chunks or shape,
            chunks is None,
            fillvalue,
            filtered,
        )
        made = self.layouts.get(layout)
        if made is None:
            filters = self.filters if filtered else {}
            dataset = group.create_dataset(
                name, shape, dtype, maxshape=maxshape, chunks=chunks, fillvalue=fillvalue, **filters
            )
            self.layouts[layout] = (dataset.id.get_type(), dataset.id.get_create_plist())
            return dataset.id
        datatype, dcpl = made
        unlimited = tuple(h5py.h5s.UNLIMITED if size is None else size for size in maxshape)
        space = h5py.h5s.create_simple(shape, unlimited)
        return h5py.h5d.create(group.id, name.encode(), datatype, space, dcpl=dcpl)

    def attribute(
        self, target: h5py.h5g.GroupID | h5py.h5d.DatasetID, name: str, value: int | str
    ) -> None:
        """Give the group or dataset `target` the scalar attribute `name` (a new one), as
        `attrs[name] = value` does: an int64, or a variable-length UTF-8 string."""
        stored, written = self.types[type(value)]
        data = np.array(value, np.int64 if isinstance(value, int) else _STR)
        attribute = h5py.h5a.create(target, name.encode(), stored, self.scalar)
        attribute.write(data, mtype=written)


#: What netCDF-4 names a dimension scale that is no variable (h5netcdf reads it so).
_DIMENSION = b"This is a netCDF dimension but not a netCDF variable."
#: A version-2 site's dimension-only scale of the record axis.
_RECORDS = "records"


def _label(
    made: _Made,
    group: h5py.Group,
    records: h5py.h5d.DatasetID,
    dataset: h5py.h5d.DatasetID,
    stem: str,
) -> list[h5py.h5d.DatasetID]:
    """Label `dataset` (`group`'s `stem`) for h5netcdf / xarray: the record axis by the
    site's scale `records` (`iterations`, a coordinate, in a version-1 file), the others
    by dimension-only scales `<stem>_dim<k>` (resized with it), which it returns."""
    h5py.h5ds.attach_scale(dataset, records, 0)
    scales = []
    for axis, size in enumerate(dataset.shape[1:], 1):
        scale = made.dataset(group, f"{stem}_dim{axis}", (size,), np.dtype(np.uint8))
        h5py.h5ds.set_scale(scale, _DIMENSION)
        h5py.h5ds.attach_scale(dataset, scale, axis)
        scales.append(scale)
    return scales


def _site_datasets(group: h5py.Group) -> dict[str, h5py.h5d.DatasetID]:
    """The datasets a site's writer keeps open: tags, `values`, `shapes`, `other` and
    the labels of `values`' axes (the other labels never change)."""
    return {
        name: group[name].id for name in group if name in _WRITTEN or name.startswith("values_dim")
    }


def _gather_rows(records: int) -> int:
    """Rows of a site's tag chunks, from the records of its first gather: about
    `_GATHERS_A_CHUNK` gathers' worth (a power of two), so that a short run's file
    holds little unused space and a long run's few chunks.

    Example: `_gather_rows(8) == 256` (the floor), `_gather_rows(1000) == 2048`.
    """
    rows = 1 << (max(1, records * _GATHERS_A_CHUNK) - 1).bit_length()
    return min(_TAG_CHUNK, max(_TAG_ROWS_MIN, rows))


def _chunk_rows(records: int, record_bytes: int, least: int = _CHUNK_MIN) -> int:
    """Rows of a `values` chunk, from the records of the site's first gather: a gather of
    as many fills whole chunks, so a compressed chunk is written once, never rewritten.

    A gather above `_CHUNK_TARGET` bytes is split into equal chunks; one below
    `least` bytes gets a chunk of several gathers.  Example:
    `_chunk_rows(20, 32 << 10) == 10` (two chunks a gather), `_chunk_rows(8, 1024) == 16`.
    """
    most = max(1, min(_TAG_CHUNK, _CHUNK_TARGET // max(1, record_bytes)))
    records = max(1, records)
    if records >= most:
        return -(-records // -(-records // most))
    gathers = -(-least // (records * max(1, record_bytes)))
    return min(records * gathers, most)


def _chunks(shape: tuple[int, ...], itemsize: int, records: int) -> tuple[int, ...]:
    """Chunk shape of `values` for records of `shape`, the site's first gather holding
    `records` of them: whole records (split when above `_CHUNK_MAX`), rows as
    `_chunk_rows` gives."""
    dims = [max(1, size) for size in shape]
    while int(np.prod(dims)) * itemsize > _CHUNK_MAX:
        largest = int(np.argmax(dims))
        dims[largest] = -(-dims[largest] // 2)
    least = _CHUNK_MIN if shape else _CHUNK_MIN_0D
    return (_chunk_rows(records, int(np.prod(dims)) * itemsize, least), *dims)


@functools.lru_cache(maxsize=256)
def _memory_space(shape: tuple[int, ...]) -> h5py.h5s.SpaceID:
    """The dataspace of an array of `shape` in memory, made once (h5py makes one a write)."""
    return h5py.h5s.create_simple(shape)


@functools.lru_cache(maxsize=64)
def _memory_type(dtype: np.dtype[Any]) -> h5py.h5t.TypeID:
    """The HDF5 type of a numeric `dtype` in memory, made once (h5py makes one a write)."""
    return h5py.h5t.py_create(dtype)


def _put(dataset: h5py.Dataset, offset: tuple[int, ...], data: np.ndarray) -> None:
    """Write `data` into `dataset` at `offset` (h5py's low-level calls: fast)."""
    data = np.ascontiguousarray(data)
    space = dataset.id.get_space()
    space.select_hyperslab(offset, data.shape)
    # numeric types are made once; variable-length ones as h5py's write makes them
    mtype = _memory_type(data.dtype) if data.dtype.kind in "biuf" else None
    dataset.id.write(_memory_space(data.shape), space, data, mtype=mtype)


class _Rows:
    """A dataset of a site that grows along its first axis (a tag, `shapes`, a label of
    `values`' axes) with its file dataspace, kept at the dataset's extent: appending rows
    makes no HDF5 object but the selection, where `_put` gets the dataspace from HDF5 at
    each write (a third of a small write's time).

    Example: `rows.extend(stop); rows.put(start, data)` writes rows `start:stop`.
    """

    def __init__(self, dataset: h5py.h5d.DatasetID) -> None:
        self.id = dataset
        self.space = dataset.get_space()
        self.tail = self.space.shape[1:]  # the shape of a row

    def extend(self, rows: int) -> None:
        """Give the dataset `rows` rows."""
        shape = (rows, *self.tail)
        self.id.set_extent(shape)
        self.space.set_extent_simple(shape, (h5py.h5s.UNLIMITED, *self.tail))

    def put(self, row: int, data: np.ndarray) -> None:
        """Write `data` (numeric rows) from `row` on, within the extent."""
        data = np.ascontiguousarray(data)
        self.space.select_hyperslab((row, *(0 for _ in self.tail)), data.shape)
        self.id.write(_memory_space(data.shape), self.space, data, mtype=_memory_type(data.dtype))

    def read(self, rows: int) -> np.ndarray:
        """The first `rows` rows (within the extent)."""
        out = np.empty((rows, *self.tail), self.id.dtype)
        self.space.select_hyperslab((0, *(0 for _ in self.tail)), out.shape)
        self.id.read(_memory_space(out.shape), self.space, out, mtype=_memory_type(out.dtype))
        return out


def _int64(tags: Any) -> np.ndarray:
    return np.asarray(tags, dtype=np.int64).reshape(-1)


def _text(value: str) -> str:
    """`value` as an HDF5 UTF-8 string can hold it (NULs and undecodable bytes escaped)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")


def _write_tree(group: h5py.Group, tree: Mapping[str, Any]) -> None:
    """Store a nested dict of str / numbers / bools / str lists as datasets under `group`."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _write_tree(group.create_group(escape(key)), value)
        elif isinstance(value, str):
            group.create_dataset(escape(key), data=_text(value), dtype=_STR)
        elif isinstance(value, (list, tuple)):
            rows = [_text(item) for item in value]
            group.create_dataset(escape(key), data=rows, shape=(len(rows),), dtype=_STR)
        else:
            group.create_dataset(escape(key), data=value)


class _Site:
    """The datasets of one site and the appending logic."""

    def __init__(
        self,
        group: h5py.Group,
        options: dict[str, Any],
        made: _Made,
        rows: int,
        created: tuple[int, Mapping[str, h5py.h5d.DatasetID]] | None = None,
    ) -> None:
        """The site of `group` holding `rows` committed records, its datasets made by
        `made`; `created` (slot, name -> dataset) for a site just created, else they are
        looked up."""
        self.group = group
        self.options = options
        self.made = made
        slot, found = created or (int(group.attrs["slot"]), _site_datasets(group))
        self.slot = slot
        # a version-2 file's one `tags` dataset, else one dataset a tag (see _layout)
        self.tags = [_Rows(found[name]) for name in ((TAGGED,) if TAGGED in found else TAGS)]
        self.values = None if "values" not in found else h5py.Dataset(found["values"])
        self.gather_rows = self.tags[0].id.get_create_plist().get_chunk()[0]
        self.shapes = None if "shapes" not in found else _Rows(found["shapes"])
        self.other = None if "other" not in found else h5py.Dataset(found["other"])
        self.rows = rows  # committed records; rows past them (a killed writer's) are rewritten
        self.chunk = None if self.values is None else self.values.chunks
        # whether `values` passes its chunks through the saver's filters (see _create_values)
        self.filtered = (
            self.values is not None and self.values.id.get_create_plist().get_nfilters() > 0
        )
        self.padded: tuple[int, ...] = () if self.values is None else self.values.shape[1:]
        # the labels of the record's axes (none in files made before them), resized with values
        labels = (found.get(f"values_dim{axis}") for axis in range(1, len(self.padded) + 1))
        self.scales = [_Rows(scale) for scale in labels if scale is not None]
        self.storage = "" if self.values is None else str(self.values.attrs["storage"])
        self.key = "" if self.values is None else str(self.values.attrs.get("key", ""))
        self.warned = False  # about a record that could not be stored
        self.spread: dict[tuple[int, ...], bool] = {}  # record shape -> _spread's answer
        # The record axis' scale, only in the gather that creates the site (datasets made
        # later are not labelled): HDF5 cannot change a scale's back references once SWMR
        # readers may have seen it.  A site of a file made before scales has none.
        self.records: h5py.h5d.DatasetID | None = None

    @classmethod
    def create(
        cls,
        parent: h5py.Group,
        name: str,
        options: dict[str, Any],
        made: _Made,
        slot: int,
        records: int,
    ) -> _Site:
        """A new site whose first gather holds `records` records (its chunks' size), laid
        out as `options["format"]` says."""
        group = made.group(parent, escape(name))
        made.attribute(group.id, "slot", slot)
        if _utf8(name):  # for people browsing the file; the reader unescapes the link name
            made.attribute(group.id, "name", name)
        rows = _gather_rows(records)
        if options["format"] >= 2:
            width = len(TAGS)
            tags = {
                TAGGED: made.dataset(
                    group,
                    TAGGED,
                    (0, width),
                    np.dtype(np.int64),
                    maxshape=(None, width),
                    chunks=(rows, width),
                )
            }
            scale = made.dataset(group, _RECORDS, (0,), np.dtype(np.uint8), chunks=(1,))
            h5py.h5ds.set_scale(scale, _DIMENSION)  # never grown: h5netcdf sizes it by its users
        else:
            tags = {
                tag: made.dataset(
                    group,
                    tag,
                    (0,),
                    np.dtype(np.uint8 if tag == "kinds" else np.int64),
                    chunks=(rows,),
                )
                for tag in TAGS
            }
            scale = tags["iterations"]
            h5py.h5ds.set_scale(scale, b"")  # the record axis' coordinate (see _label)
        for tag, dataset in tags.items():
            if tag != "iterations":
                _label(made, group, scale, dataset, tag)
        site = cls(group, options, made, 0, (slot, tags))
        site.records = scale
        return site

    def _encode(self, value: Any) -> Leaf:
        try:
            return encode(value, self.options["float_dtype"], self.options["int_dtype"])
        except TypeError as error:  # neither storable nor picklable: a marker, not a failed step
            leaf = unstored(value, error)
            if not self.warned:
                self.warned = True
                name = unescape(self.group.name.rsplit("/", 1)[-1])
                warn(
                    f"vartrace: site {name!r}: {error}; the file holds a vartrace.Unstored "
                    f"marker instead ({leaf.data!r})",
                    RuntimeWarning,
                )
            return leaf

    def _fits(self, leaf: Leaf) -> bool:
        if self.storage == "array":
            return (
                isinstance(leaf.data, np.ndarray)
                and leaf.key == self.key
                and not self._spread(leaf.data.shape)
            )
        if self.storage == "str":
            return leaf.kind == Kind.STR and _utf8(leaf.data)
        return leaf.kind != Kind.NONE

    def _spread(self, shape: tuple[int, ...]) -> bool:
        """Whether a record of `shape` would make `values` allocate far more than its
        bytes (see `_SPREAD`): it goes to `other` instead, unpadded."""
        spread = self.spread.get(shape)
        if spread is None:
            assert self.values is not None and self.chunk is not None
            rows, *tile = self.chunk
            tiles = math.prod(-(-size // step) for size, step in zip(shape, tile, strict=True))
            itemsize = self.values.dtype.itemsize
            chunk = rows * math.prod(tile) * itemsize
            record = math.prod(shape) * itemsize
            spread = tiles > 1 and tiles * chunk > _SPREAD * record + chunk + _SPREAD_SLACK
            self.spread[shape] = spread
        return spread

    def _create_values(self, leaf: Leaf, records: int) -> None:
        """Create `values` for records like `leaf`, `records` of them in this gather."""
        rows, made, group, scale = self.rows, self.made, self.group, self.records
        if isinstance(leaf.data, np.ndarray):
            shape, ndim = leaf.data.shape, leaf.data.ndim
            self.storage, self.key, self.padded = "array", leaf.key, shape
            self.chunk = _chunks(shape, leaf.data.dtype.itemsize, records)
            # Only a chunk that one gather fills goes through the filters (see _put_records):
            # where the first gather fills none, the chunks are filled over several gathers and
            # stored unfiltered, and a filter would only add its message to the header.
            self.filtered = bool(self.options["filters"]) and records >= self.chunk[0]
            values = made.dataset(
                group,
                "values",
                (rows, *shape),
                leaf.data.dtype,
                chunks=self.chunk,
                filtered=self.filtered,
            )
            for attribute, text in (
                ("storage", "array"),
                ("key", leaf.key),
                ("torch_dtype", leaf.torch_dtype),
            ):
                made.attribute(values, attribute, text)
            if scale is not None:
                self.scales = [_Rows(dim) for dim in _label(made, group, scale, values, "values")]
            if ndim and len(self.tags) > 1:  # version 1: always; 2: once a record needs it
                self._create_shapes(ndim)
        else:
            self.storage = "str" if leaf.kind == Kind.STR and _utf8(leaf.data) else "blob"
            dtype = _STR if self.storage == "str" else _BLOB
            values = made.dataset(group, "values", (rows,), dtype, chunks=(self.gather_rows,))
            made.attribute(values, "storage", self.storage)
            if scale is not None:
                _label(made, group, scale, values, "values")
        self.values = h5py.Dataset(values)

    def _create_shapes(self, ndim: int) -> None:
        """Create `shapes` for records of `ndim` axes, its rows of records written so far
        unset (-1)."""
        shapes = self.made.dataset(
            self.group,
            "shapes",
            (self.rows, ndim),
            np.dtype(np.int64),
            maxshape=(None, ndim),
            chunks=(self.gather_rows, ndim),
            fillvalue=-1,
        )
        if self.records is not None:
            _label(self.made, self.group, self.records, shapes, "shapes")
        self.shapes = _Rows(shapes)

    def _shapes_needed(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """In a version-2 file, create `shapes` once a record is not of `values`' row shape
        (before this gather's growth: `shapes`, those of this gather's records in
        `values`), and give it the records written so far, all of the old row shape."""
        if self.shapes is not None or len(self.tags) > 1 or not self.padded:
            return
        if all(shape == self.padded for shape in shapes):
            return
        self._create_shapes(len(self.padded))
        if self.rows:
            assert self.shapes is not None
            kinds = self.tags[0].read(self.rows)[:, TAGS.index("kinds")]
            self.shapes.extend(self.rows)
            self.shapes.put(0, row_shapes(kinds, self.padded))
            # on disk now: a writer killed before this gather's flush leaves the committed
            # records' shapes, not the fill value, in a dataset its cache may have written
            self.shapes.id.flush()

    def append(self, trace: Trace) -> int:
        """Append the records of `trace`; return the bytes of their arrays."""
        count = len(trace)
        if not count:
            return 0
        start, stop = self.rows, self.rows + count
        block = self._block(trace)
        if block is not None:
            self._write_block(block.data, trace.shapes, start, stop)
            kinds = np.full(count, block.kind, np.uint8)
            nbytes = block.data.nbytes
        else:
            leaves = [self._encode(value) for value in trace.records()]
            kinds = self._write_leaves(leaves, start, stop)
            nbytes = sum(leaf.data.nbytes for leaf in leaves if isinstance(leaf.data, np.ndarray))
        columns = [_int64(tag) for tag in (trace.iterations, trace.ranks, trace.order)]
        if len(self.tags) == 1:
            tags = self.tags[0]
            tags.extend(stop)
            tags.put(start, np.stack([*columns, kinds.astype(np.int64)], axis=1))
        else:
            for rows, data in zip(self.tags, (*columns, kinds), strict=True):
                rows.extend(stop)
                rows.put(start, data)
        self.rows = stop
        self.records = None
        return nbytes

    def _block(self, trace: Trace) -> Leaf | None:
        """The stacked values of `trace` as one leaf, when they go to `values` as they are."""
        if isinstance(trace.values, (list, tuple)):
            return None
        leaf = self._encode(trace.values)
        if not isinstance(leaf.data, np.ndarray) or leaf.data.ndim == 0:
            return None
        record = leaf._replace(data=leaf.data[0, ...])
        if self.values is None:
            self._create_values(record, len(leaf.data))
        return leaf if self._fits(record) else None

    def _extend(self, stop: int, shapes: Sequence[tuple[int, ...]] = ()) -> None:
        """Give every per-record dataset `stop` rows, growing `values` to fit `shapes`."""
        assert self.values is not None
        self._shapes_needed(shapes)
        if shapes:
            self.padded = tuple(max(sizes) for sizes in zip(self.padded, *shapes, strict=True))
        self.values.id.set_extent((stop, *self.padded))
        for scale, size in zip(self.scales, self.padded, strict=False):
            if scale.space.shape[0] < size:
                scale.extend(size)
        if self.shapes is not None:
            self.shapes.extend(stop)
        if self.other is not None:
            self.other.id.set_extent((stop,))

    def _write_block(self, data: np.ndarray, shapes: Any, start: int, stop: int) -> None:
        record_shape = data.shape[1:]
        true = [record_shape] * (stop - start) if shapes is None else shapes
        self._shapes_needed([tuple(shape) for shape in true])  # padded records: not their rows'
        self._extend(stop, [record_shape])
        self._put_records(start, data)
        if self.shapes is not None:
            self.shapes.put(start, np.array([tuple(shape) for shape in true], np.int64))

    def _put_records(self, row: int, data: np.ndarray) -> None:
        """Write records (records x shape) from `row` on; records filling whole unfiltered
        chunks go straight to the file, past HDF5's pipeline.

        With filters, only whole chunks of rows go through them, each written once; rows
        of a chunk that later gathers still fill are stored unfiltered (see
        `_put_unfiltered`): HDF5 writes a rewritten compressed chunk elsewhere, and
        in SWMR mode never reuses the old space.
        """
        assert self.values is not None and self.chunk is not None
        if not self.filtered:
            rows = self.chunk[0]
            # chunks within the cache's size, many to a record padded past the first
            # record's shape, go faster in one H5Dwrite than in a call each
            whole = (
                data.shape[1:] == self.padded
                and row % rows == 0
                and len(data) % rows == 0
                and (
                    self.chunk[1:] == self.padded
                    or data.itemsize * math.prod(self.chunk) > _CACHE_BYTES
                )
            )
            if whole:
                self._put_chunks(row, data)
            else:
                _put(self.values, (row,) + (0,) * (data.ndim - 1), data)
            return
        rows = self.chunk[0]
        first = row
        while first < row + len(data):
            begin = first - first % rows
            end = min(begin + rows, row + len(data))
            part = data[first - row : end - row]
            if first == begin and end == begin + rows:
                _put(self.values, (first,) + (0,) * (data.ndim - 1), part)
            else:
                self._put_unfiltered(first, part)
            first = end

    def _put_chunks(self, row: int, data: np.ndarray) -> None:
        """Write unfiltered records that fill whole rows of chunks (`row` and their count
        multiples of the chunk's rows, their shape the padded one) chunk by chunk: each
        whole chunk from the records' own memory (copied only where the chunk is not one
        piece of it), the chunks cut by a record's edge through `H5Dwrite`.

        Through `H5Dwrite`, HDF5 copies each new chunk larger than the chunk cache into a
        buffer of the chunk's size, allocated and freed per chunk: on the writer thread
        of `background=True`, from a glibc arena of that thread's own, which kept two of
        them beside the records (15 MiB for 30 MiB records in chunks of 7.5 MiB).
        """
        assert self.values is not None and self.chunk is not None
        spans = [range(0, size, step) for size, step in zip(data.shape, self.chunk, strict=True)]
        for corner in itertools.product(*spans):
            part = data[
                tuple(
                    slice(start, start + step)
                    for start, step in zip(corner, self.chunk, strict=True)
                )
            ]
            origin = (row + corner[0], *corner[1:])
            if part.shape == self.chunk:
                self.values.id.write_direct_chunk(origin, np.ascontiguousarray(part))
            else:
                _put(self.values, origin, part)

    def _put_unfiltered(self, row: int, data: np.ndarray) -> None:
        """Write records into the chunks of one chunk row that they fill only in part,
        stored unfiltered: the chunk's earlier rows are read back and the whole chunk is
        rewritten where it lies (it keeps its size), so every record flushed before stays
        readable at any moment; a chunk that later gathers complete stays unfiltered."""
        assert self.values is not None and self.chunk is not None
        rows, *tile = self.chunk
        begin = row - row % rows
        extent = self.values.shape[1:]
        spans = [range(0, size, step) for size, step in zip(data.shape[1:], tile, strict=True)]
        for corner in itertools.product(*spans):
            buffer = np.zeros(self.chunk, self.values.dtype)
            stored = tuple(
                slice(start, min(start + step, size))
                for start, step, size in zip(corner, tile, extent, strict=True)
            )
            if row > begin:
                held = (slice(0, row - begin), *(slice(0, s.stop - s.start) for s in stored))
                buffer[held] = self.values[(slice(begin, row), *stored)]
            new = tuple(
                slice(start, min(start + step, size))
                for start, step, size in zip(corner, tile, data.shape[1:], strict=True)
            )
            into = (
                slice(row - begin, row - begin + len(data)),
                *(slice(0, n.stop - n.start) for n in new),
            )
            buffer[into] = data[(slice(None), *new)]
            self.values.id.write_direct_chunk((begin, *corner), buffer, filter_mask=_UNFILTERED)
        # HDF5 (2.0 at least) keeps the chunk a direct write allocated in its lookup cache with
        # the filter mask it had before: reading it then runs the filters on unfiltered bytes.
        # Looking up another chunk (one past this row: usually none) replaces that entry.
        with contextlib.suppress(RuntimeError):
            self.values.id.read_direct_chunk((begin + rows, *(0 for _ in tile)))

    def _write_leaves(self, leaves: list[Leaf], start: int, stop: int) -> np.ndarray:
        """Write the records' values; return their stored kind codes."""
        kinds = np.array([leaf.kind for leaf in leaves], np.uint8)
        if self.values is None:
            first = next((leaf for leaf in leaves if leaf.kind != Kind.NONE), None)
            if first is None:
                return kinds  # only None so far: the kinds say it all
            self._create_values(first, sum(_alike(leaf, first) for leaf in leaves))
        assert self.values is not None
        fits = [self._fits(leaf) for leaf in leaves]
        misfits = [
            not fit and leaf.kind != Kind.NONE for leaf, fit in zip(leaves, fits, strict=True)
        ]
        if any(misfits) and self.other is None:
            self.other = h5py.Dataset(
                self.made.dataset(self.group, "other", (start,), _BLOB, chunks=(self.gather_rows,))
            )
        if self.storage == "array":
            self._extend(
                stop, [leaf.data.shape for leaf, fit in zip(leaves, fits, strict=True) if fit]
            )
            self._write_arrays(leaves, fits, start, stop)
        else:
            self._extend(stop)
            empty = "" if self.storage == "str" else b""
            rows = [
                (leaf.data if self.storage == "str" else to_blob(leaf)) if fit else empty
                for leaf, fit in zip(leaves, fits, strict=True)
            ]
            _put(self.values, (start,), _objects(rows))
        if self.other is not None:
            rows = [
                to_blob(leaf) if bad else b"" for leaf, bad in zip(leaves, misfits, strict=True)
            ]
            _put(self.other, (start,), _objects(rows))
            kinds[misfits] |= IN_OTHER
        return kinds

    def _write_arrays(self, leaves: list[Leaf], fits: list[bool], start: int, stop: int) -> None:
        assert self.values is not None and self.chunk is not None
        index = 0
        while index < len(leaves):
            if not fits[index]:
                index += 1
                continue
            data = leaves[index].data
            end = index + 1
            if data.shape == self.padded and data.nbytes < _STACK_BELOW:
                limit = _STACK_BELOW // max(1, data.nbytes)
                aligned = limit - (start + index + limit) % self.chunk[0]
                if aligned > 0:  # stacks end where chunks do: each is written once
                    limit = aligned
                while end < len(leaves) and end - index < limit and fits[end]:
                    if leaves[end].data.shape != self.padded:
                        break
                    end += 1
            if end - index > 1:
                self._put_records(
                    start + index, np.stack([leaf.data for leaf in leaves[index:end]])
                )
            else:
                self._put_records(start + index, data[np.newaxis])
            index = end
        if self.shapes is not None:
            rows = np.full((stop - start, len(self.padded)), -1, np.int64)
            for offset, (leaf, fit) in enumerate(zip(leaves, fits, strict=True)):
                if fit:
                    rows[offset] = leaf.data.shape
            self.shapes.put(start, rows)


def _alike(leaf: Leaf, first: Leaf) -> bool:
    """Whether `leaf` is an array record of the same dtype and shape as `first`."""
    return (
        isinstance(leaf.data, np.ndarray)
        and isinstance(first.data, np.ndarray)
        and leaf.key == first.key
        and leaf.data.shape == first.data.shape
    )


def _utf8(text: str) -> bool:
    """Whether `text` survives an HDF5 UTF-8 string exactly (no NUL, no lone surrogate)."""
    if "\0" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _objects(rows: list[str | bytes]) -> np.ndarray:
    """The rows of a variable-length dataset, as an array h5py writes (bytes as uint8)."""
    array = np.empty(len(rows), dtype=_STR if rows and isinstance(rows[0], str) else _BLOB)
    for index, row in enumerate(rows):
        array[index] = np.frombuffer(row, np.uint8) if isinstance(row, bytes) else row
    return array


def _create_index(handle: h5py.File) -> None:
    """Create `/site_index` and `/site_names`, empty (`_Index.write_rows` sizes them)."""
    handle.create_dataset(SITE_INDEX, (0, 4), np.int64, maxshape=(None, 4), chunks=(_INDEX_ROWS, 4))
    handle.create_dataset(SITE_NAMES, (0,), np.uint8, maxshape=(None,), chunks=(_NAME_BYTES,))


def _rounded(count: int, step: int) -> int:
    """`count` rounded up to a whole number of `step`s."""
    return -(-count // step) * step


def _grown(array: np.ndarray, length: int, step: int) -> np.ndarray:
    """`array` (rows first) zero-extended to hold `length` rows, at least doubled."""
    if length <= len(array):
        return array
    grown = np.zeros((_rounded(max(length, 2 * len(array)), step), *array.shape[1:]), array.dtype)
    grown[: len(array)] = array
    return grown


class _Index:
    """The root index of an open file as this session keeps it (see `_layout`): each
    slot's record count (`/committed`), its row (`/site_index`: name span, first capture
    order, alias target) and its link name's bytes (`/site_names`).

    Rows and names are written before the flush that precedes the counts
    (`write_rows`), counts after it (`write_counts`); both rewrite whole unfiltered
    chunks in place, so bytes a reader trusts never change, even in a torn write.
    """

    def __init__(self, handle: h5py.File) -> None:
        """The index of `handle`, made for a file written without one (by an older
        vartrace: it is built from `/vars`)."""
        self.handle = handle
        stored = np.asarray(handle[COMMITTED][()], np.int64)
        self.counts = stored.copy()
        self.held = {COMMITTED: len(stored), SITE_INDEX: 0, SITE_NAMES: 0}  # extents in the file
        self.slots: dict[str, int] = {}  # link name -> slot, of every group in /vars
        self.vars: h5py.Group = handle["vars"]  # the sites' groups (opened once: 0.1 ms)
        for link, group in self.vars.items():
            self.slots[link] = int(group.attrs["slot"])
        # Sites a killed writer created but never committed hold no records; their slots stay
        # theirs.  The next slot follows them and the last counted one.
        counted = np.flatnonzero(stored)
        last = int(counted[-1]) + 1 if len(counted) else 0
        self.used = max([last, *(slot + 1 for slot in self.slots.values())])
        self.counts = _grown(self.counts, self.used, _SLOTS)
        self.dirty: dict[str, set[int]] = {SITE_INDEX: set(), SITE_NAMES: set()}
        self.aliases: dict[str, tuple[int, str]] = {}  # alias -> (its slot, its target's name)
        if SITE_INDEX in handle:
            self.rows = np.asarray(handle[SITE_INDEX][()], np.int64)
            self.names = bytearray(np.asarray(handle[SITE_NAMES][()], np.uint8).tobytes())
            self.held[SITE_INDEX], self.held[SITE_NAMES] = len(self.rows), len(self.names)
            self.end = int(min(len(self.names), max([0, *self.rows[:, NAME_END]])))
            for slot in counted[counted < len(self.rows)].tolist():  # an append keeps them
                target = int(self.rows[slot, TARGET])
                if target != NO_TARGET:
                    self.aliases[unescape(self.link(slot))] = (slot, unescape(self.link(target)))
        else:
            self.rows = np.zeros((0, 4), np.int64)
            self.names = bytearray()
            self.end = 0
            _create_index(handle)
            for link, slot in self.slots.items():
                rows = int(self.counts[slot]) if slot < len(self.counts) else 0
                group = self.vars[link]
                order = (
                    group[TAGGED][:1, TAGS.index("order")]
                    if TAGGED in group
                    else group["order"][:1]
                )
                self.define(slot, link, int(order[0]) if rows and len(order) else 0)

    @staticmethod
    def create(handle: h5py.File) -> None:
        """Create the root index of a new file: `/committed` and the empty index."""
        committed = handle.create_dataset(
            COMMITTED, (_SLOTS,), np.int64, maxshape=(None,), chunks=(_SLOTS,)
        )
        committed.id.write_direct_chunk((0,), np.zeros(_SLOTS, np.int64))
        _create_index(handle)

    def add(self, link: str | None) -> int:
        """A new slot for the site whose group is `/vars/<link>`, or (`None`) an alias."""
        slot = self.used
        self.used += 1
        self.counts = _grown(self.counts, self.used, _SLOTS)
        if link is not None:
            self.slots[link] = slot
        return slot

    def link(self, slot: int) -> str:
        """The link name of a defined slot."""
        start, end = self.rows[slot, NAME_START], self.rows[slot, NAME_END]
        return self.names[start:end].decode("utf-8")

    def count(self, slot: int) -> int:
        return int(self.counts[slot]) if slot < len(self.counts) else 0

    def set_count(self, slot: int, count: int) -> None:
        self.counts[slot] = count

    def define(self, slot: int, link: str, first_order: int, target: int = NO_TARGET) -> None:
        """Write slot `slot`'s row: it is not counted yet, so no reader trusts it."""
        data = link.encode("utf-8")
        start, self.end = self.end, self.end + len(data)
        if len(self.names) < self.end:
            self.names.extend(bytes(_rounded(self.end, _NAME_BYTES) - len(self.names)))
        self.names[start : self.end] = data
        self.dirty[SITE_NAMES].update(range(start // _NAME_BYTES, -(-self.end // _NAME_BYTES)))
        self.rows = _grown(self.rows, slot + 1, _INDEX_ROWS)
        self.rows[slot] = (start, self.end, first_order, target)
        self.dirty[SITE_INDEX].add(slot // _INDEX_ROWS)

    def write_rows(self) -> None:
        """Write the chunks of rows and names defined since the last call (before a flush)."""
        for name, data, step in (
            (SITE_INDEX, self.rows, _INDEX_ROWS),
            (SITE_NAMES, np.frombuffer(self.names, np.uint8), _NAME_BYTES),
        ):
            chunks = self.dirty[name]
            if not chunks:
                continue
            dataset = self.handle[name]
            if len(data) > self.held[name]:
                dataset.id.set_extent(data.shape)
                self.held[name] = len(data)
            for chunk in sorted(chunks):
                origin = (chunk * step, *(0 for _ in data.shape[1:]))
                dataset.id.write_direct_chunk(origin, data[chunk * step : (chunk + 1) * step])
            chunks.clear()

    def write_counts(self) -> None:
        """Rewrite `/committed` (after a flush); a grown one is flushed again."""
        committed = self.handle[COMMITTED]
        capacity = _rounded(self.used, _SLOTS)
        grown = capacity > self.held[COMMITTED]
        if grown:
            committed.id.set_extent((capacity,))
        counts = np.zeros(capacity, np.int64)
        used = min(len(self.counts), capacity)
        counts[:used] = self.counts[:used]
        for start in range(0, capacity, _SLOTS):  # whole unfiltered chunks: rewritten in place
            committed.id.write_direct_chunk((start,), counts[start : start + _SLOTS])
        if grown:  # a new chunk of counts was allocated: its place in the file must be written too
            self.handle.flush()
            self.held[COMMITTED] = capacity


_UNUSED: weakref.WeakSet[H5PYSaverCallback] = weakref.WeakSet()


# Set with WORLD_SIZE by launchers (torchrun, accelerate, Lightning's DDP) before
# torch.distributed starts.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


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


def unused_savers() -> list[H5PYSaverCallback]:
    """Savers created but neither started by a tracer, called nor closed yet.

    [`ModelTracer`][vartrace.ModelTracer] warns about those it is not given:
    they would write nothing.
    """
    return list(_UNUSED)


class H5PYSaverCallback:
    """Post-gather callback streaming every record into an HDF5 file.

    Example:
        ```python
        saver = H5PYSaverCallback("run.h5")
        with ModelTracer(model, paths, post_gather_callbacks=[saver], gathering_interval=8):
            train(model)
        saver.close()
        vartrace.open("run.h5")["forward.x"].get(iteration=3)
        ```

    Args:
        dataset_file: the file to write.  In a sharded run (`ModelTracer(gather=False)`
            on several ranks) each rank writes `<stem>.rank<r><suffix>` instead.
        overwrite: replace an existing file.
        append: continue an existing vartrace file (a resumed run): records are appended
            to its sites, new sites are added, its metadata is kept.  A missing file is
            created.  Without `overwrite` or `append` an existing file raises
            `FileExistsError` and is left untouched.
        float_dtype / int_dtype: store floating / integer tensors and arrays in this dtype
            (e.g. `"float16"`; `"bfloat16"` applies to tensors only); `None` keeps
            each record's dtype, bit-exact.  Python scalars are always kept exact.
        compression / compression_opts / shuffle: HDF5 filters for numeric `values`
            datasets: `"gzip"`, `"lzf"`, an `hdf5plugin` filter object, or the
            shortcuts of `COMPRESSIONS`: `"blosc"` (Blosc + LZ4 + byte shuffle:
            fast, the recommended one), `"blosc2"`, `"blosc2-zstd"` (smaller, slower);
            the shortcuts need `pip install hdf5plugin`.  gzip and lzf compress on one
            core inside the training step: far slower.
        metadata: store the run's metadata under `/meta` when the file is created;
            `False`: none; a dict of options, e.g. `{"git_diff": False}`: all of it but
            the uncommitted git diff (see `vartrace.storage.collect_metadata`).
        background: write on a thread of the saver's own.  Each call only takes the
            records over; `flush` (once per gather) hands the gather to the
            thread and returns, so the training step does not wait for the disk
            while the thread keeps up.  The records the thread has not written yet
            and those the tracer gathers add up to at most the largest gather (or
            64 MiB if more), each record let go once written: a step whose record
            would pass that waits until the thread has written enough of the
            previous gathers (`make_room`; with the tracer's `staging="sync"`, a
            model on the CPU), and so does a `flush` otherwise.  So host memory
            stays near one gather, as in the foreground, and a step waits only
            when the thread falls behind.  With `staging="async"` (a model on an
            accelerator) the staging thread waits in `make_room` instead, before it
            keeps each record; the step waits (or drops, `on_full="drop"`) only once
            records in flight reach `max_inflight_bytes` behind it.  A process killed
            meanwhile loses the gathers not yet written, besides what the tracer
            buffered; what was written stays readable.
            Worth it where writes block on a slow disk or network file system (h5py
            releases the GIL while HDF5 writes); where writing costs CPU and the cores
            are busy training, it gains nothing.  An error of the thread is raised by the next
            `flush` or by `close`, as `vartrace.storage.WorkerError`
            (the original exception is its `__cause__`).

    The file is opened lazily: by `on_start` (the tracer calls it when it starts)
    or by the first call.  In a gathered multi-rank run only rank 0 writes; the saver
    of the other ranks stays idle.  Records handed to the saver are removed from the
    chunk (`trace.clear()`), so they are not also kept in `tracer.results`.
    """

    def __init__(
        self,
        dataset_file: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        append: bool = False,
        float_dtype: Any = None,
        int_dtype: Any = None,
        compression: Any = None,
        compression_opts: Any = None,
        shuffle: bool = False,
        metadata: bool | Mapping[str, Any] = True,
        background: bool = False,
    ) -> None:
        if overwrite and append:
            raise ValueError("overwrite=True and append=True exclude each other")
        self.path = Path(dataset_file)
        self.overwrite = overwrite
        self.append = append
        self.metadata = metadata
        self._metadata = metadata_options(metadata)  # collect_metadata's options; None: none
        filters = _filters(compression, compression_opts, shuffle)
        self._options = {
            "float_dtype": dtype_name(float_dtype, "f"),
            "int_dtype": dtype_name(int_dtype, "i"),
            "filters": filters,
            "format": FORMAT_VERSION,  # the layout of the open file's sites (see _open)
        }
        #: The format version of a file this saver creates: tests set 1 to write a file of
        #: the first layout (private; an appended file keeps its own).
        self._format = FORMAT_VERSION
        self._made = _Made(filters)  # the file's groups, datasets and attributes
        self._file: h5py.File | None = None
        self._sites: dict[str, _Site] = {}
        self._index: _Index | None = None  # the open file's root index
        self._unresolved: dict[str, str] = {}  # alias -> target: a target with no site yet
        self._undescribed: dict[str, ReducedFrom] = {}  # `reduced` of a site not yet made
        self._dirty = False
        self._unreleased = 0  # bytes of records written since memory was last given back
        self._context = RunContext()
        self._idle = False
        self._closed = False
        self._created = False  # this saver created the file (and removes it if it stays empty)
        self._shift: tuple[int, int] | None = None  # added to (iterations, order) when appending
        self._last: tuple[int, int] | None = None  # the file's largest (iteration, order) at open
        self._newest: tuple[int, int] | None = None  # ... and of the records written since
        self.background = background
        # Records (aliases: their target's name; `reduced`) taken over, not yet handed to
        # the thread.
        self._pending: list[tuple[str, Trace | str | ReducedFrom]] = []
        self._worker: Worker | None = None
        # Bytes of the records handed to the thread and not yet written; the thread notifies
        # as they go, and sets `_stopped` when a job raised (later jobs are skipped).
        self._handed = 0
        self._largest = 0  # bytes of the largest gather handed to the thread
        self._written = threading.Condition(threading.Lock())
        self._stopped = False
        self._failure: OSError | None = None  # the write failure that ended the file
        # Callers (tracers in several threads) take records and flush one at a time; the
        # writer thread never takes it, so a caller waiting for the thread cannot block it.
        self._lock = threading.RLock()
        self._owner: int | None = None  # the process that opened the file
        self._descriptor = -1  # the file's descriptor in this process, once open
        self._parent_file: h5py.File | None = None  # in a forked child: the parent's, never used
        _UNUSED.add(self)

    # -- lifecycle ------------------------------------------------------------------------

    def on_start(self, context: RunContext) -> None:
        """Open the file for this rank (called by the tracer before the first record)."""
        self._check_process()
        _UNUSED.discard(self)
        if self._file is not None or self._closed:
            return
        self._context = context
        if context.sharded:
            self.path = shard_path(self.path, context.rank)
        elif context.rank != 0 or (context.world_size == 1 and _launched_as_other_rank()):
            self._idle = True  # rank 0 writes the gathered records
            return
        self._open()

    def _check_process(self) -> None:
        if self._owner is not None and self._owner != os.getpid():
            raise RuntimeError(
                f"H5PYSaverCallback for {self.path} belongs to process {self._owner}; this "
                "process is a fork of it and never writes that file: give a tracer started "
                "here a saver of its own"
            )

    def _forget(self) -> None:
        """In a forked child: let go of the parent's file without writing it, even at exit.

        HDF5 keeps the file open in the child too and would write it when it closes
        it (when the child exits): its descriptor is pointed at a scratch file instead.
        """
        self._lock = threading.RLock()  # a thread of the parent may have held it at the fork
        if self._file is not None and self._descriptor >= 0:
            with tempfile.TemporaryFile() as scratch:
                os.dup2(scratch.fileno(), self._descriptor)
        self._parent_file, self._file = self._file, None  # kept: closing would write
        self._sites = {}
        self._pending = []
        self._worker = None
        self._handed = 0  # the thread writing them stayed in the parent
        self._written = threading.Condition(threading.Lock())
        self._closed = True

    def _open(self) -> h5py.File:
        self._check_process()
        if self._failure is not None:
            raise RuntimeError(
                f"H5PYSaverCallback for {self.path} stopped writing after a failed write: "
                f"{self._failure.strerror}"
            ) from self._failure
        if self._closed:
            raise RuntimeError(f"H5PYSaverCallback for {self.path} is closed")
        if self._idle:
            rank = f"rank {self._context.rank}"
            if self._context.world_size == 1:
                rank = (
                    "a process that its launcher started as a rank other than 0 (RANK / "
                    "LOCAL_RANK / NODE_RANK, WORLD_SIZE), with no torch.distributed group to "
                    "gather to"
                )
            raise RuntimeError(
                f"H5PYSaverCallback for {self.path} received records on {rank} of a gathered "
                "run, where only rank 0 writes"
            )
        if self._file is not None:
            return self._file
        path = self.path
        if path.exists() and self.overwrite:
            # replacing a live run's file would lose that run
            _refuse_live_writer(path, by_saver=True)
            path.unlink()
        if path.exists() and not self.append:
            raise FileExistsError(
                errno.EEXIST,
                "the file exists; pass overwrite=True to replace it or append=True to "
                "continue it (it was left untouched)",
                str(path),
            )
        if path.exists():
            _check_appendable(path)
            handle = h5py.File(path, "r+", **_FILE_OPTIONS)
            self._last = self._newest = _last_tags(handle)
        else:
            handle = self._create(path)
            self._created = True
        self._options["format"] = int(handle.attrs[FORMAT_ATTR])  # a file never mixes layouts
        handle.attrs.update(writer_host=socket.gethostname(), writer_pid=os.getpid())
        self._index = _Index(handle)
        _size_metadata_cache(handle)
        handle.swmr_mode = True  # from here on, a killed process leaves a consistent file
        self._descriptor = handle.id.get_vfd_handle()
        self._owner = os.getpid()
        self._file = handle
        _forks.watch(self)
        return handle

    def _create(self, path: Path) -> h5py.File:
        meta = None
        if self._metadata is not None:  # collected first: outside SWMR mode only briefly
            meta = collect_metadata(self._context.world_size, **self._metadata)
        handle = h5py.File(path, "x", **_FILE_OPTIONS)
        handle.attrs[FORMAT_ATTR] = self._format
        handle.attrs["vartrace_version"] = _vartrace_version()
        context = self._context
        handle.attrs.update(run_attrs(path, context.rank, context.world_size, context.sharded))
        handle.create_group("vars")
        _Index.create(handle)
        if meta is not None:
            _write_tree(handle.create_group("meta"), meta)
        return handle

    def flush(self, *, wait: bool = False) -> None:
        """Make every record taken so far durable in the file (the tracer calls it per gather).

        HDF5 writes out the records first; then the per-site record counts that
        readers trust are rewritten in place.  A process killed at any moment
        leaves every record of the last completed flush readable, and nothing
        half-written visible.  With `background=True` the records are handed
        to the writer thread, which writes and commits them; `wait=True` then
        also waits until it has.
        """
        with self._lock:
            if not self.background:
                with _interrupts_held(), self._guard():
                    self._commit()
                self._release()
                return
            if self._pending:
                batch, self._pending = self._pending, []
                self._submit(batch)
        if wait and self._worker is not None:
            self._worker.join()

    def make_room(self, nbytes: int) -> None:
        """With `background=True`, wait until `nbytes` of records fit beside those the
        writer thread has not written yet (the tracer calls it before it copies a record,
        with the bytes of its chunk and of the record).

        They fit when they add up to at most the largest gather handed to the thread
        (or `_BACKGROUND_BYTES` if more), or when the thread holds none: a tracer
        whose records are as large as a gather waits until the thread has written as
        many of the previous gather's.  It returns at once in the foreground, when
        the thread holds nothing or once a job of the thread failed (the next `flush`
        raises its error).
        """
        if not self.background or not self._handed:
            return
        with self._written:
            self._wait_for_room(nbytes)

    def _wait_for_room(self, nbytes: int) -> None:
        """Wait until the thread holds no records, or `nbytes` more fit beside its
        records (see `make_room`), or a job failed; called holding `_written`."""
        bound = max(self._largest, _BACKGROUND_BYTES)
        while self._handed and self._handed + nbytes > bound and not self._stopped:
            self._written.wait()

    def _submit(self, batch: list[tuple[str, Trace | str | ReducedFrom]]) -> None:
        """Hand `batch` to the writer thread, once it fits beside the records the thread
        has not written yet (see `make_room`).

        The thread lets go of each site's records (of large records, each record) as
        soon as they are written, and counts them out then.  A tracer that made room
        for its records finds room here; a caller that did not waits here instead.
        """
        if self._worker is None:
            self._worker = Worker(f"vartrace-writer {self.path.name}")
            atexit.register(self.close)
        jobs = collections.deque(batch)
        batch.clear()
        sizes = collections.deque(
            held_bytes(item.values) if isinstance(item, Trace) else 0 for _, item in jobs
        )
        nbytes = sum(sizes)
        with self._written:
            self._largest = max(self._largest, nbytes)
            self._wait_for_room(nbytes)  # a job raised: the worker's submit raises its error
            self._handed += nbytes

        def write() -> None:
            try:
                with self._guard():
                    if self._failure is not None:
                        return  # an earlier gather's write failed: the saver stopped writing
                    while jobs:
                        name, item = jobs.popleft()
                        held = 0  # bytes of the piece written last, freed by taking the next
                        for piece in _one_by_one(item) if isinstance(item, Trace) else (item,):
                            sizes[0] -= held
                            self._written_out(held)  # room for the tracer's next record
                            held = held_bytes(piece.values) if isinstance(piece, Trace) else 0
                            self._apply(name, piece)
                            del piece  # the record goes now, not when the job ends
                        del item
                        self._written_out(sizes.popleft())
                    self._commit()
            except BaseException:
                with self._written:
                    self._stopped = True
                    self._written.notify_all()
                raise
            finally:
                self._written_out(sum(sizes))
                jobs.clear()
            self._release()

        self._worker.submit(write)

    def _written_out(self, nbytes: int) -> None:
        """The writer thread let go of `nbytes` of the records handed to it."""
        if nbytes:
            with self._written:
                self._handed -= nbytes
                self._written.notify_all()

    def _release(self) -> None:
        """Give the memory of the records written since the last time back to the system,
        once they add up to `TRIM_ABOVE` (see `vartrace._support.memory`)."""
        if _memory.release(self._unreleased):
            self._unreleased = 0

    def _commit(self) -> None:
        if self._file is None or self._index is None:
            return
        for name, target in list(self._unresolved.items()):
            self._alias(name, target)
        if not self._dirty:
            return
        self._index.write_rows()
        if self._newest is not None:  # with the sum of the counts it goes with (see _last_tags)
            last = np.array([*self._newest, int(self._index.counts.sum())], np.int64)
            self._file.attrs.modify(LAST_TAGS, last)
        self._file.flush()
        self._index.write_counts()
        self._dirty = False

    def close(self) -> None:
        """Flush and close the file; later records raise.  Safe to call twice.

        With `background=True` it first waits for the writer thread, and raises
        its error, if it had one, after closing the file.  The file is closed
        whatever happens.  A write that fails (a full disk) raises nothing: it
        was warned about once and is kept in `failure`.  Then the warnings
        that a `-W error` filter turned into errors during the run are emitted
        again (see `vartrace._support.warnings`).
        """
        with self._lock, _interrupts_held():
            self._close()
        release()

    def _close(self) -> None:
        _UNUSED.discard(self)
        try:
            if self.background:
                self.flush()  # hands over what was taken since the last flush
            if self._worker is not None:
                worker, self._worker = self._worker, None
                atexit.unregister(self.close)
                worker.stop()
        finally:
            self._closed = True
            try:
                if self._file is not None:
                    with self._guard():
                        self._commit()
                        self._sites.clear()  # their datasets are closed, their metadata clean
                        _shrink_metadata_cache(self._file)
                if self._file is not None:  # a failed commit closed it already
                    self._file.close()
                    self._file = None
                    _forks.unwatch(self)
                    if self._created and (self._index is None or not self._index.counts.any()):
                        self.path.unlink(missing_ok=True)
                        warn(
                            f"vartrace: H5PYSaverCallback received no record, so it removed the "
                            f"empty {self.path} it had created (a model that never ran in the "
                            "traced mode, a saver missing from post_gather_callbacks, or a failed "
                            "first write)",
                            stacklevel=3,
                        )
                if self._unresolved:
                    warn(
                        f"vartrace: H5PYSaverCallback wrote no alias for "
                        f"{', '.join(map(repr, self._unresolved))} in {self.path}: their target "
                        f"site(s) {', '.join(map(repr, dict.fromkeys(self._unresolved.values())))} "
                        "received no record",
                        stacklevel=3,
                    )
            finally:
                self._sites.clear()
                self._unresolved.clear()
                self._undescribed.clear()  # sites that received no record: nothing to describe

    @property
    def failure(self) -> OSError | None:
        """The write failure (a full disk, a file-size limit) that stopped this saver, or `None`.

        After it the saver writes nothing more: later records are dropped, and
        the file holds every record flushed before.  Example:

        ```python
        if saver.failure is not None:
            print("the run file is incomplete:", saver.failure.strerror)
        ```
        """
        return self._failure

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn a failed write into a closed file, `failure` and one warning.

        After a failed write HDF5 can neither flush the file nor close its
        datasets; closing them anyway, or leaving it to the process's exit,
        crashes the process (SIGSEGV).  So the file's descriptor is first pointed
        at the null device, where the close writes what it still must, and the
        file on disk keeps what was written before.
        """
        try:
            yield
        except Exception as error:
            handle, cause = self._file, _os_error(error)
            if handle is None or cause is None:
                raise
            # Set first: from here on no thread reopens the file.
            self._failure = OSError(
                cause[0],
                f"writing the run file failed ({cause[1]}); it is closed and holds the "
                "records of every flush before this one",
                str(self.path),
            )
            self._failure.__cause__ = error
            self._file = None
            size = _claimed_size(handle)
            _discard_writes(handle)
            self._sites.clear()
            with contextlib.suppress(Exception):
                handle.close()
            _pad_to(self.path, size)
            warn(
                f"vartrace: H5PYSaverCallback stopped writing {self.path}: {cause[1]} "
                f"(errno {cause[0]}); the file holds the records of every flush before, later "
                "records are dropped, training goes on (saver.failure holds the error)",
                RuntimeWarning,
                stacklevel=4,
            )

    def __enter__(self) -> H5PYSaverCallback:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:  # the exception of the with-block goes on, not this one
            report_during(exc, f"H5PYSaverCallback.close() failed for {self.path}", error)
        release(during=exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._file is not None else "not opened"
        if self._failure is not None:
            state = "stopped after a failed write"
        return f"<H5PYSaverCallback {str(self.path)!r} {state} sites={len(self._sites)}>"

    # -- writing --------------------------------------------------------------------------

    def __call__(self, name: str, trace: Trace) -> None:
        """Append the chunk's records of site `name` to the file and empty the chunk."""
        _UNUSED.discard(self)
        # Ctrl-C is held until the records are written and taken from the chunk: neither
        # half written nor written twice (the tracer keeps what a callback did not take).
        with self._lock, _interrupts_held():
            if self._failure is not None:  # the saver stopped writing: drop, never grow
                trace.clear()
                return
            self._open()
            if not len(trace):
                return
            if self.background:
                taken = Trace(
                    trace.values, trace.iterations, trace.ranks, trace.order, trace.shapes
                )
                self._pending.append((name, taken))
            else:
                with self._guard():
                    self._append(name, trace)
            trace.clear()

    def alias(self, name: str, target: str) -> None:
        """Make site `name` read as site `target` (the same records, stored once).

        `target` is a site with records in this file, or one that receives them
        before the next flush; `name` has no records of its own.  `vartrace.open`
        lists `name` (`run.aliases` maps it to `target`) and `run[name]` reads
        `target`'s records.  Records that later arrive for `name` itself make it an
        ordinary site from then on (the earlier ones stay readable under `target`).
        Like a call, it is ordered with the records (`background=True` included);
        it takes effect at the next flush.  Example:

        ```python
        saver.alias("layers.0.attn.forward.attn_weights",
                    "layers.0.attn.forward>eager_attention_forward.attn_weights")
        ```
        """
        self._take(name, target)

    def _take(self, name: str, fact: str | ReducedFrom) -> None:
        """Write a fact about site `name` (an alias's target, `reduced`), or with
        `background=True` queue it, ordered with the records."""
        _UNUSED.discard(self)
        with self._lock, _interrupts_held():
            if self._failure is not None:  # the saver stopped writing
                return
            self._open()
            if self.background:
                self._pending.append((name, fact))
            else:
                with self._guard():
                    self._apply(name, fact)

    def _apply(self, name: str, item: Trace | str | ReducedFrom) -> None:
        """Write one taken item of site `name`: records, an alias's target, `reduced`."""
        if isinstance(item, str):
            self._alias(name, item)
        elif isinstance(item, ReducedFrom):
            self._reduced(name, item)
        else:
            self._append(name, item)

    def _alias(self, name: str, target: str) -> None:
        index = self._index
        assert index is not None
        target = index.aliases.get(target, (0, target))[1]  # an alias's alias reads its target
        self._unresolved.pop(name, None)
        held = index.slots.get(escape(name))
        if held is not None and index.count(held):
            warn(
                f"vartrace: {self.path}: site {name!r} holds records of its own, so it is not "
                f"made an alias of {target!r}",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        target_slot = index.slots.get(escape(target))
        if name == target:
            return
        if target_slot is None or not index.count(target_slot):
            self._unresolved[name] = target  # its records come later in this gather
            return
        old = index.aliases.get(name)
        if old is not None and old[1] == target:
            return
        slot = index.add(None)
        index.define(slot, escape(name), int(index.rows[target_slot, FIRST_ORDER]), target_slot)
        index.set_count(slot, 1)
        if old is not None:  # retargeted: the old row gives way in the same commit
            index.set_count(old[0], 0)
        index.aliases[name] = (slot, target)
        self._dirty = True

    def reduced(self, name: str, origin: ReducedFrom) -> None:
        """Note what a pre-save callback made site `name`'s records from: the dtype and
        shape of its values (the tracer calls it for statistics mode's rows).

        Stored as the site's attributes `reduced_dtype` and `reduced_shape` (-1 on the
        axes whose size differed; absent when the number of axes differed), read back
        as `run[name].reduced_from`.  A description only widens: one noted in an
        earlier session of an appended file is merged with this one.  Like a call, it
        is ordered with the records.  Example:

        ```python
        saver.reduced("blocks.0.forward", ReducedFrom("bfloat16", (8, -1, 768)))
        ```
        """
        self._take(name, origin)

    def _reduced(self, name: str, origin: ReducedFrom) -> None:
        index = self._index
        assert index is not None
        site = self._sites.get(name)
        slot = index.slots.get(escape(name))
        if site is None and (slot is None or not index.count(slot)):
            self._undescribed[name] = origin  # described when its records come
            return
        group = site.group if site is not None else self._open()["vars"][escape(name)]
        _describe(group, origin)
        self._dirty = True

    def _append(self, name: str, trace: Trace) -> None:
        self._open()
        index = self._index
        assert index is not None
        self._unresolved.pop(name, None)
        replaced = index.aliases.pop(name, None)
        if replaced is not None:  # records of its own: an ordinary site from now on
            index.set_count(replaced[0], 0)
        site = self._sites.pop(name, None)
        if site is None:
            link = escape(name)
            slot = index.slots.get(link)
            if slot is None:
                slot = index.add(link)
                site = _Site.create(index.vars, name, self._options, self._made, slot, len(trace))
            else:
                site = _Site(index.vars[link], self._options, self._made, index.count(slot))
        self._sites[name] = site  # most recently used last
        if len(self._sites) > _OPEN_SITES:
            del self._sites[next(iter(self._sites))]
        trace = self._continued(trace)
        newest = (int(_int64(trace.iterations).max()), int(_int64(trace.order).max()))
        if self._newest is not None:
            newest = (max(newest[0], self._newest[0]), max(newest[1], self._newest[1]))
        self._newest = newest
        if not site.rows:  # its first records (or a killed writer's never committed)
            index.define(site.slot, escape(name), int(_int64(trace.order)[0]))
        for piece in _one_by_one(trace):
            self._unreleased += site.append(piece)
            del piece  # written: freed before the next record is taken
        index.set_count(site.slot, site.rows)
        origin = self._undescribed.pop(name, None)
        if origin is not None:
            _describe(site.group, origin)
        self._dirty = True

    def _continued(self, trace: Trace) -> Trace:
        """`trace` with tags that continue the file's (appending): never a duplicate iteration.

        The first records appended decide: when they are tagged at or before the
        file's last iteration (a restarted tracer counts from 1 again), every
        iteration of this session is moved past it, with a warning naming
        `set_iteration`; capture order numbers likewise continue the file's.
        """
        if self._shift is None and self._last is None:
            self._shift = (0, 0)
        if self._shift is None:
            assert self._last is not None
            last_iteration, last_order = self._last
            first = int(_int64(trace.iterations).min())
            moved = last_iteration - first + 1 if first <= last_iteration else 0
            if moved:
                warn(
                    f"vartrace: {self.path} already holds iterations up to {last_iteration} and "
                    f"the appended records start at iteration {first}: they are stored as "
                    f"iterations {first + moved}, ... To number them yourself, call "
                    "tracer.set_iteration(step) each step",
                    stacklevel=2,
                )
            first_order = int(_int64(trace.order).min())
            orders = last_order - first_order + 1 if first_order <= last_order else 0
            self._shift = (moved, orders)
        moved, orders = self._shift
        if not moved and not orders:
            return trace
        return Trace(
            trace.values,
            _int64(trace.iterations) + moved,
            trace.ranks,
            _int64(trace.order) + orders,
            trace.shapes,
        )

    @property
    def datasets(self) -> Mapping[str, h5py.Dataset]:
        """Site name -> its `values` dataset (opened when looked up), while the file is open.

        With `background=True`, it first waits for the records handed to the thread.
        """
        if self._worker is not None:
            self._worker.join()
        return _Datasets(self._file)


def _one_by_one(trace: Trace) -> Iterator[Trace]:
    """`trace` as it is, or, when it holds a list of records of `vartrace._support.memory.MAP_FROM`
    bytes or more, its records one at a time, each taken out of `trace.values` as it is
    handed on: a record written is freed (its pages unmapped) while the next is written."""
    values = trace.values
    if (
        not isinstance(values, list)
        or len(values) < 2
        or trace.shapes is not None
        or held_bytes(values[:1]) < _memory.MAP_FROM
    ):
        yield trace
        return
    iterations, ranks, order = (_int64(tag) for tag in (trace.iterations, trace.ranks, trace.order))
    for row in range(len(values)):
        rows = slice(row, row + 1)
        piece = Trace([values[row]], iterations[rows], ranks[rows], order[rows])
        values[row] = None
        yield piece
        del piece


class _Datasets(Mapping[str, h5py.Dataset]):
    """The `values` datasets of an open file's sites, opened one at a time when looked up."""

    def __init__(self, handle: h5py.File | None) -> None:
        self._vars = None if handle is None else handle["vars"]

    def __getitem__(self, name: str) -> h5py.Dataset:
        group = None if self._vars is None else self._vars.get(escape(name))
        if group is None or "values" not in group:
            raise KeyError(name)
        return group["values"]

    def __iter__(self) -> Iterator[str]:
        group = self._vars
        if group is None:
            return iter(())
        return (unescape(link) for link in list(group) if "values" in group[link])

    def __len__(self) -> int:
        return sum(1 for _ in self)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back while the file is written, then raise it at the end.

    A `KeyboardInterrupt` raised inside a write lands wherever Python code runs
    next, often in a weakref callback of h5py's objects, where Python ignores it
    ("Exception ignored in ... KeyboardInterrupt"): training would go on, and a
    write cut short could leave the file's records half written.  So the signal
    is noted and the previous handler called once the write is complete.  Only on
    the main thread (where signal handlers run) and where a Python handler is set.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])


_HDF5_OS_ERROR = re.compile(r"errno = (\d+), error message = '([^']*)'")


def _os_error(error: Exception) -> tuple[int, str] | None:
    """`(errno, message)` of the operating-system failure behind an HDF5 write error."""
    found = _HDF5_OS_ERROR.search(str(error))
    if found is not None:
        return int(found.group(1)), found.group(2)
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return error.errno, os.strerror(error.errno)
    return None


def _size_metadata_cache(handle: h5py.File) -> None:
    """Give `handle` the metadata cache of `_METADATA_CACHE` (holds many open sites)."""
    config = handle.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size, config.min_size, config.max_size = _METADATA_CACHE
    handle.id.set_mdc_config(config)


def _shrink_metadata_cache(handle: h5py.File) -> None:
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


def _describe(group: h5py.Group, origin: ReducedFrom) -> None:
    """Give a site's `group` the attributes of `origin`, merged with those it holds."""
    held = reduced_from(group.attrs)
    if held is not None:
        origin = held.merged(origin)
        if origin == held:
            return
    group.attrs.modify(REDUCED_DTYPE, origin.dtype)
    if origin.shape is None:
        if REDUCED_SHAPE in group.attrs:
            del group.attrs[REDUCED_SHAPE]
    else:
        group.attrs.modify(REDUCED_SHAPE, np.asarray(origin.shape, np.int64))


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


def _last_tags(handle: h5py.File) -> tuple[int, int] | None:
    """The largest committed iteration and capture order of an open file; `None` if empty.

    Read from the root's `last_tags` where its sum of record counts is `/committed`'s
    (written before the counts, it is ahead of them after a killed flush; a writer
    without it may have appended since), else from every site's tags.
    """
    committed = handle[COMMITTED][()]
    held = np.asarray(handle.attrs.get(LAST_TAGS, ()))
    if held.shape == (3,) and held.dtype.kind == "i" and int(held[2]) == int(committed.sum()):
        return (int(held[0]), int(held[1])) if held[2] else None
    found: list[tuple[int, int]] = []
    for group in handle["vars"].values():
        slot = int(group.attrs["slot"])
        rows = int(committed[slot]) if slot < len(committed) else 0
        if not rows:
            continue
        if TAGGED in group:
            tags = group[TAGGED][:rows]
            iterations, order = tags[:, TAGS.index("iterations")], tags[:, TAGS.index("order")]
        else:
            iterations, order = group["iterations"][:rows], group["order"][:rows]
        found.append((int(np.max(iterations)), int(np.max(order))))
    if not found:
        return None
    return max(i for i, _ in found), max(o for _, o in found)


def _vartrace_version() -> str:
    from vartrace import __version__

    return __version__


def _check_appendable(path: Path) -> None:
    """Raise unless `path` is a vartrace file this version can continue; recover a crash."""
    from vartrace.storage.reader import open_file

    open_file(path).close()
    _refuse_live_writer(path, by_saver=True)
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
