"""Dataset filters of a saver's file, and the maker of its groups, datasets and attributes.

Example:
    ```python
    filters = dataset_filters("blosc", None, False)  # checked now: ValueError if unusable
    made = Made(filters)
    values = made.dataset(group, "values", (0, 4), np.dtype(np.float32),
                          chunks=(16, 4), filtered=True)
    ```

A compression setting is a shortcut of `COMPRESSIONS`, a compression HDF5 knows,
a filter number or an `hdf5plugin` filter object; `dataset_filters` turns it into
h5py's keyword arguments and tries them on a dataset in memory.  `Made` creates
objects with HDF5's own calls, reusing the property lists of the first of each layout.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

import h5py
import numpy as np

__all__ = ["COMPRESSIONS", "STR", "UNFILTERED", "Made", "dataset_filters"]

UNFILTERED = 0xFFFFFFFF  # a chunk's filter mask: stored as it is, no filter applied
STR = h5py.string_dtype("utf-8")


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


def dataset_filters(compression: Any, options: Any, shuffle: bool) -> dict[str, Any]:
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


class Made:
    """Makes the groups, datasets and attributes of sites with HDF5's own calls.

    h5py's `create_group`, `create_dataset` and `attrs[...] = ...` build a new
    creation property list, datatype and dataspace at each call: most of the cost of
    a site's creation.  Here the first dataset of each layout (dtype, maximum shape,
    chunks, fill value, filters) and the first group are made by h5py, and the later
    ones reuse their creation property lists and datatypes: the same objects, made
    for a fraction of the time.  Example:

    ```python
    made = Made({"compression": "gzip"})
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
        # (shape, maximum shape) -> its dataspace, which HDF5 copies into each dataset made
        self.spaces: dict[tuple[tuple[int, ...], tuple[int, ...]], h5py.h5s.SpaceID] = {}
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        # Attribute types as h5py makes them: (stored type, type of the data written).
        self.types = {
            kind: (h5py.h5t.py_create(dtype, logical=True), h5py.h5t.py_create(dtype))
            for kind, dtype in ((int, np.dtype(np.int64)), (str, STR))
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
        space = self.spaces.get((shape, unlimited))
        if space is None:
            space = self.spaces[shape, unlimited] = h5py.h5s.create_simple(shape, unlimited)
        return h5py.h5d.create(group.id, name.encode(), datatype, space, dcpl=dcpl)

    def attribute(
        self, target: h5py.h5g.GroupID | h5py.h5d.DatasetID, name: str, value: int | str
    ) -> None:
        """Give the group or dataset `target` the scalar attribute `name` (a new one), as
        `attrs[name] = value` does: an int64, or a variable-length UTF-8 string."""
        stored, written = self.types[type(value)]
        data = np.array(value, np.int64 if isinstance(value, int) else STR)
        attribute = h5py.h5a.create(target, name.encode(), stored, self.scalar)
        attribute.write(data, mtype=written)
