"""Every exception vartrace raises of its own, in one leaf module.

Each is also reachable where users meet it (`vartrace.CallbackError`,
`vartrace.storage.RunFileError`, ...).  Example:

```python
from vartrace.errors import RunFileError

try:
    run = vartrace.open("run.h5")
except RunFileError as error:
    print("damaged:", error)
```
"""

from __future__ import annotations

__all__ = [
    "CallbackError",
    "ManifestError",
    "PickleNotAllowedError",
    "RunFileError",
    "TraceLengthError",
    "WorkerError",
]


class CallbackError(RuntimeError):
    """A callback raised: the message names the callback, its stage and the site.

    The callback's own exception is `__cause__`.

    Example:
        ```python
        try:
            with ModelTracer(model, ["head"], pre_save_callbacks=[reduce_scores]):
                model(x)
        except vartrace.CallbackError as error:
            original = error.__cause__
        ```
    """


class TraceLengthError(ValueError):
    """A callback left `values`, `iterations`, `ranks` and `order` unequal in length."""


class RunFileError(ValueError):
    """A run file that vartrace refuses to read, or one holding less than it declares.

    Raised, naming the dataset or link, for data kept outside the file (external
    storage, external links, virtual datasets mapping other files), for links and
    structures vartrace never writes, and for reads that a dataset declares larger
    than what the file holds of it (a damaged or crafted file): reading never
    allocates more than `FREE_READ_BYTES` or what the file holds (compressed
    data: at most `MAX_COMPRESSION` times the file's size).
    """


class ManifestError(ValueError):
    """A shard's manifest that cannot be what vartrace writes.  Readers never raise it to the
    user: they warn and open the shard's file instead."""


class PickleNotAllowedError(ValueError):
    """A record holds a pickled object and the run was opened without `allow_pickle=True`."""


class WorkerError(RuntimeError):
    """A background job failed; the original exception is the `__cause__`."""
