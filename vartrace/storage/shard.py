"""One file of a run as the reader holds it: planned from its manifest (its HDF5 file opened
only when its records are read) or opened at once, local or remote.

Example:
    ```python
    manifests = planned(paths, options)        # a manifest a file, None where not trusted
    shards = [Shard(path, options, manifest) for path, manifest in zip(paths, manifests)]
    shards[0].identity                         # (run id, (rank, world size)), file unopened
    shards[0].vars                             # opens the file, checked against its manifest
    ```

A manifest (see `manifest`) is trusted when the file still has the size (and, on a local
disk, the modification time) it records; when the file is opened later its run id, shard
attribute, format and record counts are checked against it, so a file rewritten since the
run was opened is an error naming it, never a read of other records.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vartrace._support.warnings import warn
from vartrace.errors import ManifestError
from vartrace.storage.files import checked_version, open_file
from vartrace.storage.guard import RunFileError, check_read, child
from vartrace.storage.layout import (
    COMMITTED,
    FORMAT_ATTR,
    FORMAT_VERSION,
    NO_TARGET,
    NODE_RANKS_ATTR,
    RUN_ID_ATTR,
    SHARD_ATTR,
    WORLD_SIZE_ATTR,
    has_write_flags,
    write_flags_in,
    writer_alive,
)
from vartrace.storage.locations import Location, file_stats, open_remote, read_small_files
from vartrace.storage.manifest import Manifest, manifest_path, parse_manifest

__all__ = ["Shard", "close_shards", "planned"]


def planned(
    locations: Sequence[Location], options: dict[str, Any], *, stacklevel: int = 1
) -> list[Manifest | None]:
    """The manifest of each file that a reader may plan from; `None` for a file without
    one, or whose manifest does not describe it (the file changed since, or the manifest is
    of a newer format).  Damaged manifests are warned about once, all together."""
    texts = read_small_files([_manifest_location(loc) for loc in locations], options)
    stats = file_stats(locations, options) if any(text is not None for text in texts) else []
    found: list[Manifest | None] = []
    damaged: list[str] = []
    for position, (location, text) in enumerate(zip(locations, texts, strict=True)):
        manifest = None
        if text is not None:
            try:
                manifest = parse_manifest(text)
            except ManifestError as error:
                damaged.append(f"{_manifest_location(location)}: {error}")
        if manifest is not None and (
            manifest.format > FORMAT_VERSION or not manifest.matches(*stats[position])
        ):
            manifest = None
        found.append(manifest)
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        warn(
            f"vartrace: ignoring a damaged manifest, {damaged[0]}{more}; reading its shard's "
            "file instead",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
    return found


def _rank_world(shard: Any) -> tuple[int, int]:
    """(rank, world size) of a file's `shard` attribute."""
    rank, world = (int(n) for n in np.asarray(shard).reshape(-1)[:2])
    return rank, world


def _manifest_location(location: Location) -> Location:
    text = manifest_path(os.fspath(location))
    return Path(text) if isinstance(location, Path) else text


