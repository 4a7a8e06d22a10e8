"""Compare two runs record by record and find where they start to differ.

[`compare`][vartrace.compare] takes two runs — HDF5 files (a path or glob), open
[`Run`][vartrace.Run] objects, [`ModelTracer`][vartrace.ModelTracer]
objects or plain mappings of site name -> [`Trace`][vartrace.Trace] — and
matches their records by site, iteration, rank and occurrence (the n-th
record of that site in that iteration on that rank).  For every matched
pair it reports whether the shapes match, whether the values are close
(`|a - b| <= atol + rtol * |b|` elementwise, NaN equal to NaN at the same
place), the largest absolute and relative difference, the cosine
similarity, and the mean/std/var of each side with their differences.

Numeric work is vectorised and streams once over the data: records stored
uncompressed are viewed in place through a memory map of the file (others
are read in large blocks into reused buffers); every site is indexed
first (record matching, HDF5 metadata), then a small thread pool reads and
reduces blocks of records with numpy (which releases the GIL).  Statistics
are accumulated in float64 from exact products of the inputs.  Identical
records take a shorter path.

Example:
    ```python
    import vartrace

    report = vartrace.compare("reference.h5", "candidate.h5", atol=1e-6, rtol=1e-4)
    print(report)                       # per-site table + first divergence
    if not report.ok:
        site, iteration, rank = report.first_divergence
    report.to_csv("diff.csv")
    ```
"""

from __future__ import annotations

from vartrace.analysis.comparison.api import compare
from vartrace.analysis.comparison.report import Comparison, Divergence, SiteSummary

__all__ = ["Comparison", "Divergence", "SiteSummary", "compare"]
