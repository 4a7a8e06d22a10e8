"""What a Dask task carries of a run: its files by location, never an open one.

An h5py handle does not pickle and is tied to its process; a task carries a
`RunFiles` (the paths or URLs of some of a run's files, whether pickled records
may be read, the fsspec options) and opens them where it runs (`opened`).
`file_bytes` and `byte_groups` size the tasks: one per file, or per
`TASK_BYTES` of it.

Example:
    ```python
    files = RunFiles.of(run)                 # None for in-memory results
    with opened(files.subset(files.paths[:1])) as shard:
        print(shard.names)
    ```
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from vartrace.storage.locations import Location, file_stats, is_url
from vartrace.storage.reader import Run

__all__ = ["TASK_BYTES", "RunFiles", "byte_groups", "file_bytes", "naming", "opened"]

#: The bytes of a file one task reads at most, roughly (one task per file below it).
TASK_BYTES = 256 << 20

#: Opening a part of a sharded run warns that the other ranks are missing; the warning
#: filter that silences it is process-wide, so the tasks of a threaded scheduler take turns
#: (h5py serialises its calls anyway).
_OPENING = threading.Lock()


class RunFiles(NamedTuple):
    """Some files of a run, by location, and how to open them."""

    paths: tuple[str, ...]
    allow_pickle: bool
    storage_options: dict[str, Any] | None

    @classmethod
    def of(cls, run: Any) -> RunFiles | None:
        """The files of an open run; `None` for a run not read from files."""
        if not isinstance(run, Run) or not run.paths:
            return None
        return cls(
            tuple(os.fspath(path) for path in run.paths), run.allow_pickle, run.storage_options
        )

    def subset(self, paths: Sequence[str]) -> RunFiles:
        """These files of the run, opened the same way."""
        return self._replace(paths=tuple(paths))

    def position(self, path: str) -> int:
        """Where `path` is among the run's files (the order its reader merges them in)."""
        return self.paths.index(path)


@contextlib.contextmanager
def opened(files: RunFiles | None) -> Iterator[Any]:
    """`files` opened as one run (`None` stays `None`), closed after the block.

    A part of a sharded run opens without the warning that the other ranks'
    shards are missing: the run they belong to was checked where it was opened.
    """
    if files is None:
        yield None
        return
    from vartrace.storage.reader import open_run

    options = {} if files.storage_options is None else {"storage_options": files.storage_options}
    with _OPENING, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "vartrace: the shards of rank", RuntimeWarning)
        run = open_run(list(files.paths), allow_pickle=files.allow_pickle, **options)
    with run:
        yield run


@contextlib.contextmanager
def naming(*files: RunFiles | None) -> Iterator[None]:
    """Errors raised in the block name the files the task read (where they do not
    already), so an error coming back from a worker says which shard it met."""
    try:
        yield
    except Exception as error:
        paths = [path for found in files if found is not None for path in found.paths]
        if any(path in str(error) for path in paths):
            raise
        try:
            named = type(error)(f"{error} (reading {', '.join(paths)})")
        except Exception:  # an exception that takes other arguments: as it is
            raise error from None
        raise named from error


def file_bytes(path: str, storage_options: dict[str, Any] | None = None) -> int:
    """The size of a run file (a local path or an fsspec URL); 0 when it cannot be told."""
    location: Location = path if is_url(path) else Path(path)
    size, _ = file_stats([location], storage_options or {})[0]
    return size or 0
    try:
        import fsspec

        filesystem, location = fsspec.core.url_to_fs(path, **(storage_options or {}))
        return int(filesystem.size(location) or 0)
    except Exception:  # no fsspec, an unreachable store: the file is one task
        return 0


def byte_groups(nbytes: int, limit: int) -> int:
    """How many tasks share `nbytes`: one per `TASK_BYTES`, at least 1, at most `limit`."""
    return max(1, min(limit, math.ceil(nbytes / TASK_BYTES)))
