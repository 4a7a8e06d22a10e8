"""The order of vartrace's work at interpreter exit: tracers left running, then savers.

A tracer started with `start()` and never stopped (a notebook, a script that
leaves its loop by `sys.exit`, a `main()` that returns while a training thread
goes on, an exception path that skips `stop()`) registers itself with `watch`.
When the interpreter shuts down, *after* it joined the non-daemon threads (a
training thread's last steps are recorded) and before the `atexit` handlers
registered earlier run (torch tears CUDA down there), each one still watched is
stopped: its last records reach the callbacks and the file.  Then the savers
writing on a thread of their own (`close_at_exit`) are closed, newest first.
The work runs on the exiting thread (Python 3.12 starts no thread at shutdown);
its waits are bounded: the staging thread's last records, and, under
`torch.distributed`, final gathers that wait for ranks that are gone at most the
process group's timeout.

Ctrl-C while it waits ends the wait: one line says so, and the process ends as an
interrupted one does (killed by `SIGINT`, exit status 130 in a shell); the files
keep every record of their last completed write.  Example:

```python
watch(tracer)               # while it runs
unwatch(tracer)             # once it stopped
close_at_exit(saver.close)  # while its writer thread runs
keep_open_at_exit(saver.close)
```
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import traceback
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Protocol

__all__ = ["close_at_exit", "keep_open_at_exit", "unwatch", "watch"]


class _Stoppable(Protocol):
    def _stop_at_exit(self) -> None: ...


_watched: weakref.WeakSet[_Stoppable] = weakref.WeakSet()
_closers: list[Callable[[], None]] = []


def watch(owner: _Stoppable) -> None:
    """Call `owner._stop_at_exit()` at interpreter exit unless `unwatch`\\ ed before."""
    _register()
    _watched.add(owner)


def unwatch(owner: _Stoppable) -> None:
    """Stop watching `owner` (not watched: nothing happens)."""
    _watched.discard(owner)


def close_at_exit(close: Callable[[], None]) -> None:
    """Call `close` at interpreter exit, once the tracers left running were stopped."""
    _register()
    _closers.append(close)


def keep_open_at_exit(close: Callable[[], None]) -> None:
    """Take back `close_at_exit(close)` (not given: nothing happens)."""
    if close in _closers:
        _closers.remove(close)


def _register() -> None:
    """Run `_at_exit` before every `atexit` handler registered so far (they run last in,
    first out): torch's, and those of the libraries imported before this call."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    previous = signal.getsignal(signal.SIGINT)
    ours = previous is signal.default_int_handler  # not one the program set, nor SIG_IGN
    if ours:
        try:
            signal.signal(signal.SIGINT, _interrupted)
        except ValueError:  # run by hand on another thread than the main one
            ours = False
    try:
        while _watched:
            _watched.pop()._stop_at_exit()
        while _closers:
            close = _closers.pop()
            try:
                close()
            except Exception as error:  # said as `atexit` says it; the next ones still run
                sys.stderr.write(f"Exception ignored at exit in {close!r}:\n")
                traceback.print_exception(error)
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C at exit: end the process as an interrupted one, at once (the staging and
    writer threads are daemons; each file keeps its last completed write)."""
    sys.stderr.write(
        "vartrace: interrupted at exit while writing the last records; the files keep "
        "every record of their last completed write\n"
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
            stream.flush()  # closed, written by the interrupted line, replaced by None
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # where SIGINT does not end the process
