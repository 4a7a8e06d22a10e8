"""Statistics mode's computations: the fused summary of a record (`.kernels`).

Example:
    ```python
    from vartrace.statistics import summary
    summary(torch.randn(1000))   # the 11 float64 fields of SUMMARY_FIELDS
    ```
"""

from vartrace.statistics.kernels import summarize_values, summary

__all__ = ["summarize_values", "summary"]
