"""vartrace's warnings: shown where they arise, never raised into the step they watch.

Under `python -W error` (or pytest's `filterwarnings = ["error"]`) a
warning filter turns `warnings.warn` into a `raise`.  Inside a traced
step (a value split into its tensors, an [`Unstored`][vartrace.Unstored] marker,
`@grad` under `no_grad`, a write that failed) that would break the step,
so `warn` catches what the filter raises and keeps the warning.
`release` emits the kept warnings again at a safe point: the tracer
calls it at exit once its final flush and the callbacks ran, and the saver at
the end of `close()`.  There, under `-W error`, the first one raises (the
others are notes on it), after every record reached the file; with an
exception already propagating (a failed step, Ctrl-C) they become notes on
that exception instead.  Warnings still kept when the interpreter exits are
printed.

A warning is attributed to the user's line: the first frame of the stack whose
file is outside the vartrace package and torch (the line that built the tracer,
called the traced module, or opened the file), not the line of vartrace that
noticed it.  Callers
need not pass a `stacklevel`.  Example:

```python
from vartrace._support.warnings import warn, release

warn("vartrace: site 'forward.x': ...", RuntimeWarning)   # never raises
...
release()   # at exit: raises the kept warning under -W error
```
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import threading
import warnings
from types import FrameType

__all__ = ["release", "user_line", "warn"]

_kept: list[Warning] = []
_lock = threading.Lock()  # the staging and writer threads warn too


def _skipped_prefixes() -> tuple[str, ...]:
    """The folders of vartrace and of torch: a warning is shown at the first frame in
    neither.  torch's frames are skipped too because vartrace's code runs under
    torch's (a module's `__call__`, a `torch._dynamo.disable` wrapper): the
    user's line is the one that called torch."""
    folders = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # vartrace/
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        folders.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
    return tuple(folder + os.sep for folder in folders)


_SKIPPED = _skipped_prefixes()


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """`warnings.warn(message, category)` that never raises: a filter's error is kept.

    The warning is attributed to the first frame outside the vartrace and torch
    packages (the user's line).  `stacklevel` is accepted for the calls that still pass it and
    not used: the frames it counted are vartrace's, skipped anyway.
    """
    del stacklevel
    try:
        _warn_outside(message, category)
    except Warning as error:  # a filter with action "error" raised it
        with _lock:
            _kept.append(error)


def _warn_outside(message: str, category: type[Warning]) -> None:
    """`warnings.warn` attributed to the first frame whose file is neither vartrace's
    nor torch's."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_SKIPPED)
    else:
        warnings.warn(message, category, stacklevel=_outside_level(sys._getframe(1)))


def _outside_level(frame: FrameType | None) -> int:
    """The `stacklevel` of `warnings.warn`, called from `_warn_outside`,
    that names the first frame from `frame` outward whose file is neither vartrace's
    nor torch's.

    With none (a vartrace thread or exit handler), one past the outermost frame:
    `warnings` then reports the location `sys`, as `skip_file_prefixes` does.
    """
    level = 2  # _warn_outside's caller is ``frame``
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
        level += 1
    return level


def user_line() -> str:
    """Where the user's code stands now: `file:line` of the first frame outside vartrace
    and torch (a script's line, a notebook cell's file), `"?"` where there is none."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def release(during: BaseException | None = None) -> None:
    """Emit the warnings kept since the last call; raise the first a filter turns into an error.

    With `during` (an exception already propagating) nothing is raised: each
    warning a filter turns into an error becomes a note on `during`
    (Python >= 3.11; printed to `stderr` before).
    """
    with _lock:
        kept = list(_kept)
        _kept.clear()
    raised: Warning | None = None
    for error in kept:
        try:
            _warn_outside(str(error), type(error))
        except Warning as again:
            target = during if during is not None else raised
            if target is None:
                raised = again
            else:
                _note(target, f"{type(again).__name__}: {again}")
    if raised is not None:
        raise raised


def _note(error: BaseException, text: str) -> None:
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(text)
    else:  # Python 3.10: no notes
        warnings.showwarning(text, RuntimeWarning, "vartrace", 0)


def _print_kept() -> None:
    """At interpreter exit: print the warnings no safe point emitted (never lose one)."""
    with _lock:
        kept = list(_kept)
        _kept.clear()
    for error in kept:
        warnings.showwarning(str(error), type(error), "vartrace", 0)


atexit.register(_print_kept)
