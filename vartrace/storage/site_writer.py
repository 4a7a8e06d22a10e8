"""The writer of one site: its datasets, their chunk geometry, and how a gather is appended.

Example:
    ```python
    site = SiteWriter.create(handle["vars"], "forward.x", options, made, slot, len(trace))
    site.append(trace)  # tags, values (stacked or record by record), shapes, other
    ```

A site's chunks are shaped by its first gather (`vartrace.storage.chunks`): a
gather of as many records fills whole chunks, so a compressed chunk is written
once.  Records that fit `values` (same key, no far larger allocation: `_SPREAD`)
go there, padded to its row shape; the others are pickled into `other`.  The
datasets' axes are labelled for h5netcdf / xarray (`_label`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import h5py
import numpy as np

from vartrace._support.warnings import warn
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.storage.chunks import gather_rows, values_chunks
from vartrace.storage.codec import IN_OTHER, Kind, Leaf, encode, row_shapes, to_blob, unstored
from vartrace.storage.filters import STR, UNFILTERED, Made
from vartrace.storage.layout import (
    PLACEMENTS,
    REDUCED_DTYPE,
    REDUCED_SHAPE,
    TAGGED,
    TAGS,
    escape,
    placement_attrs,
    reduced_from,
    unescape,
)
from vartrace.trace import Trace

__all__ = ["CACHE_BYTES", "SiteWriter", "describe", "int64"]

# A record whose shape would make ``values`` allocate more than this many times its own
# bytes (plus one chunk and _SPREAD_SLACK) goes to ``other`` unpadded: chunks are shaped by
# the site's first record, and a (1, 4096) record in chunks shaped (4096, 1) fills 4096 of them.
_SPREAD = 4
_SPREAD_SLACK = 64 << 10
_STACK_BELOW = 1 << 20  # smaller equally shaped records are written together, up to this many bytes
_WRITTEN = frozenset((*TAGS, TAGGED, "values", "shapes", "other"))  # datasets a gather writes
_BLOB = h5py.vlen_dtype(np.uint8)
# Chunk cache of each open dataset (the file's `rdcc_nbytes`): small chunks (tags, small
# records) are written from it at the flush; bigger chunks go straight to the file (a
# compressed one whole, a partly filled one unfiltered, see SiteWriter._put_records).  A
# cache keeps up to its size of every open dataset's chunks in memory (1 MiB: up to 10 GiB
# for 1,000 sites).
CACHE_BYTES = 64 << 10


_DIMENSION = b"This is a netCDF dimension but not a netCDF variable."
#: A version-2 site's dimension-only scale of the record axis.
_RECORDS = "records"


def _label(
    made: Made,
    group: h5py.Group,
    records: h5py.h5d.DatasetID,
    dataset: h5py.h5d.DatasetID,
    stem: str,
    row: tuple[int, ...],
) -> list[h5py.h5d.DatasetID]:
    """Label `dataset` (`group`'s `stem`, rows of shape `row`) for h5netcdf / xarray: the
    record axis by the site's scale `records` (`iterations`, a coordinate, in a version-1
    file), the others by dimension-only scales `<stem>_dim<k>` (resized with it), which it
    returns."""
    h5py.h5ds.attach_scale(dataset, records, 0)
    scales = []
    for axis, size in enumerate(row, 1):
        scale = made.dataset(group, f"{stem}_dim{axis}", (size,), np.dtype(np.uint8))
        h5py.h5ds.set_scale(scale, _DIMENSION)
        h5py.h5ds.attach_scale(dataset, scale, axis)
        scales.append(scale)
    return scales


def _tag_row(name: str) -> tuple[int, ...]:
    """The shape of a row of the tag dataset `name`: a version-2 file's `tags` holds a
    column a tag, a version-1 file's one dataset a tag."""
    return (len(TAGS),) if name == TAGGED else ()


def _site_datasets(group: h5py.Group) -> dict[str, h5py.h5d.DatasetID]:
    """The datasets a site's writer keeps open: tags, `values`, `shapes`, `other` and
    the labels of `values`' axes (the other labels never change)."""
    return {
        name: group[name].id for name in group if name in _WRITTEN or name.startswith("values_dim")
    }


@functools.lru_cache(maxsize=256)
def _memory_space(shape: tuple[int, ...]) -> h5py.h5s.SpaceID:
    """The dataspace of an array of `shape` in memory, made once (h5py makes one a write)."""
    return h5py.h5s.create_simple(shape)


@functools.lru_cache(maxsize=64)
def _memory_type(dtype: np.dtype[Any]) -> h5py.h5t.TypeID:
    """The HDF5 type of a numeric `dtype` in memory, made once (h5py makes one a write)."""
    return h5py.h5t.py_create(dtype)


