"""Where a gather would collide with the training's own communication, and must wait.

A gather is a collective: every rank of its group must reach it, and nothing else
may run on that group in between.  Two training layouts break that on the
training thread:

- a `torch.distributed.pipelining` schedule (GPipe, 1F1B, ...) calls a stage's
  module once a microbatch, between its receives and sends: a gather at the end
  of such a call (an iteration, without `optimizer=`) waits for a rank that waits
  for this rank's activations;
- `torch.distributed.algorithms.Join` shadows the collectives of ranks still
  running with its own (a count each step, DDP's all-reduces) on the ranks out of
  inputs: a gather pairs with those and no rank leaves.

`in_pipeline_schedule` and `join_live` tell the tracer so; it then holds its
periodic gathers back (its records spilled to a file, see
`vartrace.distributed.spill`) until the collision is over, or refuses to start
inside a Join.

torch never marks a `Join` as over (a joinable keeps its enabled `_join_config`
after the `with`), so `join_live` finds the `Join` itself: the one whose
joinables hold the model, live while its `__exit__` is bound (a `with`
statement, or an `ExitStack`, holds it while the body runs) or runs (on a rank
out of inputs, shadowing the others).  Finding it
walks the garbage collector's objects, once for each `Join` the model is given
to; after that, a change in the `Join`'s reference count (entering or leaving
its `with`) is the cue to look again.  From Python 3.14 a `with` statement holds no
bound `__exit__`: there a `Join` is over once it is gone (a `with Join(...)` that
named it nowhere), and one still referenced counts as live.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

__all__ = ["in_pipeline_schedule", "join_enabled", "join_live"]

_PIPELINING = os.path.join(os.path.dirname(torch.__file__), "distributed", "pipelining") + os.sep


def in_pipeline_schedule() -> bool:
    """Whether this thread runs inside a `torch.distributed.pipelining` schedule's step.

    Example:
        ```python
        schedule.step(x)  # a stage's forward, inside: in_pipeline_schedule() is True
        ```
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PIPELINING):
            return True
        frame = frame.f_back
    return False


def join_enabled(model: Any) -> bool:
    """Whether `model` (a `DistributedDataParallel` wrapper, any `Joinable`) was given to
    a `Join` with uneven-input detection on, running or over (torch keeps the setting
    after the `Join`; `join_live` tells the two apart).

    Example:
        ```python
        with Join([ddp]):
            join_enabled(ddp)  # True
        ```
    """
    config = getattr(model, "_join_config", None)
    return bool(getattr(config, "enable", False))


@dataclass
class _Seen:
    """What `join_live` found for a model's `_join_config`."""

    config: Any
    join: weakref.ReferenceType[Any] | None
    refcount: int  # the Join's when last looked at (-1: not yet counted)
    live: bool


_seen: weakref.WeakKeyDictionary[Any, _Seen] = weakref.WeakKeyDictionary()


def join_live(model: Any) -> bool:
    """Whether `model` was given to a `Join` with uneven-input detection on that has not
    ended: its `with` is running (its body, or its `__exit__` shadowing other ranks).

    Example:
        ```python
        with Join([ddp]):
            join_live(ddp)  # True
        join_live(ddp)  # False, though join_enabled(ddp) stays True
        ```
    """
    config = getattr(model, "_join_config", None)
    if not getattr(config, "enable", False):
        return False
    seen = None
    with contextlib.suppress(TypeError):  # a joinable without weak references: look each time
        seen = _seen.get(model)
    if seen is None or seen.config is not config:
        seen = _look(model, config)
        with contextlib.suppress(TypeError):
            _seen[model] = seen
    join = seen.join() if seen.join is not None else None
    if join is None:
        return False  # no Join holds the model any more: its `with` has ended
    count = sys.getrefcount(join)
    if seen.refcount < 0:  # just found
        seen.refcount = count
    elif count != seen.refcount:  # its `with` entered or left: look again
        seen.live, seen.refcount = _running(join), count
    return seen.live


def _look(model: Any, config: Any) -> _Seen:
    """The `Join` that holds `model` among its joinables (the newest, if several), and
    whether its `with` runs."""
    from torch.distributed.algorithms.join import Join

    holders = [holder for holder in gc.get_referrers(model) if isinstance(holder, list)]
    joins = [
        owner
        for owner in (gc.get_referrers(*holders) if holders else [])  # one walk for all
        if isinstance(owner, Join) and any(owner._joinables is holder for holder in holders)
    ]
    live = [join for join in joins if _running(join)]
    if not joins:
        return _Seen(config, None, -1, False)
    return _Seen(config, weakref.ref((live or joins)[-1]), -1, bool(live))


def _running(join: Any) -> bool:
    """Whether `join`'s `with` runs: its body (the `__exit__` the `with` statement, or an
    `ExitStack`, holds bound) or its `__exit__` (shadowing the ranks still running; the
    call consumed the bound method, and a thread's frame runs it)."""
    exit_ = type(join).__exit__
    if sys.version_info >= (3, 14):  # a `with` keeps `__exit__` and the Join apart: unseen
        return True  # so a Join that still exists may run: gathers wait (never a hang)
    if any(
        isinstance(holder, types.MethodType)
        and holder.__self__ is join
        and holder.__func__ is exit_
        for holder in gc.get_referrers(join)
    ):
        return True
    frames = sys._current_frames()  # this thread's holds this frame: a cycle, broken below
    try:
        return any(_runs(frame, exit_.__code__, join) for frame in frames.values())
    finally:
        del frames


def _runs(frame: FrameType | None, code: types.CodeType, join: Any) -> bool:
    """Whether `frame`, or a frame it was called from, runs `code` with `join` as `self`."""
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is join:
            return True
        frame = frame.f_back
    return False
