"""Uniform views of runs (files or memory), their DataFrames, and numeric record views.

A run reaches the analysis side in several forms: an HDF5 file (a path, a
glob of shards, or an open :class:`~vartrace.storage.reader.Run`), a
:class:`~vartrace.tracer.ModelTracer`, or ``tracer.results`` (any mapping of
site name -> :class:`~vartrace.trace.Trace`).  :func:`open_source` wraps each
in a :class:`Source` whose sites are :class:`SiteView` objects with numpy
tags and block reads, which :mod:`vartrace.comparison` and :mod:`vartrace.plot`
build on.

:func:`results_frame` turns ``tracer.results`` into the same table that
``vartrace.open(path).to_frame()`` gives for a file: one row per record
with its site, iteration, rank, capture order, shape, dtype and a
statistic of its value (Graphcore tensor_tracker style).

Example::

    with ModelTracer(model, ["**.forward"]) as tracer:
        model(x)
    df = tracer.results.to_frame(stat="std")
    df.groupby("site")["std"].mean()
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import h5py
import numpy as np

from vartrace.trace import Trace

__all__ = [
    "STATS",
    "BufferPool",
    "FileMaps",
    "SiteView",
    "Source",
    "Unreadable",
    "numeric_groups",
    "open_source",
    "record_stats",
    "results_frame",
    "stat_function",
    "value_as_array",
    "value_dtype_name",
]

#: Largest block (bytes per read, as float64) read or converted in one go.
BLOCK_BYTES = 64 << 20


def _magnitude(block: np.ndarray) -> np.ndarray:
    return np.abs(block) if block.dtype.kind == "c" else block


def _rows_norm(block: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("ij,ij->i", block, block))


#: Statistics a frame or plot can carry, by name (those of ``Run.to_frame``, plus ``var``);
#: each reduces a (records, elements) float64 array (complex values by magnitude) to one
#: float per record.  ``std`` and ``var`` are the population ones.
STATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda b: b.mean(axis=1),
    "std": lambda b: b.std(axis=1),
    "var": lambda b: b.var(axis=1),
    "min": lambda b: b.min(axis=1),
    "max": lambda b: b.max(axis=1),
    "norm": _rows_norm,
    "absmax": lambda b: np.abs(b).max(axis=1),
}


def stat_function(stat: str) -> Callable[[np.ndarray], np.ndarray]:
    """The vectorised reducer of a statistic name from :data:`STATS`.

    Example::

        stat_function("std")(np.ones((2, 3)))   # array([0., 0.])
    """
    if stat not in STATS:
        raise ValueError(f"unknown statistic {stat!r}; choose one of {', '.join(STATS)}")
    return STATS[stat]


def _reduce(fn: Callable[[np.ndarray], Any], block: np.ndarray) -> np.ndarray:
    """Apply a statistic to a (k, *shape) numeric block: float64, magnitudes for complex."""
    k = block.shape[0]
    flat = _magnitude(block.reshape(k, -1)).astype(np.float64, copy=False)
    if flat.shape[1] == 0:
        return np.full(k, math.nan)
    with np.errstate(all="ignore"):
        return np.asarray(fn(flat), dtype=np.float64).reshape(k)


def value_as_array(value: Any) -> np.ndarray | None:
    """A numpy view of a numeric record value, or ``None`` for anything else.

    Tensors are detached and moved to the CPU; bfloat16 and float8 become
    float32 (exactly).  Python and numpy scalars become 0-d arrays.

    Example::

        value_as_array(torch.ones(2, dtype=torch.bfloat16)).dtype   # float32
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in "biufc" else None
    if isinstance(value, (bool, int, float, complex, np.generic)):
        try:
            array = np.asarray(value)
        except OverflowError:
            return None
        return array if array.dtype.kind in "biufc" else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.is_floating_point() and tensor.dtype not in (
            torch.float16,
            torch.float32,
            torch.float64,
        ):
            tensor = tensor.float()
        return tensor.cpu().resolve_conj().resolve_neg().numpy()
    return None


