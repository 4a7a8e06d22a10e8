"""The tracers running in this process: listed, stopped together, and named when lost.

A notebook cell that builds and starts a tracer, run twice, leaves the first tracer
running: the model stays patched, and both record.  `enter` (at `start()`) warns
when another running tracer patches the same modules, naming it;
[`active_tracers`][vartrace.active_tracers] lists the running tracers and
[`stop_all`][vartrace.stop_all] stops them.  At interpreter exit, before the tracers
left running are stopped (`vartrace._support.exit`), each one that no object of the
user's holds any more (only its own hooks on the model and vartrace's registries do)
is named in a warning: it recorded all along, unseen.  A model called after that stop
(a daemon thread still training) says so once (`say_late_calls`).  The public
functions over it are in `vartrace.tracing.running`.
"""

from __future__ import annotations

import gc
import threading
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vartrace._support import warnings as _warnings

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

__all__ = ["enter", "leave", "say_late_calls", "tracers"]

# id(tracer) -> (the tracer, the ids of the modules it patches or counts calls of)
_running: dict[int, tuple[Any, frozenset[int]]] = {}  # (a ModelTracer, ...)
_lock = threading.Lock()
_at_exit = False
_PLUMBING = (types.MethodType, tuple, types.FrameType)


def enter(tracer: Any, modules: Iterable[object]) -> None:
    """`tracer` started on `modules`: warn if running tracers patch any of them too."""
    global _at_exit
    ids = frozenset(map(id, modules))
    with _lock:
        others = [other for other, theirs in _running.values() if theirs & ids]
        _running[id(tracer)] = (tracer, ids)
        if not _at_exit:
            try:  # after vartrace._support.exit's handler: runs before it (last in, first out)
                threading._register_atexit(_name_lost)  # type: ignore[attr-defined]
                _at_exit = True
            except RuntimeError:  # the interpreter is already shutting down
                pass
    if others:
        names = "; ".join(repr(other) for other in others)
        _warnings.warn(
            f"vartrace: {len(others)} running tracer(s) already patch modules this one "
            f"patches: {names}. Both record, and stopping this one leaves the other "
            "running: stop it with its .stop(), or every running tracer with "
            "vartrace.stop_all() (vartrace.active_tracers() lists them)",
            UserWarning,
        )


def leave(tracer: Any) -> None:
    """`tracer` stopped (or forgot its model in a forked child)."""
    with _lock:
        _running.pop(id(tracer), None)


def tracers() -> list[Any]:
    """The running tracers, oldest first ([`active_tracers`][vartrace.active_tracers])."""
    with _lock:
        return [tracer for tracer, _ in _running.values()]


def _held_by_user(tracer: object, ours: tuple[object, ...]) -> bool:
    """Whether an object other than the tracer's own plumbing refers to `tracer`.

    Its plumbing: its bound methods (the hooks on the model), argument tuples (its undo
    callbacks), mappings keyed by it (its state filters on the model), frames (at exit,
    the exit handlers' own), and `ours` (the registry's containers).
    """
    mine = {id(container) for container in ours}
    for referrer in gc.get_referrers(tracer):  # (no closure over `tracer` here: a cell)
        if id(referrer) in mine or isinstance(referrer, _PLUMBING):
            continue
        if isinstance(referrer, dict) and tracer not in referrer.values():  # ModelTracer: no __eq__
            continue
        return True
    return False


def _name_lost() -> None:
    """At exit: warn about each running tracer that nothing of the user's holds."""
    with _lock:
        running = list(_running.values())
    for tracer, _ in running:
        if not _held_by_user(tracer, (_running, running)):
            _warnings.warn(
                f"vartrace: {tracer!r} was still running at exit, held by nothing but its "
                "hooks on the model (its variable was rebound, or the cell that started it "
                "ran again): it recorded all along and is stopped now. Stop tracers with "
                "their .stop() or vartrace.stop_all(); vartrace.active_tracers() lists them",
                RuntimeWarning,
            )


def say_late_calls(model: nn.Module, finished: Callable[[], bool]) -> None:
    """Warn once when `model` is called after its tracer, left running, was stopped at
    interpreter exit (`finished()` true): a daemon thread still training records nothing."""
    late: list[RemovableHandle] = []

    def hook(module: nn.Module, args: object) -> None:
        if not finished():
            return  # the stop at exit has not begun
        try:
            late.pop().remove()  # said once, whichever thread calls first
        except IndexError:
            return
        _warnings.warn(
            "vartrace: the model was called after the tracer left running was stopped at "
            "interpreter exit (a daemon thread still training?): no step from here on "
            "is recorded",
            RuntimeWarning,
        )

    late.append(model.register_forward_pre_hook(hook))
