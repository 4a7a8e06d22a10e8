"""Waits for another thread that Ctrl-C can end.

CPython runs a signal's Python handler on the main thread, between bytecodes.  A
signal that lands after the main thread last looked and before it blocks in a
lock's wait (another thread printed, the user pressed Ctrl-C at once; a loaded
machine stretches that window) is handled only when the wait returns: a wait with
no timeout for a thread stuck in a slow callback never does.  So every wait here
wakes each `TICK` seconds, and a Ctrl-C is handled at most that late.  Example:

```python
with condition:
    while pending:
        condition.wait(TICK)
join(thread)    # Thread.join, woken each tick
put(jobs, job)  # Queue.put into a bounded queue
finish(jobs)    # Queue.join
```
"""

from __future__ import annotations

import queue
import threading
from typing import TypeVar

__all__ = ["TICK", "finish", "join", "put"]

#: Seconds between looks at the signals while waiting (a wait's longest lag to Ctrl-C).
TICK = 0.2

_T = TypeVar("_T")


def join(thread: threading.Thread) -> None:
    """`thread.join()`, waking each tick."""
    while thread.is_alive():
        thread.join(TICK)


def put(jobs: queue.Queue[_T], job: _T) -> None:
    """`jobs.put(job)`, waking each tick while the queue is full."""
    while True:
        try:
            jobs.put(job, timeout=TICK)
        except queue.Full:
            continue
        return


def finish(jobs: queue.Queue[_T]) -> None:
    """`jobs.join()`: wait until every item put was marked done, waking each tick."""
    with jobs.all_tasks_done:
        while jobs.unfinished_tasks:
            jobs.all_tasks_done.wait(TICK)
