"""Memory maps of HDF5 chunks: zero-copy views of uncompressed records in run files."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import threading
from typing import Any

import h5py
import numpy as np

__all__ = ["ChunkMap", "FileMaps"]


class ChunkMap:
    """Zero-copy views of the records of an unfiltered dataset chunked by whole records.

    Chunks that follow each other both in rows and in the file (those written
    by one gather, typically) merge into segments, so one view spans them.
    """

    def __init__(
        self,
        buffer: mmap.mmap,
        first_rows: np.ndarray,
        offsets: np.ndarray,
        chunk_rows: int,
        record_shape: tuple[int, ...],
        dtype: np.dtype,
    ) -> None:
        self._buffer = buffer
        self.record_shape = record_shape
        self._dtype = dtype
        self._record = int(np.prod(record_shape, dtype=np.int64))
        chunk_bytes = chunk_rows * self._record * dtype.itemsize
        joins = np.zeros(len(first_rows), dtype=bool)
        joins[1:] = (np.diff(first_rows) == chunk_rows) & (np.diff(offsets) == chunk_bytes)
        starts = np.flatnonzero(~joins)
        self._first_rows = first_rows[starts]
        self._offsets = offsets[starts]
        self._rows = np.diff(np.append(starts, len(first_rows))) * chunk_rows

    def groups(self, rows: np.ndarray) -> list[tuple[int, np.ndarray]] | None:
        """Runs of consecutive `rows` within a segment, as views; `None` if one is unwritten."""
        if len(rows) == 0:
            return []
        index = np.searchsorted(self._first_rows, rows, side="right") - 1
        safe = np.maximum(index, 0)
        if not bool(np.all((index >= 0) & (rows - self._first_rows[safe] < self._rows[safe]))):
            return None
        breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(index) != 0)) + 1
        out = []
        for start, stop in itertools.pairwise([0, *breaks.tolist(), len(rows)]):
            segment = int(index[start])
            first = int(rows[start] - self._first_rows[segment])
            offset = int(self._offsets[segment]) + first * self._record * self._dtype.itemsize
            array = np.frombuffer(self._buffer, self._dtype, (stop - start) * self._record, offset)
            out.append((start, array.reshape(stop - start, *self.record_shape)))
        return out


class FileMaps:
    """Read-only memory maps of run files, for zero-copy views of uncompressed records.

    Reading a block through HDF5 copies it from the page cache into a new
    buffer; a view of a memory map reads the page cache in place, so a pass
    over gigabytes costs one traversal instead of two.  Only datasets that
    are chunked with whole records per chunk, unfiltered, in native byte
    order, in a file of the default (`sec2`) driver qualify; everything
    else returns `None` and is read through HDF5.

    Example:
        ```python
        maps = FileMaps()
        chunks = maps.chunk_map(run["layers.0.out"].values)
        ```
    """

    def __init__(self) -> None:
        self._maps: dict[bytes, mmap.mmap | None] = {}
        self._lock = threading.Lock()

    def _file(self, dataset: h5py.Dataset) -> mmap.mmap | None:
        """A map of the file holding `dataset`; `None` unless it is a plain (sec2) file."""
        filename = h5py.h5f.get_name(dataset.id)  # cheaper than dataset.file
        with self._lock:
            if filename not in self._maps:
                self._maps[filename] = None
                if dataset.file.driver == "sec2":
                    with contextlib.suppress(OSError, ValueError), open(filename, "rb") as handle:
                        self._maps[filename] = mmap.mmap(
                            handle.fileno(), 0, access=mmap.ACCESS_READ
                        )
            return self._maps[filename]

    def chunk_map(self, dataset: Any) -> ChunkMap | None:
        """Views of `dataset`'s records, or `None` when it does not qualify."""
        if not isinstance(dataset, h5py.Dataset) or dataset.ndim == 0:
            return None
        layout = dataset.id.get_create_plist()
        if layout.get_layout() != h5py.h5d.CHUNKED or layout.get_nfilters() != 0:
            return None
        record_shape = tuple(int(d) for d in dataset.shape[1:])
        chunk_rows, *chunk_shape = layout.get_chunk()
        dtype = dataset.dtype
        if tuple(chunk_shape) != record_shape or dtype.kind not in "biufc" or not dtype.isnative:
            return None
        buffer = self._file(dataset)
        chunks = None if buffer is None else _chunk_table(dataset)
        if buffer is None or chunks is None:
            return None
        size = chunk_rows * int(np.prod(record_shape, dtype=np.int64)) * dtype.itemsize
        first_rows, offsets, sizes = chunks
        if np.any(sizes != size) or np.any(offsets + size > len(buffer)):
            return None
        return ChunkMap(buffer, first_rows, offsets, chunk_rows, record_shape, dtype)


def _chunk_table(dataset: h5py.Dataset) -> tuple[np.ndarray, ...] | None:
    """(first row, byte offset, stored size) of each written chunk, by first row."""
    found: list[tuple[int, int, int]] = []
    try:
        if hasattr(dataset.id, "chunk_iter"):
            dataset.id.chunk_iter(
                lambda info: found.append((info.chunk_offset[0], info.byte_offset, info.size))
            )
        else:
            for index in range(dataset.id.get_num_chunks()):
                info = dataset.id.get_chunk_info(index)
                found.append((info.chunk_offset[0], info.byte_offset, info.size))
    except (AttributeError, RuntimeError, OSError, ValueError):
        return None
    found.sort()
    table = np.asarray(found, dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]
