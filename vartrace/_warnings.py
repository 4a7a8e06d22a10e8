"""vartrace's warnings: shown where they arise, never raised into the step they watch.

Under ``python -W error`` (or pytest's ``filterwarnings = ["error"]``) a
warning filter turns ``warnings.warn`` into a ``raise``.  Inside a traced
step (a value split into its tensors, an :class:`~vartrace.Unstored` marker,
``@grad`` under ``no_grad``, a write that failed) that would break the step,
so :func:`warn` catches what the filter raises and keeps the warning.
:func:`release` emits the kept warnings again at a safe point: the tracer
calls it at exit once its final flush and the callbacks ran, and the saver at
the end of ``close()``.  There, under ``-W error``, the first one raises (the
others are notes on it), after every record reached the file; with an
exception already propagating (a failed step, Ctrl-C) they become notes on
that exception instead.  Warnings still kept when the interpreter exits are
printed.  Example::

    from vartrace._warnings import warn, release

    warn("vartrace: site 'forward.x': ...", RuntimeWarning)   # never raises
    ...
    release()   # at exit: raises the kept warning under -W error
"""

from __future__ import annotations

import atexit
import threading
import warnings

__all__ = ["release", "warn"]

_kept: list[Warning] = []
_lock = threading.Lock()  # the staging and writer threads warn too


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category)`` that never raises: a filter's error is kept.

    ``stacklevel`` counts as in :func:`warnings.warn`, from the caller of this function.
    """
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning as error:  # a filter with action "error" raised it
        with _lock:
            _kept.append(error)


def release(during: BaseException | None = None) -> None:
    """Emit the warnings kept since the last call; raise the first a filter turns into an error.

    With ``during`` (an exception already propagating) nothing is raised: each
    warning a filter turns into an error becomes a note on ``during``
    (Python >= 3.11; printed to ``stderr`` before).
    """
    with _lock:
        kept = list(_kept)
        _kept.clear()
    raised: Warning | None = None
    for error in kept:
        try:
            warnings.warn(str(error), type(error), stacklevel=3)
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
