"""Figures of runs (public module): statistics over iterations, and two runs' similarity.

The implementation lives in `vartrace.analysis.plot`; this module names what users import.
Needs matplotlib: `pip install 'torch-vartrace[plot]'`.  Example:

```python
from vartrace.plot import plot_stat

figure = plot_stat("run.h5", ["layers.*.attn.forward.scores"], stats=["mean", "absmax"])
figure.savefig("scores.png")
```
"""

from vartrace.analysis.plot import plot_similarity, plot_stat

__all__ = ["plot_similarity", "plot_stat"]