def value_dtype_name(value: Any) -> str:
    """The dtype of a record value, named as ``Run.to_frame`` names it.

    Tensors and numpy values give their dtype (``"float32"``, ``"bfloat16"``);
    Python scalars their type (``"int"``, ``"float"``); ``"str"``, ``"bytes"``,
    ``"none"``; any other object ``"pickle"`` (how a file stores it).

    Example::

        value_dtype_name(torch.zeros(1))   # "float32"
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype.name
    if value is None:
        return "none"
    if isinstance(value, (bool, int, float, complex, str, bytes)):
        return type(value).__name__
    return "pickle"


def _tag_list(values: Any) -> list[int]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def results_frame(
    results: Mapping[str, Trace] | Any, stat: str | Callable[[Any], Any] = "mean"
) -> Any:
    """A pandas DataFrame of in-memory results: one row per record.

    ``results`` is ``tracer.results`` (or a :class:`~vartrace.tracer.ModelTracer`,
    or any mapping of site name -> :class:`~vartrace.trace.Trace`).  Columns:
    ``site``, ``iteration``, ``rank``, ``order``, ``shape`` (a tuple; ``()``
    for non-array values), ``dtype`` and one column named after ``stat``
    (a name from :data:`STATS`, float64, NaN for non-numeric values; or a
    function called with each record's value, as ``Run.to_frame`` does).

    Example::

        df = results_frame(tracer.results, stat="absmax")
        df.pivot_table(index="iteration", columns="site", values="absmax")
    """
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("results_frame() needs pandas: pip install 'vartrace[pandas]'") from exc
    results = getattr(results, "results", results)
    if callable(stat):
        name = getattr(stat, "__name__", "stat")
        column = "stat" if name == "<lambda>" else name
    else:
        column = stat
        reducer = stat_function(stat)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("site", "iteration", "rank", "order", "shape", "dtype", column)
    }
    for name, trace in results.items():
        records = trace.records()
        rows["site"].extend([name] * len(records))
        rows["iteration"].extend(_tag_list(trace.iterations))
        rows["rank"].extend(_tag_list(trace.ranks))
        rows["order"].extend(_tag_list(trace.order))
        for value in records:
            array = value_as_array(value)
            rows["shape"].append(() if array is None else tuple(array.shape))
            rows["dtype"].append(value_dtype_name(value))
            if callable(stat):
                rows[column].append(stat(value))
            else:
                rows[column].append(
                    math.nan if array is None else float(_reduce(reducer, array[None])[0])
                )
    frame = pd.DataFrame(rows)
    for tag in ("iteration", "rank", "order"):
        frame[tag] = frame[tag].astype("int64")
    return frame


# --------------------------------------------------------------------------- sources


class SiteView:
    """One site of a run, seen uniformly whatever the run's form.

    Tags are 1-D int64 numpy arrays.  ``shapes[i]`` is record ``i``'s true
    shape, or ``None`` when the record is not numeric (str, bytes, None, an
    opaque object); ``dtypes[i]`` names its dtype.  :meth:`read` returns
    numeric records stacked with an exact shape, :meth:`objects` returns the
    values of non-numeric ones.

    Example::

        with open_source("run.h5") as run:
            view = run.site("loss")
            block = view.read(np.arange(len(view.iterations)), view.shapes[0])
    """

    name: str
    iterations: np.ndarray
    ranks: np.ndarray
    order: np.ndarray
    shapes: list[tuple[int, ...] | None]
    dtypes: list[str]

    def read(
        self, rows: np.ndarray, shape: tuple[int, ...], pool: BufferPool | None = None
    ) -> np.ndarray:
        """Records ``rows`` (ascending, all of true shape ``shape``) as one array.

        With a ``pool``, the array may be one of its buffers: hand it back with
        ``pool.give(array)`` once done (arrays not from the pool are ignored there).
        """
        raise NotImplementedError

    def objects(self, rows: np.ndarray) -> list[Any]:
        """The values of the non-numeric records ``rows``."""
        raise NotImplementedError

    def views(
        self, rows: np.ndarray, shape: tuple[int, ...]
    ) -> list[tuple[int, np.ndarray]] | None:
        """Records ``rows`` as zero-copy arrays of consecutive records, or ``None``.

        Each entry is ``(position in rows, array of the next len(array) records)``.
        Only records stored uncompressed in a file, at full padded shape, can
        be viewed this way (see :class:`FileMaps`); the rest is :meth:`read`.
        """
        return None


def _int_array(values: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _crop(block: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(block.shape[1:]) == tuple(shape):
        return block
    return block[(slice(None), *(slice(0, d) for d in shape))]


class _MemorySiteView(SiteView):
    """A :class:`~vartrace.trace.Trace` held in memory (list or stacked values)."""

    def __init__(self, name: str, trace: Trace) -> None:
        self.name = name
        self.iterations = _int_array(trace.iterations)
        self.ranks = _int_array(trace.ranks)
        self.order = _int_array(trace.order)
        count = len(self.iterations)
        values = trace.values
        self._stacked: np.ndarray | None = None
        if isinstance(values, (list, tuple)):
            self._objects = list(values)
            self._arrays = [value_as_array(v) for v in values]
            self.shapes = [None if a is None else tuple(a.shape) for a in self._arrays]
            self.dtypes = [value_dtype_name(v) for v in values]
            return
        stacked = value_as_array(values)
        if stacked is None or stacked.ndim == 0 or len(stacked) != count:
            raise TypeError(f"site {name!r}: cannot read stacked values of {type(values).__name__}")
        self._stacked = stacked
        self._objects = []
        self._arrays = []
        true = trace.shapes if trace.shapes is not None else [stacked.shape[1:]] * count
        self.shapes = [tuple(int(d) for d in s) for s in true]
        self.dtypes = [value_dtype_name(values)] * count

    def read(
        self, rows: np.ndarray, shape: tuple[int, ...], pool: BufferPool | None = None
    ) -> np.ndarray:
        if self._stacked is not None:
            return _crop(self._stacked[rows], shape)
        if len(rows) == 0:
            return np.empty((0, *shape))
        return np.stack([self._arrays[r] for r in rows])

    def objects(self, rows: np.ndarray) -> list[Any]:
        if self._stacked is not None:
            return [_crop(self._stacked[[r]], self.shapes[r])[0] for r in rows]
        return [self._objects[r] for r in rows]


class Unreadable:
    """Stands for a record value that cannot be read: a pickled object, pickle not allowed.

    Never equal to anything, so a comparison reports the pair instead of
    running code stored in the file.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable: {self.reason}>"


def _readable(value: Any) -> Any:
    return None if isinstance(value, Unreadable) else value


#: Record kinds (``Site.kinds``) whose values are numbers or arrays.
_NUMERIC_KINDS = frozenset({"tensor", "ndarray", "numpy scalar", "int", "float", "bool", "complex"})


class _FileSiteView(SiteView):
    """A site of an open run read from HDF5 (``run[name]``).

    Records stored in the site's numeric ``values`` dataset are read in
    blocks (raw-bit dtypes such as bfloat16 decoded exactly to float32);
    the others (None, str, blobs, records of another dtype) one by one.
    """

    def __init__(self, name: str, site: Any, maps: FileMaps | None = None) -> None:
        self.name = name
        self._site = site
        self._maps = maps
        self._chunks: _ChunkMap | bool | None = False  # False: not looked up yet
        self.iterations = _int_array(site.iterations)
        self.ranks = _int_array(site.ranks)
        self.order = _int_array(site.order)
        count = len(self.iterations)
        self._dtype = str(site.dtype)
        values = site.values
        kinds = np.asarray(site.kinds).astype(str)
        blocky = values is not None and _numeric_dtype_name(self._dtype)
        in_values = (
            np.asarray(site.in_values) & np.isin(kinds, list(_NUMERIC_KINDS))
            if blocky
            else np.zeros(count, dtype=bool)
        )
        shapes = np.asarray(site.shapes, dtype=np.int64).reshape(count, -1).tolist()
        fits = in_values.tolist()
        self.shapes = [
            tuple(shape) if fit else None for shape, fit in zip(shapes, fits, strict=True)
        ]
        self.dtypes = [
            self._dtype if fit else str(kind) for kind, fit in zip(kinds, fits, strict=True)
        ]

    def read(
        self, rows: np.ndarray, shape: tuple[int, ...], pool: BufferPool | None = None
    ) -> np.ndarray:
        start, stop = int(rows[0]), int(rows[-1]) + 1
        if stop - start > 2 * len(rows):
            return np.concatenate([self.read(np.asarray([r]), shape) for r in rows])
        values = self._site.values
        selection = (slice(start, stop), *(slice(0, d) for d in shape))
        direct = isinstance(values, h5py.Dataset) and values.dtype.name == self._dtype
        if pool is not None and direct and stop - start == len(rows):
            out = pool.take((len(rows), *shape), values.dtype)
            if out.size:
                values.read_direct(out, selection)
            return out
        block = _decode_raw(np.asarray(values[selection]), self._dtype)
        return block if stop - start == len(rows) else block[rows - start]

    def views(
        self, rows: np.ndarray, shape: tuple[int, ...]
    ) -> list[tuple[int, np.ndarray]] | None:
        if self._chunks is False:
            values = self._site.values
            usable = self._maps is not None and values is not None
            usable = usable and values.dtype.name == self._dtype
            self._chunks = self._maps.chunk_map(values) if usable else None
        chunks = self._chunks
        if not isinstance(chunks, _ChunkMap) or tuple(shape) != chunks.record_shape:
            return None
        return chunks.groups(rows)

    def objects(self, rows: np.ndarray) -> list[Any]:
        from vartrace.storage.reader import PickleNotAllowedError

        out: list[Any] = []
        for r in rows:
            try:
                out.append(self._site.record(int(r)))
            except PickleNotAllowedError:
                out.append(Unreadable("a pickled object (open the run with allow_pickle=True)"))
        return out


def _decode_raw(block: np.ndarray, dtype: str) -> np.ndarray:
    """Numeric values of a block stored as raw bits of a torch dtype numpy lacks."""
    if block.dtype.name == dtype or dtype == "bool":
        return block
    if dtype == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(block).view(f"i{block.dtype.itemsize}"))
    tensor = raw.view(getattr(torch, dtype))
    return (tensor.to(torch.complex64) if tensor.is_complex() else tensor.float()).numpy()


