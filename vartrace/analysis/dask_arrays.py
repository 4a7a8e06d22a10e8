"""A run's numeric sites as dask arrays over its files: `run.to_dask(pattern)` and
`site.to_xarray(chunks=...)`.

A small task per file first reads each site's layout there (record count,
padded shape, dtype, tags; a manifest, when the run has them, makes this
unnecessary); each array is then the concatenation of chunks of about
`CHUNK_BYTES` (never one record), each read by a task that opens its file by
path.  Records come file by file (the run's files in order, each file's
records in its order), not merged by (iteration, rank, order) as `Site`
and `to_frame` merge them: a chunk never spans two files, where the merged
order would make each chunk read every file.  The tags (`iteration`,
`rank`, `order` coordinates of `to_xarray`, in the data's order) say which
record is which.  Raw-bit dtypes (bfloat16, float8)
decode to floats as `to_xarray()` gives them; ragged records are zero-padded
to the largest shape of the run.

Example:
    ```python
    arrays = dask_arrays(run, "blocks.*.forward")
    arrays["blocks.0.forward"].mean(axis=(1, 2)).compute()
    lazy = site_xarray(run, "blocks.0.forward", chunks="auto")
    lazy.sel(rank=0).max().compute()
    ```
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, NamedTuple

import numpy as np

from vartrace.analysis.scheduling import dask_module, run_calls, scheduler_of
from vartrace.analysis.tasks import RunFiles, naming, opened
from vartrace.storage.codec import decode_raw

__all__ = ["CHUNK_BYTES", "dask_arrays", "site_xarray"]

#: The bytes of one chunk of a dask array of a site, about.
CHUNK_BYTES = 128 << 20


class _Layout(NamedTuple):
    """One site in one file: its records' padded shape, dtypes and tags."""

    padded: tuple[int, ...]
    stored_dtype: str  # of `values` in the file
    dtype: str  # the site's dtype name (bfloat16...)
    numeric: bool
    tags: tuple[np.ndarray, np.ndarray, np.ndarray]  # iterations, ranks, order


def _layout_task(files: RunFiles, stored: tuple[str, ...]) -> dict[str, _Layout]:
    """The layout of each site of `stored` that `files` hold."""
    found = {}
    with naming(files), opened(files) as run:
        for name in stored:
            if name not in run or name in run.aliases:
                continue
            site = run[name]
            values = site.raw_values
            numeric = values is not None and values.dtype.kind in "biufc"
            numeric = numeric and bool(site.in_values.all())
            found[name] = _Layout(
                tuple(int(n) for n in values.shape[1:]) if values is not None else (),
                str(values.dtype) if values is not None else "",
                site.dtype,
                numeric,
                (site.iterations, site.ranks, site.order),
            )
    return found


def _chunk_task(
    files: RunFiles, name: str, rows: tuple[int, int], layout: _Layout, padded: tuple[int, ...]
) -> np.ndarray:
    """Records `rows` of site `name` in `files`, decoded and zero-padded to `padded`."""
    with naming(files), opened(files) as run:
        block = np.asarray(run[name].values[rows[0] : rows[1]])
    block = decode_raw(block, layout.dtype, width=64, where=f"site {name!r}")
    out = np.zeros((len(block), *padded), block.dtype)
    out[(slice(None), *(slice(0, n) for n in block.shape[1:]))] = block
    return out


def _layouts(run: Any, stored: list[str], scheduler: Any) -> list[dict[str, _Layout]]:
    """The layout of the sites in each file of `run`, read by a task per file."""
    files = RunFiles.of(run)
    if files is None:
        raise TypeError(f"{type(run).__name__} is not read from files")
    calls = [(_layout_task, (files.subset([path]), tuple(stored))) for path in files.paths]
    with scheduler_of(scheduler or "threads", "to_dask(scheduler=)") as engine:
        return run_calls(engine, calls, desc="layout")


def _array(
    run: Any, name: str, stored: str, layouts: list[dict[str, _Layout]], rows: int | None
) -> tuple[Any, tuple[np.ndarray, ...]]:
    """The dask array of site `name` (records `stored`) and its tags, file by file."""
    da = dask_module("dask.array", "Run.to_dask()")
    dask = dask_module("dask", "Run.to_dask()")
    files = RunFiles.of(run)
    assert files is not None
    held = [
        (path, found[stored])
        for path, found in zip(files.paths, layouts, strict=True)
        if stored in found
    ]
    if not held or not all(layout.numeric for _, layout in held):
        dtype = held[0][1].dtype if held else "none"
        raise TypeError(
            f"site {name!r}: to_xarray() takes sites of numeric records only "
            f"(dtype {dtype}); read the others with Site.record()"
        )
    padded = tuple(int(n) for n in np.max([layout.padded for _, layout in held], axis=0))
    kind = decode_raw(np.zeros(0, held[0][1].stored_dtype), held[0][1].dtype, width=64, where="")
    record_bytes = max(1, math.prod(padded) * kind.dtype.itemsize)
    per_chunk = rows or max(1, CHUNK_BYTES // record_bytes)
    chunks = []
    for path, layout in held:
        count = len(layout.tags[0])
        for start in range(0, count, per_chunk):
            stop = min(count, start + per_chunk)
            task = dask.delayed(_chunk_task, pure=True)(
                files.subset([path]), stored, (start, stop), layout, padded
            )
            chunks.append(da.from_delayed(task, (stop - start, *padded), kind.dtype))
    tags = tuple(np.concatenate([layout.tags[i] for _, layout in held]) for i in range(3))
    return da.concatenate(chunks, axis=0), tags


def dask_arrays(run: Any, pattern: str = "*", scheduler: Any = None) -> dict[str, Any]:
    """`run.to_dask(pattern)`: a dask array per numeric site matching `pattern` (a glob).

    Sites of other records (text, None, objects) are left out.  `scheduler`
    reads the files' layouts (default: Dask's threads).
    """
    names = [n for n in run.names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
    stored = list(dict.fromkeys(run.aliases.get(name, name) for name in names))
    layouts = _layouts(run, stored, scheduler)
    arrays = {}
    for name in names:
        try:
            arrays[name] = _array(run, name, run.aliases.get(name, name), layouts, None)[0]
        except TypeError:  # not numeric
            continue
    return arrays


def site_xarray(run: Any, name: str, chunks: int | str = "auto", scheduler: Any = None) -> Any:
    """`run[name].to_xarray(chunks=...)`: the site's `DataArray`, lazily (dask).

    `chunks` is a number of records per chunk, or `"auto"` (about
    `CHUNK_BYTES`).  Coordinates as `to_xarray()`: `record` indexed by
    `iteration` and `rank`, `order` alongside; records file by file.
    """
    try:
        import xarray as xr
    except ImportError as exc:
        raise ImportError(
            "Site.to_xarray() needs xarray: pip install 'torch-vartrace[xarray]'"
        ) from exc
    if name not in run:
        run[name]  # raises the reader's KeyError
    stored = run.aliases.get(name, name)
    rows = None if chunks == "auto" else int(chunks)
    if rows is not None and rows < 1:
        raise ValueError(f"chunks must be 'auto' or a number of records above 0, not {chunks!r}")
    data, (iterations, ranks, order) = _array(
        run, name, stored, _layouts(run, [stored], scheduler), rows
    )
    array = xr.DataArray(
        data,
        dims=("record", *(f"dim_{axis}" for axis in range(1, data.ndim))),
        coords={"iteration": ("record", iterations), "rank": ("record", ranks)}
        | {"order": ("record", order)},
        name=name,
    )
    return array.set_index(record=["iteration", "rank"])
