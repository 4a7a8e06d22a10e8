"""TensorBoard (public module): a post-gather callback, and the export of a finished run.

The implementation lives in `vartrace.analysis.tensorboard`; this module names what users
import.  Needs TensorBoard: `pip install 'torch-vartrace[tensorboard]'`.  Example:

```python
from vartrace.tensorboard import export_run

export_run("run.h5", "runs/attn")   # then: tensorboard --logdir runs
```
"""

from vartrace.analysis.tensorboard import DEFAULT_STATS, TensorBoardCallback, export_run

__all__ = ["DEFAULT_STATS", "TensorBoardCallback", "export_run"]
