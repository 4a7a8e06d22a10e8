"""Site views: one site of a run, in memory or in a file, seen uniformly.

`SiteView` gives numpy tags and block reads whatever the run's form;
`numeric_groups` and `record_stats` work on any view.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from vartrace.analysis.sources.buffers import BufferPool
from vartrace.analysis.sources.chunk_maps import ChunkMap, FileMaps
from vartrace.errors import PickleNotAllowedError
from vartrace.reduced import ReducedFrom
from vartrace.statistics.named import (
    BLOCK_BYTES,
    stat_function,
    statistic_of,
    summarize_block,
    value_as_array,
    value_dtype_name,
)
from vartrace.storage.codec import decode_raw, numeric_dtype
from vartrace.storage.guard import check_read
from vartrace.storage.sites import all_values
from vartrace.trace import Trace

__all__ = [
    "FileSiteView",
    "MemorySiteView",
    "SiteView",
    "Unreadable",
    "dtype_label",
    "numeric_groups",
    "record_stats",
]


class SiteView:
    """One site of a run, seen uniformly whatever the run's form.

    Tags are 1-D int64 numpy arrays.  `shapes[i]` is record `i`'s true
    shape, or `None` when the record is not numeric (str, bytes, None, an
    opaque object); `dtypes[i]` names its dtype.  `read` returns
    numeric records stacked with an exact shape, `objects` returns the
    values of non-numeric ones.

    Example:
        ```python
        with open_source("run.h5") as run:
            view = run.site("loss")
            block = view.read(np.arange(len(view.iterations)), view.shapes[0])
        ```
    """

    name: str
    iterations: np.ndarray
    ranks: np.ndarray
    order: np.ndarray
    shapes: list[tuple[int, ...] | None]
    dtypes: list[str]
    #: What a pre-save callback made the records from (statistics rows), if it did.
    reduced_from: ReducedFrom | None = None

    def dtype_label(self, dtype: str) -> str:
        """`dtype` as shown: statistics rows say what they summarise
        (`"statistics of bfloat16"`) where the run knows it."""
        return dtype_label(dtype, self.reduced_from)

    def read(
        self, rows: np.ndarray, shape: tuple[int, ...], pool: BufferPool | None = None
    ) -> np.ndarray:
        """Records `rows` (in any order, all of true shape `shape`) as one array.

        With a `pool`, the array may be one of its buffers: hand it back with
        `pool.give(array)` once done (arrays not from the pool are ignored there).
        """
        raise NotImplementedError

    def objects(self, rows: np.ndarray) -> list[Any]:
        """The values of the non-numeric records `rows`."""
        raise NotImplementedError

    def views(
        self, rows: np.ndarray, shape: tuple[int, ...]
    ) -> list[tuple[int, np.ndarray]] | None:
        """Records `rows` as zero-copy arrays of consecutive records, or `None`.

        Each entry is `(position in rows, array of the next len(array) records)`.
        Only records stored uncompressed in a file, at full padded shape, can
        be viewed this way (see `FileMaps`); the rest is `read`.
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


class MemorySiteView(SiteView):
    """A [`Trace`][vartrace.Trace] held in memory (list or stacked values)."""

    def __init__(self, name: str, trace: Trace, reduced_from: ReducedFrom | None = None) -> None:
        self.name = name
        self.reduced_from = reduced_from
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


