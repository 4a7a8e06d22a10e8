"""Reading one site of one file (a shard's part of a site): its datasets opened and
checked when used, its tags, its records one by one with read-ahead for loops.

A `Part` is made when a run lists its sites and reads nothing until used;
`ReadAhead` serves record-by-record loops from blocks read in one go.  The
statistics of all of a part's records at once are `site_stats`' job.
"""

from __future__ import annotations

import math
import threading
from functools import cache, cached_property
from typing import Any

import h5py
import numpy as np

from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.statistics.named import SUMMARY_FIELDS
from vartrace.storage.codec import (
    IN_OTHER,
    KIND_NAMES,
    Kind,
    from_array,
    from_blob,
    in_values,
    row_shapes,
)
from vartrace.storage.files import int_attr, leading_rows, load_filters, text_attr, too_few
from vartrace.storage.guard import (
    FREE_READ_BYTES,
    RunFileError,
    check_link,
    check_read,
    check_storage,
    child,
    file_name,
)
from vartrace.storage.layout import SITE_INDEX, TAGGED, TAGS, placement_of, reduced_from
from vartrace.storage.root_rows import site_slot
from vartrace.storage.shard import Shard

__all__ = ["Part", "ReadAhead"]

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


class ReadAhead:
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
        self._blocks: dict[int, tuple[Part, int, np.ndarray]] = {}
        self._lock = threading.Lock()

    def find(self, part: Part, row: int) -> np.ndarray | None:
        """Row `row` of `part` from its block (a view), or `None` if not read ahead."""
        with self._lock:
            held = self._blocks.pop(id(part), None)
            if held is None or held[0] is not part:
                return None
            self._blocks[id(part)] = held  # the most recently used: last
        _, first, block = held
        return block[row - first] if 0 <= row - first < len(block) else None

    def holds(self, part: Part) -> bool:
        with self._lock:
            held = self._blocks.get(id(part))
        return held is not None and held[0] is part

    def keep(self, part: Part, first: int, block: np.ndarray) -> None:
        with self._lock:
            self._blocks.pop(id(part), None)
            self._blocks[id(part)] = (part, first, block)
            while len(self._blocks) > _AHEAD_BLOCKS:
                del self._blocks[next(iter(self._blocks))]


#: Read-ahead of record-by-record loops (see :class:`ReadAhead`).
_AHEAD_FIRST = 8
_AHEAD_BYTES = 1 << 20
_AHEAD_BLOCKS = 8


class Part:
    """One file's datasets of one site.

    Made when a run lists its sites, from the shard's manifest (its file unopened), from
    the file's root index (reading nothing of the site) or, in a file without one, from
    the site's group and its `slot` attribute; its group and datasets are opened (and
    checked) when the site is used.
    """

    def __init__(
        self,
        shard: Shard,
        link: str,
        slot: int,
        rows: int,
        ahead: ReadAhead,
        first_order: int | None = None,
        *,
        tagged: bool,
    ) -> None:
        """The site `/vars/<link>` of `shard`'s file, of slot `slot`, holding `rows`
        committed records; `first_order` as the root index (or the manifest) gives it;
        `tagged`: laid out as format version 2 says (one `tags` dataset, `shapes` only
        where needed)."""
        self._shard = shard
        self.tagged = tagged
        self.link = link
        self.slot = slot
        self.rows = rows
        self._first_order = first_order
        self._ahead = ahead
        self._next_row = -1  # the row after the one read last: a loop reads it next
        self._ahead_rows = 0  # rows the next block read ahead holds

    @classmethod
    def walked(
        cls,
        shard: Shard,
        link: str,
        committed: np.ndarray,
        ahead: ReadAhead,
        *,
        tagged: bool,
    ) -> Part:
        """The site `/vars/<link>` of a file read without its root index: its group is
        opened for its `slot` attribute."""
        group = child(shard.vars, link, h5py.Group)
        slot = site_slot(group)
        rows = int(committed[slot]) if slot < len(committed) else 0
        part = cls(shard, link, slot, rows, ahead, tagged=tagged)
        part.__dict__["group"] = group  # (the cached property, already known)
        return part

    @property
    def planned(self) -> bool:
        """Whether the part was listed from its shard's manifest, its file unopened then."""
        return self._shard.manifest is not None

    @cached_property
    def group(self) -> h5py.Group:
        """The site's group, checked to be the one of its slot."""
        group = child(self._shard.vars, self.link, h5py.Group)
        slot = int_attr(group, "slot")
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
                self._first_order = int(leading_rows(self.group, "order", 1)[0])
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
    def placement(self) -> Placement | None:
        """The placement of the DTensor whose local shards the part's records are."""
        group = self.group
        try:
            return placement_of(group.attrs)
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
            raise too_few(group, "values", held, self.rows)
        # Read-only: h5py keeps its shape and fast reader (the run is read as of its opening).
        return h5py.Dataset(dataset, readonly=True)

    @cached_property
    def unreadable(self) -> str | None:
        return None if self.values is None else load_filters(self.values)

    @cached_property
    def storage(self) -> str:
        _ = self.unreadable
        return "" if self.values is None else text_attr(self.values, "storage")

    @cached_property
    def torch_dtype(self) -> str:
        _ = self.storage
        return "" if self.values is None else text_attr(self.values, "torch_dtype", "")

    @cached_property
    def written_dtype(self) -> np.dtype | None:
        """The dtype the records were written with: h5py reads non-native byte orders as
        native."""
        _ = self.torch_dtype
        key = "" if self.values is None else text_attr(self.values, "key", "")
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
            raise too_few(self.group, name, held, self.rows)
        return dataset

    @cached_property
    def tags(self) -> dict[str, np.ndarray]:
        """The records' iterations, ranks, capture orders (int64) and kinds (uint8)."""
        if not self.tagged:
            tags = {name: leading_rows(self.group, name, self.rows) for name in TAGS}
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
        table = leading_rows(self.group, TAGGED, rows)
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
            shapes = leading_rows(self.group, "shapes", self.rows)
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
        (see `ReadAhead`); any other is read alone.
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
