"""The fields of a statistics record, in stored order: what the reducer writes and readers name.

Example:
    ```python
    SUMMARY_FIELDS.index("absmax")   # 5: the record's element 6, after the header
    ```
"""

from __future__ import annotations

__all__ = ["COUNTS", "SUMMARY_FIELDS"]

#: The statistics that count values (whole numbers), stored as integers by statistics mode.
COUNTS = ("count", "nan", "posinf", "neginf", "zeros")

#: The fields of every statistics-mode record (`vartrace.stats`), in stored order.
SUMMARY_FIELDS = ("count", "mean", "std", "min", "max", "absmax", "norm", *COUNTS[1:])
