"""TensorBoard: each site's statistics (scalars) and histograms, per iteration.

`TensorBoardCallback` is a post-gather callback that writes while the run goes
(TensorBoard shows it live); `export_run` (`vartrace tensorboard RUN --logdir DIR`)
writes a finished run's file the same way.  Scalars are the statistics
`vartrace.statistics.named.STATS` defines (`mean`, `std`, `min`, `max`,
`absmax` over the finite values; `nan`, `posinf`, `neginf` count the values left
out), tagged `<site>/<statistic>`; a histogram of the finite values is tagged
`<site>`.  A scalar record (a 0-d tensor such as a loss, or a number) is one series,
its value, tagged `<site>`.  The step is the record's iteration.  A statistics-mode record
(`vartrace.stats`) is written as the statistics it holds.  With several ranks, tags
end in `/rank<r>`.  Records that are not numeric (strings, None, objects) are skipped.

Needs TensorBoard: `pip install 'torch-vartrace[tensorboard]'`.

Example:
    ```python
    from vartrace import H5PYSaverCallback, ModelTracer, TensorBoardCallback

    with (
        TensorBoardCallback("runs/attn") as board,
        H5PYSaverCallback("attn.h5") as saver,
        ModelTracer(model, ["layers.*.attn.forward.scores"],
                    post_gather_callbacks=[board, saver]),   # board first: the saver empties
    ):
        train(model)
    # tensorboard --logdir runs
    ```
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vartrace._support.progress import progress_bar
from vartrace.statistics.named import STATS, reduce_block, value_as_array
from vartrace.trace import RunContext, Trace

if TYPE_CHECKING:
    from vartrace.storage.reader import Run

__all__ = ["DEFAULT_STATS", "TensorBoardCallback", "export_run"]

#: The statistics written as scalars unless ``stats=`` says otherwise.
DEFAULT_STATS = ("mean", "std", "min", "max", "absmax", "nan", "posinf", "neginf")

_HINT = "pip install 'torch-vartrace[tensorboard]'"


def _summary_writer() -> Any:
    """torch's `SummaryWriter` class, or `ImportError` naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"TensorBoard output needs the tensorboard package: {_HINT}") from exc
    return SummaryWriter


def _magnitudes(value: Any) -> np.ndarray | None:
    """The record as a float64 array of its shape (complex values by magnitude), or `None`."""
    array = value_as_array(value)
    if array is None:
        return None
    if array.dtype.kind == "c":
        array = np.abs(array)
    return np.asarray(array, dtype=np.float64)


