"""The chunk geometry of a site's datasets: rows of a tag chunk, shape of a `values` chunk.

Example:
    ```python
    rows = gather_rows(8)  # 256: rows of a chunk of tags, from the first gather's records
    chunk = values_chunks((1024,), 4, 8)  # (8, 1024): a gather of 8 records of 4 KiB fills one
    ```

A site's chunks are shaped by its first gather: a gather of as many records fills
whole chunks, so a compressed chunk is written once.
"""

from __future__ import annotations

import math

__all__ = ["gather_rows", "values_chunks"]

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


def gather_rows(records: int) -> int:
    """Rows of a site's tag chunks, from the records of its first gather: about
    `_GATHERS_A_CHUNK` gathers' worth (a power of two), so that a short run's file
    holds little unused space and a long run's few chunks.

    Example: `gather_rows(8) == 256` (the floor), `gather_rows(1000) == 2048`.
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


def values_chunks(shape: tuple[int, ...], itemsize: int, records: int) -> tuple[int, ...]:
    """Chunk shape of `values` for records of `shape`, the site's first gather holding
    `records` of them: whole records (split when above `_CHUNK_MAX`), rows as
    `_chunk_rows` gives."""
    dims = [max(1, size) for size in shape]
    while math.prod(dims) * itemsize > _CHUNK_MAX:
        largest = dims.index(max(dims))
        dims[largest] = -(-dims[largest] // 2)
    least = _CHUNK_MIN if shape else _CHUNK_MIN_0D
    return (_chunk_rows(records, math.prod(dims) * itemsize, least), *dims)
