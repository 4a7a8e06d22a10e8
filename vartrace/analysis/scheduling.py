"""Where the analysis runs: `scheduler=` resolved to Dask, and a list of calls run there.

`scheduler=None` (the default everywhere) keeps the work in this process and
imports no Dask.  Anything else needs the `dask` extra (`pip install
'torch-vartrace[dask]'`), imported only then:

- `"threads"`, `"processes"`, `"sync"`: Dask's local schedulers;
- a `distributed.Client`: its cluster (a `LocalCluster`, SLURM, Kubernetes...);
- an address (`"tcp://host:8786"`, `"tls://..."`): a Client connected for the
  call and closed after it.

vartrace writes no scheduler of its own: calls become `dask.delayed` tasks
computed by `dask.compute` (or the Client's `compute`, for a progress bar),
and a lost worker's tasks are retried by `distributed`.  A call carries what
it needs by value (paths, never open files: see `vartrace.analysis.tasks`).

Example:
    ```python
    with scheduler_of("tcp://10.0.0.5:8786") as engine:
        results = run_calls(engine, [(len, ("abc",)), (len, ("de",))])   # [3, 2]
    ```
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["ADDRESS_SCHEMES", "as_delayed", "dask_module", "run_calls", "scheduler_of"]

#: The schemes of a scheduler's address: a string starting with one is an address.
ADDRESS_SCHEMES = ("tcp://", "tls://", "inproc://", "ucx://", "ws://", "wss://")
#: Dask's local schedulers, by the names `dask.compute` takes.
_LOCAL = ("threads", "processes", "sync", "synchronous", "single-threaded")
_HINT = "pip install 'torch-vartrace[dask]'"

#: One call of a task: a function and its arguments (all picklable, no open file).
Call = tuple[Callable[..., Any], tuple[Any, ...]]


def dask_module(name: str, what: str) -> Any:
    """Import `name` (`dask`, `distributed`, `dask.array`...), or say how to install it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{what} needs Dask ({name} is not installed): {_HINT}") from exc


@contextlib.contextmanager
def scheduler_of(scheduler: Any, what: str = "scheduler=") -> Iterator[Any]:
    """What `dask.compute` takes for `scheduler`: a local scheduler's name or a Client.

    An address connects a Client for the duration of the `with` block.  Anything
    else is a `ValueError` saying what is accepted.
    """
    if isinstance(scheduler, str) and scheduler.startswith(ADDRESS_SCHEMES):
        distributed = dask_module("distributed", what)
        with distributed.Client(scheduler, set_as_default=False) as client:
            yield client
        return
    if isinstance(scheduler, str):
        if scheduler not in _LOCAL:
            raise ValueError(
                f"{what} {scheduler!r} is neither a Dask scheduler ({', '.join(_LOCAL[:3])}) "
                f"nor an address ({ADDRESS_SCHEMES[0]}host:port)"
            )
        dask_module("dask", what)
        yield scheduler
        return
    if _is_client(scheduler):
        yield scheduler
        return
    raise TypeError(
        f"{what} takes None, 'threads', 'processes', a distributed.Client or an address "
        f"('tcp://host:8786'), not {type(scheduler).__name__}"
    )


def _is_client(scheduler: Any) -> bool:
    distributed = sys.modules.get("distributed")
    return distributed is not None and isinstance(scheduler, distributed.Client)


def as_delayed(calls: Sequence[Call]) -> list[Any]:
    """The calls as `dask.delayed` objects: the graph a scheduler runs."""
    dask = dask_module("dask", "scheduler=")
    return [dask.delayed(function, pure=False)(*args) for function, args in calls]


def run_calls(
    engine: Any, calls: Sequence[Call], *, progress: bool = False, desc: str = "tasks"
) -> list[Any]:
    """The results of `calls`, in their order, computed by `engine` (from `scheduler_of`).

    The first failed call's exception is raised here, as the worker raised it.
    `progress` shows a tqdm bar of finished tasks on stderr (with a Client).
    """
    graph = as_delayed(calls)
    if not graph:
        return []
    if not _is_client(engine):
        dask = dask_module("dask", "scheduler=")
        return list(dask.compute(*graph, scheduler=engine))
    from distributed import as_completed

    from vartrace._support.progress import progress_bar

    futures = engine.compute(graph)
    try:
        with progress_bar(show=progress, total=len(futures), desc=desc, unit="task") as bar:
            for _ in as_completed(futures, loop=engine.loop):
                bar.update(1)
        return list(engine.gather(futures))
    finally:
        for future in futures:
            future.release()
