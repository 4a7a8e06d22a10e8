"""The `values` datasets of the file a saver writes, by site name: `H5PYSaverCallback.datasets`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import h5py

from vartrace.storage.layout import escape, unescape

__all__ = ["SiteDatasets"]


class SiteDatasets(Mapping[str, h5py.Dataset]):
    """The `values` datasets of an open file's sites, opened one at a time when looked up."""

    def __init__(self, handle: h5py.File | None) -> None:
        self._vars = None if handle is None else handle["vars"]

    def __getitem__(self, name: str) -> h5py.Dataset:
        group = None if self._vars is None else self._vars.get(escape(name))
        if group is None or "values" not in group:
            raise KeyError(name)
        return group["values"]

    def __iter__(self) -> Iterator[str]:
        group = self._vars
        if group is None:
            return iter(())
        return (unescape(link) for link in list(group) if "values" in group[link])

    def __len__(self) -> int:
        return sum(1 for _ in self)