class TensorBoardCallback:
    """A post-gather callback writing each record's statistics and histogram to TensorBoard
    (a scalar record: its value).

    Put it before an `H5PYSaverCallback` in `post_gather_callbacks`: the saver
    empties each chunk it writes.  It leaves the chunk as it is.  The event file is
    created at the first record (on rank 0 only, where post-gather callbacks run), and
    flushed after each gather, so TensorBoard follows the run.

    Example:
        ```python
        board = TensorBoardCallback("runs/exp1", stats=("mean", "absmax"))
        with ModelTracer(model, ["**.scores"], post_gather_callbacks=[board]):
            train(model)
        board.close()
        ```

    Args:
        logdir: the folder of the event files (`tensorboard --logdir` its parent to
            compare runs).
        stats: statistic names of `vartrace.statistics.named.STATS` written as
            scalars (for records with at least one dimension: a scalar record is written
            as its value).
        histograms: also write a histogram of each record's finite values (it reads
            every element: turn it off for very large records).
        per_rank: tag by rank (`<tag>/rank<r>`); `None`: when the run has more
            than one rank.
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        stats: Sequence[str] = DEFAULT_STATS,
        histograms: bool = True,
        per_rank: bool | None = None,
    ) -> None:
        unknown = [name for name in stats if name not in STATS]
        if unknown:
            raise ValueError(f"unknown statistic(s) {unknown}; choose from {', '.join(STATS)}")
        self._summary_writer = _summary_writer()  # fails here, not at the first gather
        self.logdir = Path(logdir)
        self.stats = tuple(stats)
        self.histograms = histograms
        self.per_rank = per_rank
        self._writer: Any = None
        self._lock = threading.Lock()  # gathers may run on the tracer's staging thread

    def on_start(self, context: RunContext) -> None:
        """Called by the tracer before the first record: learns the number of ranks."""
        if self.per_rank is None:
            self.per_rank = context.world_size > 1

    def __call__(self, name: str, trace: Trace) -> None:
        """Write the statistics and histogram of every record of `trace` (left as is)."""
        for value, iteration, rank in zip(
            trace.records(), trace.iterations, trace.ranks, strict=True
        ):
            self.write(name, value, int(iteration), int(rank))

    def write(self, name: str, value: Any, iteration: int, rank: int = 0) -> bool:
        """Write one record of site `name` at step `iteration`; `False` if it is not
        numeric (nothing written).  A 0-d record or a number is written as its value,
        tagged `name`.

        Example: `board.write("forward.x", torch.ones(3), iteration=1)`.
        """
        statistics = _as_statistics(value)
        array = None if statistics is not None else _magnitudes(value)
        flat = None if array is None or array.ndim == 0 else array.reshape(-1)
        if statistics is not None:
            scalars = {f"{name}/{stat}": statistics.statistic(stat) for stat in self.stats}
        elif flat is not None:
            row = flat[None, :]
            scalars = {
                f"{name}/{stat}": float(reduce_block(STATS[stat], row)[0]) for stat in self.stats
            }
        elif array is not None:  # a 0-d tensor or a number (a loss): the series itself
            scalars = {name: float(array)}
        else:
            return False
        suffix = f"/rank{rank}" if self.per_rank else ""
        with self._lock:
            writer = self._open()
            for tag, number in scalars.items():
                writer.add_scalar(f"{tag}{suffix}", number, iteration)
            if self.histograms and flat is not None:
                finite = flat[np.isfinite(flat)]
                if finite.size:
                    writer.add_histogram(f"{name}{suffix}", finite, iteration)
        return True

    def _open(self) -> Any:
        if self._writer is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self._writer = self._summary_writer(log_dir=str(self.logdir))
        return self._writer

    def flush(self) -> None:
        """Write what is buffered to the event file (the tracer calls it after each gather)."""
        with self._lock:
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file.  Safe to call twice."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> TensorBoardCallback:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _as_statistics(value: Any) -> Any:
    from vartrace.statistics.records import as_statistics

    return as_statistics(value)


def export_run(
    run: Run | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    logdir: str | os.PathLike[str],
    *,
    names: Iterable[str] | None = None,
    stats: Sequence[str] = DEFAULT_STATS,
    histograms: bool = True,
    progress: bool = False,
) -> int:
    """Write a finished run's records to TensorBoard event files in `logdir`.

    Same tags and steps as [`TensorBoardCallback`][vartrace.TensorBoardCallback]; returns
    the number of records written.  `run` is an open [`vartrace.Run`][] or what
    [`vartrace.open`][] takes (a file, a glob of shards); `names` the sites to write (default: all).
    `progress` shows a tqdm bar of the records written on stderr when that takes more than a
    second.

    Example:
        ```python
        export_run("run.h5", "runs/run")     # then: tensorboard --logdir runs
        ```
    """
    from vartrace.storage.reader import Run, open_run

    if not isinstance(run, Run):
        with open_run(run) as opened:
            return export_run(
                opened, logdir, names=names, stats=stats, histograms=histograms, progress=progress
            )
    ranks = {int(r) for name in run.names for r in np.unique(run[name].ranks)}
    chosen = list(run.names if names is None else names)
    total = sum(len(run[name]) for name in chosen)
    written = 0
    with (
        TensorBoardCallback(
            logdir, stats=stats, histograms=histograms, per_rank=len(ranks) > 1
        ) as board,
        progress_bar(show=progress, total=total, desc="tensorboard", unit="record") as bar,
    ):
        for name in chosen:
            site = run[name]
            for index in range(len(site)):
                iteration, rank = int(site.iterations[index]), int(site.ranks[index])
                written += board.write(name, site.record(index), iteration, rank)
                bar.update(1)
    return written
