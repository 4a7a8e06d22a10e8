"""Where a run's files are: the paths, globs, directories and URLs `vartrace.open` accepts,
resolved into one location a file; their sizes, their manifests' bytes, and their bytes
opened for h5py.

Example:
    ```python
    resolve(["nodes/0", "nodes/1/run.rank*.h5"], {})   # [Path(...rank0.h5), Path(...rank1.h5)]
    resolve("s3://bucket/run/", {"anon": True})        # ["s3://bucket/run/run.rank0.h5", ...]
    ```

A local location is a `Path`; a URL (`s3://`, `gs://`, `memory://`: any text with
`://`) is kept as text and read through fsspec, which is imported only then
(`pip install 'torch-vartrace[remote]'`).  Remote files are read-only, through
fsspec's block cache (`REMOTE_CACHE`).
"""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "REMOTE_CACHE",
    "Location",
    "file_stats",
    "is_url",
    "open_remote",
    "read_small_files",
    "resolve",
]

#: A file's location: a local path, or a URL read through fsspec.
Location = Path | str

#: How fsspec reads remote files for h5py: blocks of this many bytes, each fetched once and
#: kept (HDF5 reads small pieces of metadata all over a file, then whole chunks).  Measured
#: on an in-memory filesystem that counts its range requests (20 shards of 450 KiB, open,
#: list and `to_frame`, 64 KiB blocks): "blockcache" fetched each byte once in 160
#: requests; "readahead" and "bytes" made 1,600-1,660 and fetched 11x the bytes; "first"
#: 2,660 and no cache 4,840.  (`memory://` itself ignores the cache: its files are buffers.)
REMOTE_CACHE: dict[str, Any] = {"cache_type": "blockcache", "block_size": 4 << 20}

#: The most bytes `read_small_files` reads of one file.
_SMALL_BYTES = 256 << 20


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether `text` names a file through fsspec (`s3://...`) rather than a local path."""
    return isinstance(text, str) and "://" in text


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """(fsspec filesystem, path on it) of `url`."""
    try:
        import fsspec.core  # type: ignore[import-untyped]
    except ImportError as exc:
        hint = "pip install 'torch-vartrace[remote]'"
        raise ImportError(f"reading {url} needs fsspec: {hint}") from exc
    return fsspec.core.url_to_fs(url, **options)


def _remote(item: str, options: dict[str, Any], alone: bool) -> list[Location]:
    fs, path = _filesystem(item, options)
    if fs.isdir(path):
        found = sorted(fs.glob(path.rstrip("/") + "/*.h5"))
    elif glob.has_magic(path) and not fs.exists(path):
        found = sorted(fs.glob(path))
    else:
        return [item]
    if not found and alone:
        raise FileNotFoundError(errno.ENOENT, "no run file matches", item)
    return [fs.unstrip_protocol(name) for name in found]


def _local(item: str | os.PathLike[str], alone: bool) -> list[Location]:
    text = os.fspath(item)
    if os.path.isdir(text):
        found = sorted(glob.glob(os.path.join(glob.escape(text), "*.h5")))
        if not found and alone:
            return [Path(text)]  # (opening it says it is a directory, not a run file)
    elif not os.path.exists(text) and glob.has_magic(text):
        found = sorted(glob.glob(text))
        if not found and alone:
            raise FileNotFoundError(errno.ENOENT, "no file matches the pattern", text)
    else:
        return [Path(text)]
    return [Path(name) for name in found]


def resolve(
    spec: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], options: dict[str, Any]
) -> list[Location]:
    """The files `spec` names, in order, each once: a path or URL, a glob, a directory (its
    `*.h5` files), or a list of any of these.

    A path that does not exist is kept (opening it says so), and so is a directory without
    `*.h5` files given alone.  A glob that names no file is a `FileNotFoundError` alone;
    in a list such a glob or directory is skipped (its shards are missing ranks), unless
    nothing in the list names a file.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise ValueError("open_run needs at least one path")
    found: dict[str, Location] = {}
    for item in items:
        alone = len(items) == 1
        located = _remote(item, options, alone) if isinstance(item, str) and is_url(item) else None
        for location in located if located is not None else _local(item, alone):
            found.setdefault(os.fspath(location), location)
    if not found:
        names = ", ".join(os.fspath(item) for item in items)
        raise FileNotFoundError(errno.ENOENT, "no run file matches any of", names)
    return list(found.values())


def file_stats(
    locations: Sequence[Location], options: dict[str, Any]
) -> list[tuple[int | None, int | None]]:
    """(size, modification time in ns) of each file; `None` where not known (a missing file;
    the time of a remote one, which its upload set).  A remote folder is listed once."""
    stats: list[tuple[int | None, int | None]] = []
    listed: dict[str, dict[str, int]] = {}
    for location in locations:
        if isinstance(location, Path):
            try:
                stat = location.stat()
            except OSError:
                stats.append((None, None))
            else:
                stats.append((stat.st_size, stat.st_mtime_ns))
            continue
        fs, path = _filesystem(location, options)
        path = fs._strip_protocol(path)
        parent = fs._parent(path)
        key = f"{fs.protocol}|{parent}"
        if key not in listed:
            try:
                entries = fs.ls(parent, detail=True)
            except OSError:
                entries = []
            listed[key] = {
                fs._strip_protocol(entry["name"]): entry.get("size")
                for entry in entries
                if entry.get("type") == "file"
            }
        size = listed[key].get(path)
        stats.append((size if isinstance(size, int) else None, None))
    return stats


def read_small_files(paths: Sequence[Location], options: dict[str, Any]) -> list[bytes | None]:
    """The bytes of each of `paths` (manifests), `None` for a missing or unreadable one;
    remote ones fetched together (fsspec's `cat`)."""
    out: list[bytes | None] = [None] * len(paths)
    remote: dict[str, int] = {}
    for position, path in enumerate(paths):
        if not isinstance(path, Path):
            remote[path] = position
            continue
        try:
            with open(path, "rb") as handle:
                out[position] = handle.read(_SMALL_BYTES + 1)
        except OSError:
            continue
    if remote:
        fs, _ = _filesystem(next(iter(remote)), options)
        try:
            found = fs.cat(list(remote), on_error="omit")
        except OSError:
            found = {}
        # fsspec names what it fetched by its own spelling (`memory://a/b` comes back `/a/b`)
        at = {fs._strip_protocol(url): position for url, position in remote.items()}
        for name, data in found.items():
            position = at.get(fs._strip_protocol(name), -1)
            if position >= 0 and isinstance(data, bytes):
                out[position] = data
    return out


def open_remote(url: str, options: dict[str, Any]) -> Any:
    """A read-only file object of the remote file `url`, for `h5py.File`."""
    fs, path = _filesystem(url, options)
    if not fs.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no such run file", url)
    return fs.open(path, "rb", **REMOTE_CACHE)