class FileSiteView(SiteView):
    """A site of an open run read from HDF5 (`run[name]`).

    Records stored in the site's numeric `values` dataset are read in
    blocks (raw-bit dtypes such as bfloat16 decoded exactly to float32);
    the others (None, str, blobs, records of another dtype) one by one.
    """

    def __init__(self, name: str, site: Any, maps: FileMaps | None = None) -> None:
        self.name = name
        self._site = site
        self.reduced_from = site.reduced_from
        self._maps = maps
        self._chunks: ChunkMap | bool | None = False  # False: not looked up yet
        self.iterations = _int_array(site.iterations)
        self.ranks = _int_array(site.ranks)
        self.order = _int_array(site.order)
        count = len(self.iterations)
        self._dtype = str(site.dtype)
        values = site.raw_values  # listing needs no compression filter; reads check it
        kinds = np.asarray(site.kinds).astype(str).tolist()
        blocky = values is not None and numeric_dtype(self._dtype)
        stored = np.asarray(site.in_values).tolist() if blocky else [False] * count
        fits = [held and kind in _NUMERIC_KINDS for held, kind in zip(stored, kinds, strict=True)]
        shapes = np.asarray(site.shapes, dtype=np.int64).reshape(count, -1).tolist()
        self.shapes = [
            tuple(shape) if fit else None for shape, fit in zip(shapes, fits, strict=True)
        ]
        self.dtypes = [
            self._dtype if fit else str(kind) for kind, fit in zip(kinds, fits, strict=True)
        ]

    def read(
        self, rows: np.ndarray, shape: tuple[int, ...], pool: BufferPool | None = None
    ) -> np.ndarray:
        if len(rows) > 1 and bool(np.any(np.diff(rows) < 0)):
            ascending = np.argsort(rows, kind="stable")
            return self.read(rows[ascending], shape)[np.argsort(ascending)]
        start, stop = int(rows[0]), int(rows[-1]) + 1
        if stop - start > 2 * len(rows):
            return np.concatenate([self.read(np.asarray([r]), shape) for r in rows])
        values = self._site.values
        selection = (slice(start, stop), *(slice(0, d) for d in shape))
        if isinstance(values, h5py.Dataset):
            check_read(values, (stop - start) * math.prod(shape))
        direct = isinstance(values, h5py.Dataset) and values.dtype.name == self._dtype
        if pool is not None and direct and stop - start == len(rows):
            out = pool.take((len(rows), *shape), values.dtype)
            if out.size:
                values.read_direct(out, selection)
            return out
        block = decode_raw(
            np.asarray(values[selection]), self._dtype, width=32, where=f"site {self.name!r}"
        )
        return block if stop - start == len(rows) else block[rows - start]

    def views(
        self, rows: np.ndarray, shape: tuple[int, ...]
    ) -> list[tuple[int, np.ndarray]] | None:
        if self._chunks is False:
            values = self._site.values
            maps = self._maps
            usable = maps is not None and values is not None
            usable = usable and values.dtype.name == self._dtype
            self._chunks = maps.chunk_map(values) if maps is not None and usable else None
        chunks = self._chunks
        if not isinstance(chunks, ChunkMap) or tuple(shape) != chunks.record_shape:
            return None
        return chunks.groups(rows)

    def objects(self, rows: np.ndarray) -> list[Any]:
        if self._dtype == STATISTICS and len(rows) > 1:
            return self._statistics(rows)
        out: list[Any] = []
        for r in rows:
            try:
                out.append(self._site.record(int(r)))
            except PickleNotAllowedError:
                out.append(Unreadable("a pickled object (open the run with allow_pickle=True)"))
        return out

    def _statistics(self, rows: np.ndarray) -> list[Any]:
        """Records of a statistics site: its compound `values` read in one go."""
        from vartrace.statistics.records import Statistics

        fits = np.asarray(self._site.in_values)
        table = all_values(self._site.values) if fits[rows].any() else None
        return [
            Statistics(table[r])
            if table is not None and fits[r]
            else self.objects(np.asarray([r]))[0]
            for r in rows
        ]


def numeric_groups(
    view: SiteView, rows: np.ndarray | None = None
) -> dict[tuple[int, ...], np.ndarray]:
    """Numeric record indices of `view` (or of `rows`) grouped by true shape, ascending.

    Example:
        ```python
        for shape, rows in numeric_groups(view).items():
            block = view.read(rows, shape)
        ```
    """
    candidates = range(len(view.iterations)) if rows is None else rows
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in candidates:
        shape = view.shapes[int(r)]
        if shape is not None:
            groups.setdefault(shape, []).append(int(r))
    return {shape: np.asarray(sorted(g), dtype=np.int64) for shape, g in groups.items()}


#: The dtype name of statistics records (:func:`vartrace.stats`) in :attr:`SiteView.dtypes`.
STATISTICS = "statistics"


def dtype_label(dtype: str, reduced_from: ReducedFrom | None) -> str:
    """`dtype` as a report shows it: statistics rows say what they summarise
    (`"statistics of bfloat16"`) where `reduced_from` (of their site) says it."""
    if dtype != STATISTICS or reduced_from is None:
        return dtype
    return f"{STATISTICS} of {reduced_from.dtype}"


def _field_name(name: str) -> bool:
    """Whether `name` is a field only statistics records have (a quantile, a histogram bin)."""
    return name.startswith(("q", "log2|x|"))


def record_stats(
    view: SiteView, stats: str | Sequence[str] = "mean", *, progress: bool = False
) -> dict[str, np.ndarray]:
    """Statistics (`STATS` names) of every record of a site, in one pass over the data.

    Returns name -> one float per record (NaN for non-numeric records).
    Statistics records ([`vartrace.stats`][vartrace.stats]) give their stored fields, which
    include those only they have (`q0.5`, `log2|x|=3`).  Numeric records are
    read in large blocks (or viewed in place, see `FileMaps`) and reduced
    vectorised; `progress` shows a tqdm bar on stderr when that takes more
    than a second.

    Example:
        ```python
        with open_source("run.h5") as run:
            stds = record_stats(run.site("layers.0.out"), "std")["std"]
        ```
    """
    from vartrace._support.progress import progress_bar

    names = [stats] if isinstance(stats, str) else list(stats)
    computed = [name for name in names if not _field_name(name)]
    for name in computed:
        stat_function(name)  # an unknown name raises, naming the known ones
    out = {name: np.full(len(view.iterations), math.nan) for name in names}

    def reduce(rows: np.ndarray, block: np.ndarray) -> None:
        for name, values in summarize_block(block, computed).items():
            out[name][rows] = values

    groups = numeric_groups(view)
    total = sum(len(rows) for rows in groups.values())
    with progress_bar(show=progress, total=total, desc=view.name, unit="record") as bar:
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
    others = np.asarray([r for r, shape in enumerate(view.shapes) if shape is None], np.int64)
    for row, value in zip(others, view.objects(others) if len(others) else [], strict=True):
        value = _readable(value)
        if view.dtypes[row] == STATISTICS:
            for name in names:
                out[name][row] = statistic_of(value, name)
            continue
        numbers = value_as_array(value)
        if numbers is not None:
            reduce(np.asarray([row]), numbers[None])
    return out
