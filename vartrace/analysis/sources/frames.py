"""DataFrames of in-memory results: `results_frame` (`tracer.results.to_frame()`).

It gives the same table that `vartrace.open(path).to_frame()` gives for a
file: one row per record with its site, iteration, rank, capture order,
shape, dtype and a statistic of its value (Graphcore tensor_tracker style).

Example:
    ```python
    with ModelTracer(model, ["**.forward"]) as tracer:
        model(x)
    df = tracer.results.to_frame(stat="std")
    df.groupby("site")["std"].mean()
    ```
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from vartrace.statistics.named import (
    stat_function,
    statistic_of,
    value_as_array,
    value_dtype_name,
)
from vartrace.trace import Trace

__all__ = ["results_frame"]


def _tag_list(values: Any) -> list[int]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def results_frame(
    results: Mapping[str, Trace] | Any, stat: str | Callable[[Any], Any] = "mean"
) -> Any:
    """A pandas DataFrame of in-memory results: one row per record.

    `results` is `tracer.results` (or a [`ModelTracer`][vartrace.ModelTracer],
    or any mapping of site name -> [`Trace`][vartrace.Trace]).  Columns:
    `site`, `iteration`, `rank`, `order`, `shape` (a tuple; `()`
    for non-array values), `dtype` and one column named after `stat`
    (a name from `STATS`, float64, NaN for non-numeric values; or a
    function called with each record's value, as `Run.to_frame` does).

    Example:
        ```python
        df = results_frame(tracer.results, stat="absmax")
        df.pivot_table(index="iteration", columns="site", values="absmax")
        ```
    """
    try:
        import pandas as pd
    except ImportError as exc:
        hint = "pip install 'torch-vartrace[pandas]'"
        raise ImportError(f"results_frame() needs pandas: {hint}") from exc
    results = getattr(results, "results", results)
    if callable(stat):
        name = getattr(stat, "__name__", "stat")
        column = "stat" if name == "<lambda>" else name
    else:
        column = stat
        if not stat.startswith(("q", "log2|x|")):  # those are fields of statistics records
            stat_function(stat)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("site", "iteration", "rank", "order", "shape", "dtype", column)
    }
    for name, trace in results.items():
        records = trace.records()
        rows["site"].extend([name] * len(records))
        rows["iteration"].extend(_tag_list(trace.iterations))
        rows["rank"].extend(_tag_list(trace.ranks))
        rows["order"].extend(_tag_list(trace.order))
        for value in records:
            array = value_as_array(value)
            rows["shape"].append(() if array is None else tuple(array.shape))
            rows["dtype"].append(value_dtype_name(value))
            rows[column].append(stat(value) if callable(stat) else statistic_of(value, stat))
    frame = pd.DataFrame(rows)
    for tag in ("iteration", "rank", "order"):
        frame[tag] = frame[tag].astype("int64")
    return frame
