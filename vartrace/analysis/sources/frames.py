"""DataFrames of records, one row each: the one `to_frame` of files (`Run.to_frame`) and
of in-memory results (`results_frame`, `tracer.results.to_frame()`).

Both give one row per record with its site, iteration, rank, capture order,
shape, dtype and a statistic of its value (Graphcore tensor_tracker style);
`records_frame` builds the table from `FrameSite`s, each source saying how
to describe its records (a file reads them in blocks, memory holds them).

Example:
    ```python
    with ModelTracer(model, ["**.forward"]) as tracer:
        model(x)
    df = tracer.results.to_frame(stat="std")
    df.groupby("site")["std"].mean()
    ```
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from vartrace.statistics.named import (
    STATS,
    statistic_of,
    value_as_array,
    value_dtype_name,
)
from vartrace.trace import Trace

__all__ = ["FrameSite", "records_frame", "results_frame"]

#: A statistic: a `STATS` name, a field of statistics records, or a function of a value.
Stat = str | Callable[[Any], Any]
#: One record's cells: the statistic of its value, its dtype name and its shape.
Described = tuple[Any, str, tuple[int, ...]]


class FrameSite(NamedTuple):
    """One site as a frame needs it: its tags (one entry a record) and how to describe
    its records for one statistic (a `Described` a record, in the tags' order)."""

    name: str
    iterations: Any
    ranks: Any
    order: Any
    describe: Callable[[Stat], Sequence[Described]]


def records_frame(
    sites: Iterable[FrameSite], stat: Stat | Sequence[str], caller: str = "records_frame()"
) -> Any:
    """A pandas DataFrame with one row per record of `sites` and a column per statistic.

    Columns: site, iteration, rank, order (int64), shape, dtype and the statistic
    (named after `stat`; `"stat"` for a lambda).  `stat` is a name of `STATS`
    (float64, NaN for non-numeric records), a field of statistics records (`q0.5`)
    or a callable receiving each record's value; a list of names gives a column
    each.  `caller` names the function in the error when pandas is missing.
    `sites` is iterated only once `stat` is known good.

    Example:
        ```python
        records_frame(run_sites, ["absmax", "nan"], caller="Run.to_frame()")
        ```
    """
    try:
        import pandas as pd
    except ImportError as exc:
        hint = "pip install 'torch-vartrace[pandas]'"
        raise ImportError(f"{caller} needs pandas: {hint}") from exc
    wanted = [stat] if callable(stat) or isinstance(stat, str) else list(stat)
    for one in wanted:
        if not callable(one) and one not in STATS and not one.startswith(("q", "log2|x|")):
            raise ValueError(
                f"unknown statistic {one!r}; use one of {sorted(STATS)}, a field of "
                "statistics records (q0.5, log2|x|=3...) or a callable"
            )
    named = [one if isinstance(one, str) else getattr(one, "__name__", "stat") for one in wanted]
    stat_columns = ["stat" if column == "<lambda>" else column for column in named]
    frames = []
    for site in sites:
        table: dict[str, Any] = {}
        for one, column in zip(wanted, stat_columns, strict=True):
            described = site.describe(one)
            stats, dtypes, shapes = zip(*described, strict=True) if described else ((), (), ())
            table[column] = stats
        frames.append(
            pd.DataFrame(
                {
                    "site": site.name,
                    "iteration": site.iterations,
                    "rank": site.ranks,
                    "order": site.order,
                    "shape": shapes,
                    "dtype": dtypes,
                    **table,
                }
            )
        )
    columns = ["site", "iteration", "rank", "order", "shape", "dtype", *stat_columns]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    for tag in ("iteration", "rank", "order"):
        frame[tag] = frame[tag].astype("int64")
    return frame


def _tag_array(values: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.tolist()
    return np.asarray([int(v) for v in values], np.int64)


def _described(trace: Trace, stat: Stat) -> list[Described]:
    """A statistic, the dtype name and the shape of each record of an in-memory `trace`."""
    rows = []
    for value in trace.records():
        array = value_as_array(value)
        found = stat(value) if callable(stat) else statistic_of(value, stat)
        rows.append((found, value_dtype_name(value), () if array is None else tuple(array.shape)))
    return rows


def results_frame(results: Mapping[str, Trace] | Any, stat: Stat | Sequence[str] = "mean") -> Any:
    """A pandas DataFrame of in-memory results: one row per record.

    `results` is `tracer.results` (or a [`ModelTracer`][vartrace.ModelTracer],
    or any mapping of site name -> [`Trace`][vartrace.Trace]).  The columns
    and the statistics are those of `Run.to_frame` (see `records_frame`):
    `site`, `iteration`, `rank`, `order`, `shape` (a tuple; `()` for
    non-array values), `dtype` and one column named after `stat`.

    Example:
        ```python
        df = results_frame(tracer.results, stat="absmax")
        df.pivot_table(index="iteration", columns="site", values="absmax")
        ```
    """
    results = getattr(results, "results", results)
    sites = (
        FrameSite(
            name,
            _tag_array(trace.iterations),
            _tag_array(trace.ranks),
            _tag_array(trace.order),
            functools.partial(_described, trace),
        )
        for name, trace in results.items()
    )
    return records_frame(sites, stat, caller="results_frame()")