class Shard:
    """One file of a run: `manifest` when planned from it, else the file is opened at once."""

    def __init__(
        self, location: Location, options: dict[str, Any], manifest: Manifest | None = None
    ) -> None:
        self.location = location
        self.manifest = manifest
        self._options = options
        self._handle: h5py.File | None = None
        self._remote: Any = None  # the fsspec file object under a remote file's handle
        self._lock = threading.Lock()  # (compare reads the sites of a run from several threads)
        if manifest is None:
            self._open()

    def _open(self) -> h5py.File:
        if self._handle is not None:
            return self._handle
        with self._lock:
            if self._handle is None:
                self._handle = self._opened()
            return self._handle

    def _opened(self) -> h5py.File:
        """The file opened, checked against its manifest."""
        if isinstance(self.location, Path):
            handle = open_file(self.location)
        else:
            self._remote = open_remote(self.location, self._options)
            try:
                handle = checked_version(h5py.File(self._remote, "r"), self.location)
            except BaseException:
                self._remote.close()
                self._remote = None
                raise
        try:
            if self.manifest is not None:
                self._check(handle, self.manifest)
        except BaseException:
            handle.close()
            if self._remote is not None:
                self._remote.close()
                self._remote = None
            raise
        return handle

    @property
    def handle(self) -> h5py.File:
        """The open file (opened now if planned from its manifest)."""
        return self._open()

    @cached_property
    def vars(self) -> h5py.Group:
        """The file's `/vars` group, where its sites are."""
        return child(self.handle, "vars", h5py.Group)

    @property
    def opened(self) -> bool:
        return self._handle is not None

    @property
    def identity(self) -> tuple[str | None, tuple[int, int] | None]:
        """(run id or None when the file has none, (rank, world size) or None when no shard)."""
        if self.manifest is not None:
            return self.manifest.run_id, self.manifest.shard
        attrs = self.handle.attrs
        shard = attrs.get(SHARD_ATTR)
        run_id = attrs.get(RUN_ID_ATTR)
        if shard is None:
            return None if run_id is None else str(run_id), None
        return str("" if run_id is None else run_id), _rank_world(shard)

    @property
    def node_ranks(self) -> tuple[tuple[int, ...], int] | None:
        """A node's shard (`gather="node"`): (the global ranks it holds, the run's world
        size); `None` for any other file."""
        if self.manifest is not None:
            return self.manifest.node_ranks
        attrs = self.handle.attrs
        if NODE_RANKS_ATTR not in attrs or WORLD_SIZE_ATTR not in attrs:
            return None
        ranks = tuple(int(r) for r in np.asarray(attrs[NODE_RANKS_ATTR]).reshape(-1))
        return ranks, int(attrs[WORLD_SIZE_ATTR])

    @property
    def live(self) -> bool:
        """Whether the process writing the file may still run (see `Run.live`)."""
        if self.manifest is not None and not self.opened:
            manifest = self.manifest
            return manifest.open and writer_alive(manifest.host, manifest.pid) is not False
        handle = self.handle
        if not handle.swmr_mode and not self._held_for_writing():
            return False
        host, pid = handle.attrs.get("writer_host", ""), handle.attrs.get("writer_pid", 0)
        if not isinstance(host, str) or not isinstance(pid, (int, np.integer)) or pid <= 0:
            return False
        return writer_alive(host, int(pid)) is not False

    def _held_for_writing(self) -> bool:
        """Whether the file's superblock says a writer holds it (or was killed holding it):
        a remote file, which h5py reads without SWMR mode, may be a running writer's."""
        if isinstance(self.location, Path):
            return has_write_flags(self.location)
        with open_remote(self.location, self._options) as remote:
            return write_flags_in(remote.read(12))

    def _check(self, handle: h5py.File, manifest: Manifest) -> None:
        """Refuse a file that no longer holds what its manifest says (rewritten since)."""
        committed = child(handle, COMMITTED, h5py.Dataset)
        check_read(committed, committed.size)
        counts = np.asarray(committed[()], np.int64).reshape(-1)
        sites = [slot for slot, _, _, target in manifest.indexed if target == NO_TARGET]
        short = [
            slot for slot in sites if slot >= len(counts) or counts[slot] < manifest.counts[slot]
        ]
        shard = handle.attrs.get(SHARD_ATTR)
        same = (
            not short
            and int(handle.attrs.get(FORMAT_ATTR, -1)) == manifest.format
            and str(handle.attrs.get(RUN_ID_ATTR, "")) == manifest.run_id
            and (None if shard is None else _rank_world(shard)) == manifest.shard
        )
        if not same:
            raise RunFileError(
                f"{self.location} no longer holds what its manifest "
                f"{manifest_path(os.fspath(self.location))} said when the run was opened (the "
                "file was rewritten since): open the run again"
            )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        self.__dict__.pop("vars", None)


#: The h5py internals `close_shards` uses to close files together (checked on h5py 3.16;
#: without them each file closes on its own: the same result, slower).
_CLOSES_TOGETHER = hasattr(h5py._objects, "nonlocal_close") and hasattr(
    h5py.h5f.FileID, "_close_open_objects"
)


def close_shards(shards: Sequence[Shard]) -> None:
    """Close `shards` together, as h5py's `File.close` closes one, less its sweep per file.

    `File.close` closes the file's objects, then the file, then looks through every h5py
    identifier alive in the process for the ones that died (`nonlocal_close`): closing N
    files one by one, each with its datasets open, makes N passes over all of them, minutes
    for 1,000 shards.  Here the objects of each file (those opened through it: the same
    file opened by another `Run` keeps its own) and the files are closed as h5py closes
    them, and the dead identifiers are looked for once.
    """
    for shard in shards:  # its groups released: HDF5 goes over the objects still open
        shard.__dict__.pop("vars", None)
    handles = [s._handle for s in shards if s._handle is not None and s._handle.id.valid]
    if len(handles) > 1 and _CLOSES_TOGETHER:
        with h5py._objects.phil:
            for handle in handles:
                handle.id._close_open_objects(h5py.h5f.OBJ_LOCAL | ~h5py.h5f.OBJ_FILE)
            for handle in handles:
                handle.id._close_open_objects(h5py.h5f.OBJ_LOCAL | h5py.h5f.OBJ_FILE)
            h5py._objects.nonlocal_close()
    for shard in shards:
        shard.close()  # (its remote file object; the file is closed)