def _put(dataset: h5py.h5d.DatasetID, offset: tuple[int, ...], data: np.ndarray) -> None:
    """Write `data` into `dataset` at `offset` (h5py's low-level calls: fast)."""
    data = np.ascontiguousarray(data)
    space = dataset.get_space()
    space.select_hyperslab(offset, data.shape)
    # numeric types are made once; variable-length ones as h5py's write makes them
    mtype = _memory_type(data.dtype) if data.dtype.kind in "biuf" else None
    dataset.write(_memory_space(data.shape), space, data, mtype=mtype)


class _Rows:
    """A dataset of a site that grows along its first axis (a tag, `shapes`, a label of
    `values`' axes) with its file dataspace, kept at the dataset's extent: appending rows
    makes no HDF5 object but the selection, where `_put` gets the dataspace from HDF5 at
    each write (a third of a small write's time).

    Example: `rows.extend(stop); rows.put(start, data)` writes rows `start:stop`.
    """

    def __init__(self, dataset: h5py.h5d.DatasetID, shape: tuple[int, ...] | None = None) -> None:
        """The rows of `dataset`, whose `shape` the caller knows (a dataset it just made) or
        HDF5 is asked for."""
        self.id = dataset
        self.space = dataset.get_space()
        shape = self.space.shape if shape is None else shape
        self.size = shape[0]  # rows within the extent
        self.tail = shape[1:]  # the shape of a row

    def extend(self, rows: int) -> None:
        """Give the dataset `rows` rows."""
        shape = (rows, *self.tail)
        self.id.set_extent(shape)
        self.space.set_extent_simple(shape, (h5py.h5s.UNLIMITED, *self.tail))
        self.size = rows

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


def int64(tags: Any) -> np.ndarray:
    return np.asarray(tags, dtype=np.int64).reshape(-1)


