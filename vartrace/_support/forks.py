"""What a forked child must let go of: objects that belong to the parent process.

A tracer or a saver that is running registers itself with `watch`; in
the child of an `os.fork` (DataLoader workers, `multiprocessing`), each
one still registered has its `_forget()` called, once, before the child
runs anything else.  Example:

```python
watch(tracer)      # while it runs
unwatch(tracer)    # once it stopped
```
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["unwatch", "watch"]


class _Forgetful(Protocol):
    def _forget(self) -> None: ...


_watched: weakref.WeakSet[_Forgetful] = weakref.WeakSet()


def watch(owner: _Forgetful) -> None:
    """Call `owner._forget()` in a child forked while it is watched."""
    _watched.add(owner)


def unwatch(owner: _Forgetful) -> None:
    """Stop watching `owner` (not watched: nothing happens)."""
    _watched.discard(owner)


def _forget_in_child() -> None:
    for owner in list(_watched):
        owner._forget()
    _watched.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
