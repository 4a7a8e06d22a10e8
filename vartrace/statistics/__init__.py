"""Statistics mode in one place: what a record holds, how it is computed, how it is read.

- `fields`: the names of a record's summary fields, in stored order;
- `records`: the record layout, the `Statistics` mapping a reader gives back, and
  `vartrace.stats()` (the pre-save reducer) and its `StatsReducer`;
- `kernels`: the fused summary of a tensor in one op (numpy on the CPU, Triton on CUDA);
- `named`: the named statistics (`mean`, `absmax`, ...) that readers, plots and comparisons
  compute over recorded values, statistics records included.

The analysis side (`vartrace.analysis.sources`, the reader, `compare`, `plot`) imports this package;
nothing here imports them.

Example:
    ```python
    from vartrace.statistics import summary
    summary(torch.randn(1000))   # the 11 float64 fields of SUMMARY_FIELDS
    ```
"""

from vartrace.statistics.kernels import summarize_values, summary

__all__ = ["summarize_values", "summary"]