class SiteWriter:
    """The datasets of one site and the appending logic."""

    def __init__(
        self,
        group: h5py.Group,
        options: dict[str, Any],
        made: Made,
        rows: int,
        created: tuple[int, int, Mapping[str, h5py.h5d.DatasetID]] | None = None,
    ) -> None:
        """The site of `group` holding `rows` committed records, its datasets made by
        `made`; `created` (slot, rows of a tag chunk, name -> dataset) for a site just
        created, else they are looked up."""
        self.group = group
        self.options = options
        self.made = made
        found: Mapping[str, h5py.h5d.DatasetID]
        if created is None:
            found = _site_datasets(group)
            self.slot = int(group.attrs["slot"])
        else:
            self.slot, self.gather_rows, found = created
        # a version-2 file's one `tags` dataset, else one dataset a tag (see _layout)
        self.tags = [
            _Rows(found[name], None if created is None else (0, *_tag_row(name)))
            for name in ((TAGGED,) if TAGGED in found else TAGS)
        ]
        if created is None:
            self.gather_rows = self.tags[0].id.get_create_plist().get_chunk()[0]
        # `values` as HDF5's identifier; its h5py wrapper (three property lists of its own)
        # is made only where asked for (`values`)
        self.values_id: h5py.h5d.DatasetID | None = found.get("values")
        self._values: h5py.Dataset | None = None
        self.shapes = None if "shapes" not in found else _Rows(found["shapes"])
        self.other = None if "other" not in found else h5py.Dataset(found["other"])
        self.rows = rows  # committed records; rows past them (a killed writer's) are rewritten
        self.chunk = None if self.values is None else self.values.chunks
        self.itemsize = 0 if self.values is None else self.values.dtype.itemsize
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

    @property
    def values(self) -> h5py.Dataset | None:
        """The site's `values` dataset (h5py's wrapper, made once), `None` before its first
        stored record."""
        if self._values is None and self.values_id is not None:
            self._values = h5py.Dataset(self.values_id)
        return self._values

    @classmethod
    def create(
        cls,
        parent: h5py.Group,
        name: str,
        options: dict[str, Any],
        made: Made,
        slot: int,
        records: int,
    ) -> SiteWriter:
        """A new site whose first gather holds `records` records (its chunks' size), laid
        out as `options["format"]` says."""
        group = made.group(parent, escape(name))
        made.attribute(group.id, "slot", slot)
        if _utf8(name):  # for people browsing the file; the reader unescapes the link name
            made.attribute(group.id, "name", name)
        rows = gather_rows(records)
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
                _label(made, group, scale, dataset, tag, _tag_row(tag))
        site = cls(group, options, made, 0, (slot, rows, tags))
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
            assert self.values_id is not None and self.chunk is not None
            rows, *tile = self.chunk
            tiles = math.prod(-(-size // step) for size, step in zip(shape, tile, strict=True))
            itemsize = self.itemsize
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
            self.itemsize = leaf.data.dtype.itemsize
            self.chunk = values_chunks(shape, self.itemsize, records)
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
                labels = _label(made, group, scale, values, "values", shape)
                self.scales = [_Rows(dim, (size,)) for dim, size in zip(labels, shape, strict=True)]
            if ndim and len(self.tags) > 1:  # version 1: always; 2: once a record needs it
                self._create_shapes(ndim)
        else:
            self.storage = "str" if leaf.kind == Kind.STR and _utf8(leaf.data) else "blob"
            dtype = STR if self.storage == "str" else _BLOB
            values = made.dataset(group, "values", (rows,), dtype, chunks=(self.gather_rows,))
            made.attribute(values, "storage", self.storage)
            if scale is not None:
                _label(made, group, scale, values, "values", ())
        self.values_id = values

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
            _label(self.made, self.group, self.records, shapes, "shapes", (ndim,))
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
        columns = [int64(tag) for tag in (trace.iterations, trace.ranks, trace.order)]
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
        if self.values_id is None:
            self._create_values(record, len(leaf.data))
        return leaf if self._fits(record) else None

    def _extend(self, stop: int, shapes: Sequence[tuple[int, ...]] = ()) -> None:
        """Give every per-record dataset `stop` rows, growing `values` to fit `shapes`."""
        assert self.values_id is not None
        self._shapes_needed(shapes)
        if shapes:
            self.padded = tuple(max(sizes) for sizes in zip(self.padded, *shapes, strict=True))
        self.values_id.set_extent((stop, *self.padded))
        for scale, size in zip(self.scales, self.padded, strict=False):
            if scale.size < size:
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
        assert self.values_id is not None and self.chunk is not None
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
                    or data.itemsize * math.prod(self.chunk) > CACHE_BYTES
                )
            )
            if whole:
                self._put_chunks(row, data)
            else:
                _put(self.values_id, (row,) + (0,) * (data.ndim - 1), data)
            return
        rows = self.chunk[0]
        first = row
        while first < row + len(data):
            begin = first - first % rows
            end = min(begin + rows, row + len(data))
            part = data[first - row : end - row]
            if first == begin and end == begin + rows:
                _put(self.values_id, (first,) + (0,) * (data.ndim - 1), part)
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
        assert self.values_id is not None and self.chunk is not None
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
                self.values_id.write_direct_chunk(origin, np.ascontiguousarray(part))
            else:
                _put(self.values_id, origin, part)

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
            self.values.id.write_direct_chunk((begin, *corner), buffer, filter_mask=UNFILTERED)
        # HDF5 (2.0 at least) keeps the chunk a direct write allocated in its lookup cache with
        # the filter mask it had before: reading it then runs the filters on unfiltered bytes.
        # Looking up another chunk (one past this row: usually none) replaces that entry.
        with contextlib.suppress(RuntimeError):
            self.values.id.read_direct_chunk((begin + rows, *(0 for _ in tile)))

    def _write_leaves(self, leaves: list[Leaf], start: int, stop: int) -> np.ndarray:
        """Write the records' values; return their stored kind codes."""
        kinds = np.array([leaf.kind for leaf in leaves], np.uint8)
        if self.values_id is None:
            first = next((leaf for leaf in leaves if leaf.kind != Kind.NONE), None)
            if first is None:
                return kinds  # only None so far: the kinds say it all
            self._create_values(first, sum(_alike(leaf, first) for leaf in leaves))
        assert self.values_id is not None
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
            _put(self.values_id, (start,), _objects(rows))
        if self.other is not None:
            rows = [
                to_blob(leaf) if bad else b"" for leaf, bad in zip(leaves, misfits, strict=True)
            ]
            _put(self.other.id, (start,), _objects(rows))
            kinds[misfits] |= IN_OTHER
        return kinds

    def _write_arrays(self, leaves: list[Leaf], fits: list[bool], start: int, stop: int) -> None:
        assert self.values_id is not None and self.chunk is not None
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
    array = np.empty(len(rows), dtype=STR if rows and isinstance(rows[0], str) else _BLOB)
    for index, row in enumerate(rows):
        array[index] = np.frombuffer(row, np.uint8) if isinstance(row, bytes) else row
    return array


def describe(group: h5py.Group, origin: ReducedFrom | Placement) -> None:
    """Give a site's `group` the attributes of `origin`, merged with those it holds (a
    placement: the first the site was given, as the tracer keeps it)."""
    if isinstance(origin, Placement):
        if PLACEMENTS not in group.attrs:
            group.attrs.update(placement_attrs(origin))
        return
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
