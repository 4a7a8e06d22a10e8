"""A run's table of records computed by Dask tasks, a task per file (per 256 MB of one).

`frame_on` is `run.to_frame(..., scheduler=...)`: each task opens one file
of the run by path, takes the frame of the sites it holds (blocks of records
reduced at once, as in process), and the driver joins the pieces in the
order of the in-process frame: site by site in the run's order, a site's rows
merged across files by (iteration, rank, capture order), in file order where
one file holds them.  `dask_frame` is `run.to_dask_frame(stat)`: a dask
DataFrame, one partition per file, for tables that do not fit in memory.

Example:
    ```python
    frame = frame_on(run, "absmax", None, scheduler="tcp://10.0.0.5:8786")
    lazy = dask_frame(run, ["mean", "absmax"])       # one partition per shard
    lazy.groupby("site")["absmax"].max().compute()
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vartrace.analysis.scheduling import dask_module, run_calls, scheduler_of
from vartrace.analysis.sources.frames import Stat, records_frame
from vartrace.analysis.tasks import RunFiles, byte_groups, file_bytes, naming, opened

__all__ = ["dask_frame", "frame_on", "frame_task"]


class _FrameTask(NamedTuple):
    """One task: the frame of some sites (by the names that stored them) of some files."""

    files: RunFiles
    stored: tuple[str, ...]
    stat: Any


def frame_task(task: _FrameTask) -> Any:
    """Run one task where it is scheduled: the frame of its sites its files hold."""
    with naming(task.files), opened(task.files) as run:
        held = [name for name in task.stored if name in run and name not in run.aliases]
        return run.to_frame(task.stat, names=held) if held else None


def _plan(run: Any, names: Sequence[str] | None, stat: Any) -> tuple[list[str], list[Any]]:
    """The site names of the frame (each checked: a missing one raises as `run[name]`
    does) and the calls computing them, a task per file or per `TASK_BYTES` of it."""
    wanted = list(run.names if names is None else names)
    for name in wanted:
        if name not in run:
            run[name]  # raises the reader's KeyError, naming the closest sites
    files = RunFiles.of(run)
    if files is None:
        raise TypeError(f"{type(run).__name__} is not read from files: use to_frame()")
    stored = list(dict.fromkeys(run.aliases.get(name, name) for name in wanted))
    calls = []
    for path in files.paths:
        groups = byte_groups(file_bytes(path, files.storage_options), len(stored))
        for group in range(groups):
            task = _FrameTask(files.subset([path]), tuple(stored[group::groups]), stat)
            calls.append((frame_task, (task,)))
    return wanted, calls


def _site_rows(pieces: list[Any], name: str) -> Any:
    """One site's rows from the files holding it, merged as the run merges them."""
    import pandas as pd

    rows = pieces[0] if len(pieces) == 1 else pd.concat(pieces, ignore_index=True)
    if len(pieces) > 1:
        order = np.lexsort((rows["order"], rows["rank"], rows["iteration"]))
        rows = rows.iloc[order]
    return rows.assign(site=name)


def frame_on(
    run: Any, stat: Stat | Sequence[str], names: Sequence[str] | None, scheduler: Any
) -> Any:
    """`run.to_frame(stat, names)` computed on `scheduler`: the same frame."""
    import pandas as pd

    empty = records_frame(iter(()), stat, caller="Run.to_frame()")  # checks `stat`
    wanted, calls = _plan(run, names, stat)
    with scheduler_of(scheduler, "to_frame(scheduler=)") as engine:
        frames = run_calls(engine, calls, desc="to_frame")
    by_site: dict[str, list[Any]] = {}
    for frame in frames:
        if frame is not None:
            for name, rows in frame.groupby("site", sort=False):
                by_site.setdefault(str(name), []).append(rows)
    pieces = [
        _site_rows(by_site[stored], name)
        for name in wanted
        if (stored := run.aliases.get(name, name)) in by_site
    ]
    return pd.concat(pieces, ignore_index=True) if pieces else empty


def _partition(task: _FrameTask, names: tuple[str, ...], aliases: dict[str, str]) -> Any:
    """One partition of `dask_frame`: the rows of the sites `names` one file holds."""
    import pandas as pd

    frame = frame_task(task)
    if frame is None:
        return _meta(task.stat)
    pieces = [
        frame[frame["site"] == aliases.get(name, name)].assign(site=name)
        for name in names
        if aliases.get(name, name) in task.stored
    ]
    return pd.concat(pieces, ignore_index=True)


def _meta(stat: Any) -> Any:
    """An empty frame with the columns and dtypes of a frame of records."""
    import pandas as pd

    empty = records_frame(iter(()), stat, caller="Run.to_dask_frame()")
    text = pd.Series(["text"]).dtype
    return empty.astype(
        {
            "site": text,
            "dtype": text,
            **{column: np.float64 for column in empty.columns[6:] if not callable(stat)},
        }
    )


def dask_frame(run: Any, stat: Stat | Sequence[str], names: Sequence[str] | None = None) -> Any:
    """`run.to_dask_frame(stat)`: a dask DataFrame of the run's records, one partition per
    file (its rows of every site, sites in the run's order, each in file order)."""
    dd = dask_module("dask.dataframe", "Run.to_dask_frame()")
    wanted, _ = _plan(run, names, stat)
    files = RunFiles.of(run)
    assert files is not None  # (checked by _plan)
    stored = tuple(dict.fromkeys(run.aliases.get(name, name) for name in wanted))
    tasks = [_FrameTask(files.subset([path]), stored, stat) for path in files.paths]
    return dd.from_map(
        _partition,
        tasks,
        args=(tuple(wanted), dict(run.aliases)),
        meta=_meta(stat),
        enforce_metadata=False,
    )
