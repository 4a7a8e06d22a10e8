"""The saver's side of a shard's manifest: what each site holds, kept as records are written,
and the manifest rewritten at each flush and at close (see `manifest` for its content).

Example:
    ```python
    manifest = ManifestWriter.start(path, handle, index)  # removes a manifest of an older file
    manifest.note("forward.x", site, trace)  # after the site appended `trace`
    manifest.write(index)                    # after each flush's commit
    manifest.write(index, closed=True)       # once the file is closed
    ```

Only the shards of a sharded run get a manifest: a file of its own is opened anyway.
Writing one needs no collective and never fails the step: a failure is warned about once.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vartrace._support.warnings import warn
from vartrace.storage.layout import (
    FIRST_ORDER,
    FORMAT_ATTR,
    NODE_RANKS_ATTR,
    RUN_ID_ATTR,
    SHARD_ATTR,
    TAGGED,
    TAGS,
    WORLD_SIZE_ATTR,
    escape,
    unescape,
)
from vartrace.storage.manifest import MANIFEST_VERSION, manifest_path, write_manifest
from vartrace.storage.root_index import RootIndex
from vartrace.storage.site_writer import SiteWriter, int64
from vartrace.trace import Trace

__all__ = ["ManifestWriter"]


def _dtype(storage: str, values: h5py.Dataset | None) -> str:
    """A site's dtype as `Site.dtype` names it."""
    if values is None or storage not in ("array", "str", "blob"):
        return "none"
    if storage == "array":
        return str(values.attrs.get("torch_dtype", "")) or values.dtype.name
    return "str" if storage == "str" else "object"


def _summary(storage: str, values: h5py.Dataset | None, first: int, last: int) -> dict[str, Any]:
    """A site's entry of the manifest but its counts: iterations, dtype and record shape."""
    shape = [] if values is None or storage != "array" else list(values.shape[1:])
    return {
        "first_iteration": first,
        "last_iteration": last,
        "dtype": _dtype(storage, values),
        "shape": shape,
        "itemsize": values.dtype.itemsize if values is not None and storage == "array" else 0,
    }


def _from_file(group: h5py.Group, rows: int) -> dict[str, Any]:
    """The summary of a site an earlier session wrote (a file appended to), from its datasets."""
    ends = sorted({0, rows - 1})  # (h5py reads increasing rows)
    if TAGGED in group:
        column = group[TAGGED][ends, TAGS.index("iterations")]
    else:
        column = group["iterations"][ends]
    values = group.get("values")
    storage = "" if values is None else str(values.attrs.get("storage", ""))
    return _summary(storage, values, int(np.min(column)), int(np.max(column)))


class ManifestWriter:
    """The manifest of the shard a saver writes; inactive (writing nothing) for other files."""

    def __init__(self, path: Path | None = None, identity: dict[str, Any] | None = None) -> None:
        self.path = path
        self.identity = identity or {}
        self.sites: dict[str, dict[str, Any]] = {}  # site name -> its summary
        self.failed = False  # warned once about a manifest that could not be written

    @classmethod
    def start(cls, path: Path, handle: h5py.File, index: RootIndex) -> ManifestWriter:
        """The manifest of the file `path` just opened for writing (`handle`, `index`).

        A manifest left beside it by an earlier file of that name is removed first.
        """
        with contextlib.suppress(OSError):
            os.unlink(manifest_path(str(path)))
        if SHARD_ATTR not in handle.attrs:
            return cls()
        rank, world = (int(n) for n in np.asarray(handle.attrs[SHARD_ATTR]).reshape(-1)[:2])
        identity = {
            "file": path.name,
            "format": int(handle.attrs[FORMAT_ATTR]),
            "run_id": str(handle.attrs.get(RUN_ID_ATTR, "")),
            "shard": [rank, world],
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if NODE_RANKS_ATTR in handle.attrs:  # a node's shard: the global ranks it holds
            identity["node_ranks"] = [int(r) for r in np.asarray(handle.attrs[NODE_RANKS_ATTR])]
            identity["world_size"] = int(handle.attrs[WORLD_SIZE_ATTR])
        manifest = cls(path, identity)
        for link, slot in index.slots.items():  # the sites of earlier sessions
            if index.count(slot):
                manifest.sites[unescape(link)] = _from_file(index.vars[link], index.count(slot))
        return manifest

    def note(self, name: str, site: SiteWriter, trace: Trace) -> None:
        """Note the records of `trace` that `site` (site `name`) just appended."""
        if self.path is None:
            return
        iterations = int64(trace.iterations)
        held = self.sites.get(name)
        first, last = int(iterations.min()), int(iterations.max())
        if held is not None:
            first, last = min(first, held["first_iteration"]), max(last, held["last_iteration"])
        if held is None or held["dtype"] == "none" or held["shape"] != list(site.padded):
            self.sites[name] = _summary(site.storage, site.values, first, last)
        else:
            held.update(first_iteration=first, last_iteration=last)

    def content(self, index: RootIndex, closed: bool) -> dict[str, Any]:
        """The manifest of the file as `index` counts it now (see `manifest`)."""
        assert self.path is not None
        stat = os.stat(self.path)
        sites = []
        for link, slot in index.slots.items():
            rows = index.count(slot)
            name = unescape(link)
            if not rows or name not in self.sites:
                continue
            summary = dict(self.sites[name])
            itemsize = summary.pop("itemsize")
            wide = summary["dtype"] not in ("str", "object", "none")
            nbytes = rows * math.prod(summary["shape"]) * itemsize if wide else None
            first = int(index.rows[slot, FIRST_ORDER])
            head = {"name": name, "link": link, "slot": slot, "records": rows}
            sites.append({**head, "first_order": first, **summary, "bytes": nbytes})
        slots = {entry["name"]: entry["slot"] for entry in sites}
        aliases = [
            {
                "name": name,
                "link": escape(name),
                "slot": slot,
                "records": index.count(slot),
                "target": target,
                "target_slot": slots[target],
            }
            for name, (slot, target) in index.aliases.items()
            if index.count(slot) and target in slots
        ]
        total = sum(entry["records"] for entry in (*sites, *aliases))
        return {
            "vartrace_manifest": MANIFEST_VERSION,
            **self.identity,
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "open": not closed,
            "records": total,
            "sites": sites,
            "aliases": aliases,
        }

    def write(self, index: RootIndex | None, *, closed: bool = False) -> None:
        """Rewrite the manifest as of the flush (or the close) just done; a failure is a
        warning, once, never an exception."""
        if self.path is None or index is None or not self.path.exists():
            return
        try:
            write_manifest(str(self.path), self.content(index, closed))
        except (OSError, ValueError, TypeError, KeyError) as error:
            if not self.failed:
                self.failed = True
                warn(
                    f"vartrace: could not write the manifest of {self.path} ({error}); readers "
                    "open the shard itself instead, training goes on",
                    RuntimeWarning,
                )
