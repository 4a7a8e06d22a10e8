"""A site of a read run as users see it: `Site` (records by index, `get`, `calls`,
`to_xarray`) over the parts of one file or several shards, and `ValuesView`, the lazy
`values` across shards.

Example:
    ```python
    site = run["forward.x"]
    site.get(iteration=8)    # the value the site held at iteration 8 (rank 0)
    site.calls(iteration=8)  # every record of iteration 8, in capture order
    ```
"""

from __future__ import annotations

import bisect
import collections
import functools
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import h5py
import numpy as np

from vartrace._support.html import block
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.storage.codec import KIND_NAMES, decode_raw, in_values
from vartrace.storage.guard import FREE_READ_BYTES, RunFileError, check_read, held_bytes, size_text
from vartrace.storage.site_reader import Part
from vartrace.storage.site_stats import Columns, describe

__all__ = ["Site", "ValuesView", "all_values", "described"]


class ValuesView:
    """The `values` of one site's records, lazily: across shards (in merged
    record order), or of a file whose `values` holds rows past the last
    flushed record (a killed or running writer's).

    Supports `len`, `shape`, `dtype`, `ndim`, indexing along records
    (an int, a slice or an index array, optionally followed by more indices)
    and `numpy.asarray`; records are zero-padded to the largest shape.
    """

    def __init__(
        self, parts: list[Part], where: list[tuple[int, int]], fitting: list[bool]
    ) -> None:
        datasets = [
            part.values
            for part, fits in zip(parts, fitting, strict=True)
            if fits and part.values is not None
        ]
        self._parts = parts
        self._where = [(part, row) if fitting[part] else (-1, row) for part, row in where]
        self.dtype = datasets[0].dtype
        padded = np.max([dataset.shape[1:] for dataset in datasets], axis=0).astype(int)
        self.shape = (len(where), *(int(size) for size in padded))
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """The bytes of the records as the files store them (each at its part's padded
        shape, uncompressed), as `h5py.Dataset.nbytes` counts a single file's."""
        rows = collections.Counter(part for part, _ in self._where)
        return sum(
            count * int(np.prod(values.shape[1:], dtype=object)) * values.dtype.itemsize
            for part, count in rows.items()
            if (values := self._parts[part].values) is not None
        )

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
        parts = {part for part, _ in where}  # -1: a record of another dtype or rank, not here
        located = np.array([row for _, row in where], int)
        stored: list[Any] = [part.values for part in self._parts]  # (a site view has values)
        if len(parts) == 1 and -1 not in parts and located.size and (np.diff(located) == 1).all():
            block = stored[where[0][0]][located[0] : located[-1] + 1]
            out[(slice(None), *(slice(0, size) for size in block.shape[1:]))] = block
        else:
            for position, (part, row) in enumerate(where):
                if part < 0:
                    continue
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

    def __init__(self, name: str, parts: list[Part], allow_pickle: bool, run: Any = None) -> None:
        self.name = name
        self._run = run
        self._parts = parts
        self._allow_pickle = allow_pickle
        if not any(part.planned for part in parts):  # files already open: checked at once
            _ = self._merged

    @cached_property
    def _merged(self) -> tuple[list[tuple[int, int]], dict[str, np.ndarray], np.ndarray]:
        """(part, row) of each record in the site's order, its tags in that order and the
        order itself (places in the parts' rows one after the other): read when first
        used (a part listed from a manifest opens its file then)."""
        parts = self._parts
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
        where = list(zip(part_of[order].tolist(), row_of[order].tolist(), strict=True))
        return where, {field: column[order] for field, column in tags.items()}, order

    @property
    def _where(self) -> list[tuple[int, int]]:
        return self._merged[0]

    @property
    def iterations(self) -> np.ndarray:
        """The iteration of each record (int64)."""
        return self._merged[1]["iterations"]

    @property
    def ranks(self) -> np.ndarray:
        """The rank that recorded each record (int64)."""
        return self._merged[1]["ranks"]

    @property
    def order(self) -> np.ndarray:
        """The capture order of each record (int64): its place among its rank's records."""
        return self._merged[1]["order"]

    @property
    def _kinds(self) -> np.ndarray:
        return self._merged[1]["kinds"]

    def __len__(self) -> int:
        """The records of the site (known without reading them)."""
        return sum(part.rows for part in self._parts)

    def __repr__(self) -> str:
        return f"<Site {self.name!r} records={len(self)} dtype={self.dtype}>"

    def _repr_html_(self) -> str:
        """The site in a notebook: its records, dtype, bytes and iterations."""
        iterations = self.iterations
        span = f"{iterations.min()}-{iterations.max()}" if len(iterations) else "-"
        _, records, dtype, nbytes = self._summary_row()
        facts = [("records", records), ("dtype", dtype), ("bytes", nbytes), ("iterations", span)]
        return block(f"Site {self.name}", facts)

    def _summary_row(self) -> tuple[str, int, str, str]:
        """Name, records, dtype and the bytes of its values (uncompressed, padded)."""
        nbytes = getattr(self.raw_values, "nbytes", None)
        return self.name, len(self), self.dtype, "-" if nbytes is None else size_text(nbytes)

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
        return ValuesView(self._parts, self._where, self._fitting)

    @cached_property
    def _fitting(self) -> list[bool]:
        """Per part: whether its `values` are rows of the site's (the first part's with
        values: same dtype, as many axes).  The records of another part (the line sites of
        an `@every` series binding another dtype or rank) are read by `record` alone."""
        first = next((part for part in self._parts if part.values is not None), None)
        return [
            first is not None
            and part.values is not None
            and part.storage == first.storage
            and part.dtype == first.dtype
            and part.values.ndim == first.values.ndim  # type: ignore[union-attr]
            for part in self._parts
        ]

    @cached_property
    def shapes(self) -> np.ndarray:
        """The true shape of each record, (records, ndim); -1 rows: record not in `values`."""
        shapes = [
            part.shapes if fits else np.full((part.rows, 0), -1, np.int64)
            for part, fits in zip(self._parts, self._fitting, strict=True)
        ]
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
        found = in_values(self._kinds)
        if all(self._fitting):
            return found
        fits = np.asarray(self._fitting)[[part for part, _ in self._where]]
        return found & fits

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

    @property
    def placement(self) -> Placement | None:
        """How the ranks' records join into the whole tensor, where the site recorded a
        DTensor as each rank's local shard (tensor parallelism, FSDP2's sharded `.grad`);
        `None` where the records are whole tensors.  [`vartrace.assemble`][vartrace.assemble]
        joins them.

        Example:
            ```python
            run["a.weight"].placement.placements   # ('Shard(dim=0)',)
            ```
        """
        return next((p for part in self._parts if (p := part.placement) is not None), None)

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

    def to_frame(self, stat: str | Callable[[Any], Any] = "mean") -> Any:
        """The site's records as `Run.to_frame` gives them: a pandas DataFrame, one row per
        record, with the statistic `stat` (`run["forward.h@every"].to_frame("std")`)."""
        from vartrace.analysis.sources.frames import FrameSite, records_frame

        describe = functools.partial(described, self)
        site = FrameSite(self.name, self.iterations, self.ranks, self.order, describe)
        return records_frame([site], stat, caller="Site.to_frame()")

    def to_xarray(self, chunks: int | str | None = None) -> Any:
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

        `chunks` (`"auto"`: ~128 MB, or a number of records) makes it lazy: a dask
        array read by path, file by file (needs the `dask` extra).
        """
        if chunks is not None:
            from vartrace.analysis.dask_arrays import site_xarray

            return site_xarray(self._run, self.name, chunks)
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
            data = decode_raw(data, torch_dtype, width=64, where=f"site {self.name!r}")
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


def described(site: Site, stats: Sequence[str | Callable[[Any], Any]]) -> Columns:
    """Per statistic of `stats` its column over the records of `site`, in its order, then
    each record's dtype name and shape (`Run.to_frame`'s cells; see `site_stats.describe`):
    each file's records read once for all of `stats`."""
    parts = [describe(part, stats, site._allow_pickle, site.name) for part in site._parts]
    if len(parts) == 1:
        return parts[0]
    order = site._merged[2]
    columns = [
        _in_order([part[0][column] for part in parts], order) for column in range(len(stats))
    ]
    dtypes = _in_order([part[1] for part in parts], order)
    return columns, dtypes, _in_order([part[2] for part in parts], order)


def _in_order(pieces: list[Any], order: np.ndarray) -> Any:
    """The concatenation of the parts' columns `pieces`, taken in the site's `order`."""
    if all(isinstance(piece, np.ndarray) for piece in pieces):
        return np.concatenate(pieces)[order]
    joined = [cell for piece in pieces for cell in piece]
    return [joined[at] for at in order.tolist()]