def _numeric_dtype_name(name: str) -> bool:
    if name in ("bfloat16", "bool") or name.startswith(("float8", "complex32")):
        return True
    try:
        return np.dtype(name).kind in "biufc"
    except TypeError:
        return False


class _ChunkMap:
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
        """Runs of consecutive ``rows`` within a segment, as views; ``None`` if one is unwritten."""
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
    order, in a file of the default (``sec2``) driver qualify; everything
    else returns ``None`` and is read through HDF5.

    Example::

        maps = FileMaps()
        chunks = maps.chunk_map(run["layers.0.out"].values)
    """

    def __init__(self) -> None:
        self._maps: dict[bytes, mmap.mmap | None] = {}
        self._lock = threading.Lock()

    def _file(self, dataset: h5py.Dataset) -> mmap.mmap | None:
        """A map of the file holding ``dataset``; ``None`` unless it is a plain (sec2) file."""
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

    def chunk_map(self, dataset: Any) -> _ChunkMap | None:
        """Views of ``dataset``'s records, or ``None`` when it does not qualify."""
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
        return _ChunkMap(buffer, first_rows, offsets, chunk_rows, record_shape, dtype)


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


class BufferPool:
    """Reusable memory for blocks read from files.

    Fresh memory costs the kernel a page fault per 4 KiB; reading gigabytes
    into new arrays can take longer than the read itself.  A pool hands out
    arrays carved from buffers that earlier blocks gave back.  Thread-safe.

    Example::

        pool = BufferPool()
        block = view.read(rows, shape, pool)
        ...
        pool.give(block)
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, from a free buffer when one fits."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if buffer is None:
            buffer = np.empty(max(nbytes, 1), np.uint8)
        array = buffer[:nbytes].view(dtype).reshape(shape)
        with self._lock:
            self._lent[id(array)] = buffer
        return array

    def give(self, array: np.ndarray) -> None:
        """Return an array from :meth:`take` (anything else is ignored)."""
        with self._lock:
            buffer = self._lent.pop(id(array), None)
            if buffer is not None:
                self._free.append(buffer)


class Source:
    """A run in any form: its site names and a :class:`SiteView` per site.

    A source opened from a path closes its file on :meth:`close` (or when
    used as a context manager); one wrapping an object the caller opened
    leaves it open.

    Example::

        with open_source("run.h5") as run:
            for name in run.names:
                print(name, len(run.site(name).iterations))
    """

    def __init__(
        self,
        names: Sequence[str],
        view: Callable[[str], SiteView],
        label: str,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.names = list(names)
        self.label = label
        self._view = view
        self._close = close
        self._known = set(self.names)

    def site(self, name: str) -> SiteView:
        """The view of site ``name``; ``KeyError`` naming the run when it has no such site."""
        if name not in self._known:
            raise KeyError(f"{self.label} has no site {name!r}")
        return self._view(name)

    def close(self) -> None:
        """Close the file this source opened (no-op otherwise)."""
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def open_source(source: Any, *, allow_pickle: bool = False) -> Source:
    """Wrap a path/glob, an open run, a ModelTracer or a mapping name -> Trace as a :class:`Source`.

    Example::

        with open_source(tracer) as run:
            view = run.site("forward")
    """
    if isinstance(source, Source):
        return Source(source.names, source.site, source.label)
    if isinstance(source, (str, os.PathLike)):
        from vartrace.storage.reader import open_run

        run = open_run(source, allow_pickle=allow_pickle)
        maps = FileMaps()
        return Source(
            run.names, lambda n: _FileSiteView(n, run[n], maps), os.fspath(source), run.close
        )
    if hasattr(source, "names") and hasattr(source, "meta"):
        paths = [os.fspath(p) for p in getattr(source, "paths", [])] or ["run"]
        label = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} shards)"
        maps = FileMaps()
        return Source(source.names, lambda n: _FileSiteView(n, source[n], maps), label)
    results = getattr(source, "results", source)
    if isinstance(results, Mapping):
        label = "tracer results" if results is not source else "results"
        return Source(list(results), lambda n: _MemorySiteView(n, results[n]), label)
    raise TypeError(
        "expected a path, an open run, a ModelTracer or a mapping of site name -> Trace, "
        f"not {type(source).__name__}"
    )


def numeric_groups(
    view: SiteView, rows: np.ndarray | None = None
) -> dict[tuple[int, ...], np.ndarray]:
    """Numeric record indices of ``view`` (or of ``rows``) grouped by true shape, ascending.

    Example::

        for shape, rows in numeric_groups(view).items():
            block = view.read(rows, shape)
    """
    candidates = range(len(view.iterations)) if rows is None else rows
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in candidates:
        shape = view.shapes[int(r)]
        if shape is not None:
            groups.setdefault(shape, []).append(int(r))
    return {shape: np.asarray(sorted(g), dtype=np.int64) for shape, g in groups.items()}


def record_stats(
    view: SiteView, stats: str | Sequence[str] = "mean", *, progress: bool = False
) -> dict[str, np.ndarray]:
    """Statistics (:data:`STATS` names) of every record of a site, in one pass over the data.

    Returns name -> one float per record (NaN for non-numeric records).
    Numeric records are read in large blocks (or viewed in place, see
    :class:`FileMaps`) and reduced vectorised; ``progress`` shows a tqdm bar
    on stderr when that takes more than a second.

    Example::

        with open_source("run.h5") as run:
            stds = record_stats(run.site("layers.0.out"), "std")["std"]
    """
    from tqdm.auto import tqdm

    names = [stats] if isinstance(stats, str) else list(stats)
    reducers = {name: stat_function(name) for name in names}
    out = {name: np.full(len(view.iterations), math.nan) for name in names}

    def reduce(rows: np.ndarray, block: np.ndarray) -> None:
        for name, reducer in reducers.items():
            out[name][rows] = _reduce(reducer, block)

    groups = numeric_groups(view)
    total = sum(len(rows) for rows in groups.values())
    with tqdm(
        total=total, unit="record", desc=view.name, disable=not progress, delay=1.0, leave=False
    ) as bar:
        for shape, rows in groups.items():
            per_block = max(1, BLOCK_BYTES // max(8, 8 * int(np.prod(shape, dtype=np.int64))))
            for start in range(0, len(rows), per_block):
                chunk = rows[start : start + per_block]
                pieces = view.views(chunk, shape)
                if pieces is None:
                    reduce(chunk, view.read(chunk, shape))
                else:
                    for position, array in pieces:
                        reduce(chunk[position : position + len(array)], array)
                bar.update(len(chunk))
    for row in range(len(view.iterations)):
        if view.shapes[row] is None:
            array = value_as_array(_readable(view.objects(np.asarray([row]))[0]))
            if array is not None:
                reduce(np.asarray([row]), array[None])
    return out
