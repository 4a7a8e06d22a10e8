"""Uniform views of runs (files or memory) for analysis: the package behind compare and plot.

A run reaches the analysis side in several forms: an HDF5 file (a path, a
glob of shards, or an open [`Run`][vartrace.Run]), a
[`ModelTracer`][vartrace.ModelTracer], or `tracer.results` (any mapping of
site name -> [`Trace`][vartrace.Trace]).  `open_source` wraps each
in a `Source` whose sites are `SiteView` objects with numpy
tags and block reads, which `vartrace.analysis.comparison` and `vartrace.analysis.plot`
build on.  One concept per module, data flowing one way:

- `statistics`: named statistics and numeric views of values;
- `frames`: DataFrames of records, of files and memory alike (the one `to_frame`);
- `buffers`: reusable read buffers;
- `chunk_maps`: memory-mapped HDF5 chunks;
- `views`: site views (memory, file) and per-record statistics;
- `source`: a whole run as a `Source`.

Example:
    ```python
    with open_source("run.h5") as run:
        stds = record_stats(run.site("layers.0.out"), "std")["std"]
    ```
"""

from vartrace.analysis.sources.buffers import BufferPool
from vartrace.analysis.sources.chunk_maps import FileMaps
from vartrace.analysis.sources.frames import results_frame
from vartrace.analysis.sources.source import Source, open_source
from vartrace.analysis.sources.views import SiteView, Unreadable, numeric_groups, record_stats
from vartrace.statistics.named import STATS, stat_function, value_as_array, value_dtype_name

__all__ = [
    "STATS",
    "BufferPool",
    "FileMaps",
    "SiteView",
    "Source",
    "Unreadable",
    "numeric_groups",
    "open_source",
    "record_stats",
    "results_frame",
    "stat_function",
    "value_as_array",
    "value_dtype_name",
]
