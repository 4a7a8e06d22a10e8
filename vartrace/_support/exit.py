"""Tracers left running at interpreter exit are stopped, their records handed on.

A tracer started with `start()` and never stopped (a notebook, a script that
leaves its loop by `sys.exit`, an exception path that skips `stop()`)
registers itself with `watch`.  When the interpreter shuts down, *before*
it joins threads and before `atexit` handlers run (savers close their files
there; CUDA is torn down after), each one still watched is stopped: its last
records reach the callbacks and the file.  The stop runs on the exiting thread (Python
3.12 starts no thread at shutdown); its waits are bounded: the staging thread's last
records, and, under `torch.distributed`, final gathers that wait for ranks that are gone
at most the process group's timeout.  Example:

```python
watch(tracer)      # while it runs
unwatch(tracer)    # once it stopped
```
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

__all__ = ["unwatch", "watch"]


class _Stoppable(Protocol):
    def _stop_at_exit(self) -> None: ...


_watched: weakref.WeakSet[_Stoppable] = weakref.WeakSet()
_registered = False


def watch(owner: _Stoppable) -> None:
    """Call `owner._stop_at_exit()` at interpreter exit unless `unwatch`\\ ed before."""
    global _registered
    if not _registered:
        try:
            threading._register_atexit(_stop_all)  # type: ignore[attr-defined]
        except RuntimeError:  # the interpreter is already shutting down
            return
        _registered = True
    _watched.add(owner)


def unwatch(owner: _Stoppable) -> None:
    """Stop watching `owner` (not watched: nothing happens)."""
    _watched.discard(owner)


def _stop_all() -> None:
    for owner in list(_watched):
        _watched.discard(owner)
        owner._stop_at_exit()
