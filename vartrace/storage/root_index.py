"""The root index of a file being written: each site's slot, record count, name and alias target.

Example:
    ```python
    index = RootIndex(handle)  # read from the file (built from /vars for an older one)
    slot = index.add("forward.x")
    index.define(slot, "forward.x", first_order=0)
    index.set_count(slot, 8)
    index.write_rows()  # before the flush
    handle.flush()
    index.write_counts()  # after it: readers trust the records counted here
    ```

`/committed` holds each slot's record count, `/site_index` its row and
`/site_names` the link names' bytes (see `vartrace.storage.layout`).  Every
write rewrites whole unfiltered chunks in place, so a killed writer leaves the
counts of its last completed flush.
"""

from __future__ import annotations

import h5py
import numpy as np

from vartrace.storage.files import leading_rows
from vartrace.storage.layout import (
    COMMITTED,
    NAME_END,
    NAME_START,
    NO_TARGET,
    SITE_INDEX,
    SITE_NAMES,
    TAGGED,
    TAGS,
)
from vartrace.storage.root_rows import alias_rows, committed_counts, indexed, site_slots

__all__ = ["RootIndex"]

_SLOTS = 4096  # record counts per chunk of /committed
_INDEX_ROWS = 128  # slots per chunk of /site_index (4 KiB: a small file stays small)
_NAME_BYTES = 4 << 10  # bytes per chunk of /site_names


def _create_index(handle: h5py.File) -> None:
    """Create `/site_index` and `/site_names`, empty (`RootIndex.write_rows` sizes them)."""
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


class RootIndex:
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
        stored = committed_counts(handle)
        rows = indexed(handle, stored)  # (a damaged index is refused as the reader refuses it)
        self.counts = stored.copy()
        self.held = {COMMITTED: len(stored), SITE_INDEX: 0, SITE_NAMES: 0}  # extents in the file
        self.slots = site_slots(handle, stored)  # link name -> slot, of every group in /vars
        self.vars: h5py.Group = handle["vars"]  # the sites' groups (opened once: 0.1 ms)
        # Sites a killed writer created but never committed hold no records; their slots stay
        # theirs.  The next slot follows them and the last counted one.
        counted = np.flatnonzero(stored)
        last = int(counted[-1]) + 1 if len(counted) else 0
        self.used = max([last, *(slot + 1 for slot in self.slots.values())])
        self.counts = _grown(self.counts, self.used, _SLOTS)
        self.dirty: dict[str, set[int]] = {SITE_INDEX: set(), SITE_NAMES: set()}
        #: alias -> (its slot, its target's name), as the reader lists them
        self.aliases: dict[str, tuple[int, str]] = alias_rows(rows or [])
        if SITE_INDEX in handle:
            self.rows = np.asarray(handle[SITE_INDEX][()], np.int64)
            self.names = bytearray(np.asarray(handle[SITE_NAMES][()], np.uint8).tobytes())
            self.held[SITE_INDEX], self.held[SITE_NAMES] = len(self.rows), len(self.names)
            self.end = int(min(len(self.names), max([0, *self.rows[:, NAME_END]])))
        else:
            self.rows = np.zeros((0, 4), np.int64)
            self.names = bytearray()
            self.end = 0
            _create_index(handle)
            for link, slot in self.slots.items():
                count = int(self.counts[slot]) if slot < len(self.counts) else 0
                group = self.vars[link]
                order: np.ndarray | list[int] = (
                    (
                        leading_rows(group, TAGGED, 1)[:, TAGS.index("order")]
                        if TAGGED in group
                        else leading_rows(group, "order", 1)
                    )
                    if count
                    else []
                )
                self.define(slot, link, int(order[0]) if len(order) else 0)

    @staticmethod
    def check(handle: h5py.File) -> None:
        """Raise the `RunFileError` that continuing `handle`'s index would meet (a file
        opened read-only: nothing is written)."""
        counts = committed_counts(handle)
        indexed(handle, counts)
        site_slots(handle, counts)

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
