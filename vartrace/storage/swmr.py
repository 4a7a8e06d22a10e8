"""Opening a file in SWMR mode with HDF5's metadata retries bounded.

A reader in SWMR mode takes a piece of metadata whose checksum fails for one the
writer is rewriting, and reads it again, sleeping 1 ns, 2 ns, 4 ns, ... between
attempts: with HDF5's default of 100 attempts that is 2**100 ns, for ever, on a file
a killed writer left damaged (a SIGKILL mid-flush) or one damaged later. h5py does
not expose `H5Pset_metadata_read_attempts`, so it is called through ctypes on the
HDF5 library h5py itself runs on (found among the process's loaded libraries, or
in h5py's own folder on platforms without `/proc`).

A file this process has open in SWMR mode already is opened again through another
driver, so that the new handle sees the writer's last flush (see `open_swmr`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import h5py

from vartrace._support.warnings import warn

#: Read attempts per piece of metadata: up to 2**READ_ATTEMPTS ns (about 1 s) spent on
#: one a live writer is rewriting, which takes it microseconds.
READ_ATTEMPTS = 30


def _candidates() -> list[Path]:
    """Paths of the HDF5 library h5py may run on, the loaded one first where known."""
    loaded: list[Path] = []
    try:
        with open("/proc/self/maps") as maps:
            loaded = [Path(line.split(maxsplit=5)[-1].strip()) for line in maps if "hdf5" in line]
    except OSError:
        pass
    package = Path(h5py.__file__).parent
    bundled = [*package.glob("*hdf5*"), *package.glob(".dylibs/*hdf5*")]
    bundled += package.parent.glob("h5py.libs/*hdf5*")
    return list(dict.fromkeys(loaded + bundled))


@functools.cache
def _set_read_attempts() -> Callable[[int, int], int] | None:
    """`H5Pset_metadata_read_attempts` of h5py's HDF5 library, or None if not found."""
    wanted = tuple(int(n) for n in h5py.version.hdf5_version_tuple[:3])
    for path in _candidates():
        if "hdf5_hl" in path.name or "hdf5" not in path.name:
            continue
        try:
            library = ctypes.CDLL(str(path))
            setter = library.H5Pset_metadata_read_attempts
            version = [ctypes.c_uint() for _ in range(3)]
            library.H5get_libversion(*(ctypes.byref(n) for n in version))
        except (OSError, AttributeError):
            continue
        if tuple(n.value for n in version) == wanted:
            setter.argtypes = [ctypes.c_int64, ctypes.c_uint]
            setter.restype = ctypes.c_int
            return setter
    return None


def open_swmr(path: Path) -> h5py.File:
    """`path` opened read-only in SWMR mode, each piece of metadata read at most
    `READ_ATTEMPTS` times (`OSError` as h5py raises it, where it cannot open).

    Where HDF5's library cannot be reached, the file is opened with HDF5's own
    retries, and a warning says a damaged file may then hang the read.
    """
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    setter = _set_read_attempts()
    if setter is None or setter(fapl.id, READ_ATTEMPTS) < 0:
        warn(  # never raises: the saver opens files this way inside a step
            f"vartrace cannot bound HDF5's metadata retries here (h5py's HDF5 library was "
            f"not found): reading {path} in SWMR mode hangs if a piece of it is damaged",
            RuntimeWarning,
            stacklevel=3,
        )
    flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
    fid = h5py.h5f.open(bytes(path), flags, fapl=fapl)
    if h5py.h5f.get_obj_count(fid, h5py.h5f.OBJ_FILE) > 1:
        # HDF5 shares one open file between the handles of a process that open it
        # through the same driver, metadata cache and open objects included: a live run
        # reopened beside an earlier handle (a notebook's `run`) would be shown the
        # extents and chunk indexes the earlier one read, beside a newer `/committed`.
        # The log driver (sec2's reads, here logging nothing) is not shared with sec2's
        # handles: the reopened run sees the writer's last flush.
        fid.close()
        fapl.set_fapl_log(os.devnull.encode(), 0, 0)
        fid = h5py.h5f.open(bytes(path), flags, fapl=fapl)
    return h5py.File(fid)
