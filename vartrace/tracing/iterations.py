"""Iteration counting: which calls are the turns of a training loop, counted per thread.

A [`ModelTracer`][vartrace.ModelTracer] tags every record with an
iteration number chosen by the first rule that applies:

1. `tracer.set_iteration(i)`: every record is tagged `i` until the next call.
2. `ModelTracer(..., optimizer=opt)`: the number of completed `opt.step()`
   calls plus one (a step post-hook), so that all micro-batches of a
   gradient-accumulation step share one number; chunks are gathered after
   every `gathering_interval`-th step.
3. Each outermost call of the model (the root module, seen through module
   hooks that `torch.compile` keeps) is one iteration.
4. As long as the root module itself has never been called (a
   `LightningModule` whose `training_step` calls `self.model(...)`),
   each outermost call of a top-level submodule holding traced sites, or of
   a traced method, is one iteration.
5. Once it has, a module holding traced sites called directly, outside a
   call of the root (the model that PEFT's `merge_and_unload()` returns, a
   block called after training), is one iteration per outermost module call,
   in the mode of that module; a traced method called outside any module call
   (a helper the loop calls after `model(x)`) records with the latest iteration.

Module hooks run inside a compiled region: under `torch.compile(fullgraph=True)`,
where no graph break may leave the region for eager code, they cannot count (a model
compiled whole so is refused), and inside the region only module outputs and parameters
are recorded, from the graph, with the iteration counted outside (`vartrace.tracing.graphs`).

"Outermost" is per thread: two threads calling the model at once make two
iterations, and each thread's records carry its own call's number.  A model
that calls itself (a chunked forward, a recursive tree model) runs one
iteration: its nested calls are not outermost.  A
counted call whose `model.training` does not match the tracer's mode
records nothing.

Example:
    ```python
    counter = IterationCounter(model, "train", trace_interval=1, gathering_interval=1,
                               set_enabled=lambda on: None, flush=lambda: None)
    counter.enter(root=True); counter.state.iteration   # 1
    counter.exit(failed=False)
    ```
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch import nn

__all__ = ["IterationCounter"]


_CALL = nn.Module._wrapped_call_impl.__code__  # the frame of ``module(...)``


def _running(module: nn.Module) -> bool:
    """Whether a call of `module` is on this thread's stack besides the one starting now:
    the model calls itself (a chunked forward, a recursive tree model)."""
    calls = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL and frame.f_locals.get("self") is module:
            calls += 1
            if calls == 2:
                return True
        frame = frame.f_back
    return False


def _outermost_call() -> FrameType | None:
    """The frame of the outermost `module(...)` call on this thread's stack, if any."""
    outermost = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL:
            outermost = frame
        frame = frame.f_back
    return outermost


class _ThreadState:
    """One thread's view: its call depth and the iteration its records carry.

    A plain object, one a thread (`_PerThread`): an attribute of a `threading.local`
    costs ~10x a plain one's, and entering and leaving an iteration read a dozen."""

    __slots__ = (
        "active",
        "counted",
        "depth",
        "in_mode",
        "iteration",
        "open",
        "outside",
        "recording",
        "records_as",
    )

    def __init__(self, counter: IterationCounter) -> None:
        self.depth = 0
        self.counted = False  # the outermost call running now is an iteration
        self.active = False  # ... and it records (it keeps the hooks enabled)
        self.iteration = counter.latest
        self.recording = counter.latest_recording
        self.in_mode = True
        # The iteration a value captured now is recorded with, or None (`capturing`).
        self.records_as: int | None = self.iteration if self.recording else None
        # Modules whose hooked calls have not reported their end, with how many are open.
        self.open: dict[int, int] = {}
        # The module call outside the root that the latest iteration counted (rule 5),
        # held until the next one or the next call of the root.
        self.outside: FrameType | None = None


class _PerThread(threading.local):
    """Each thread's `_ThreadState` (`state`), made at the thread's first look."""

    def __init__(self, counter: IterationCounter) -> None:
        self.state = _ThreadState(counter)


class IterationCounter:
    """Counts iterations by the rules of this module and says whether a thread records now.

    `set_enabled(on)` switches the tracer's capture hooks (off while no
    thread runs a recorded iteration); `flush()` hands the buffered chunk
    on (every `gathering_interval` iterations or optimizer steps); `end()` is
    called at the end of every other outermost call.
    """

    def __init__(
        self,
        model: Any,
        mode: str,
        *,
        trace_interval: int,
        gathering_interval: int,
        set_enabled: Callable[[bool], None],
        flush: Callable[[], None],
        end: Callable[[], None] = lambda: None,
    ) -> None:
        self._model = model
        self._mode = mode
        self._trace_interval = trace_interval
        self._gathering_interval = gathering_interval
        self._set_enabled = set_enabled
        self._enabled: bool | None = None  # what set_enabled was last told (under _lock)
        self._flush = flush
        self._end = end
        self._lock = threading.Lock()
        self._count = 0
        self._calls = 0
        self._steps: int | None = None  # optimizer steps, once an optimizer is followed
        self._root_called = False
        self._user: int | None = None
        self._active = 0
        self.in_mode_calls = 0  # counted calls in the traced mode ...
        self.other_mode_calls = 0  # ... and in the other one
        self.latest = 0
        self.latest_recording = True
        self.per_thread = _PerThread(self)  # `per_thread.state`: the calling thread's

    @property
    def state(self) -> _ThreadState:
        """The calling thread's state (`iteration`, `recording`, `in_mode`, `depth`, and
        `records_as`: what `capturing` returns)."""
        return self.per_thread.state

    def capturing(self) -> int | None:
        """The iteration that a value captured now, in this thread, is recorded with, or
        `None` if it is not recorded."""
        return self.per_thread.state.records_as

    def records_manual(self) -> bool:
        """Whether a `vartrace.tracing.manual` call now, in this thread, is recorded."""
        state = self.per_thread.state
        return state.recording and (state.depth == 0 or state.in_mode)

    def follow_steps(self) -> None:
        """Number iterations by optimizer steps from now on (call `stepped` after each)."""
        self._steps = 0

    def set_user(self, iteration: int) -> None:
        """User-driven numbering: `iteration` for every record until the next call."""
        self._user = iteration
        with self._lock:
            self._assign(self.per_thread.state, iteration)
            self._switch(self._active > 0 or self.capturing() is not None)

    def _switch(self, enabled: bool) -> None:
        """Turn the capture hooks on or off, if that changes them (called under `_lock`)."""
        if enabled != self._enabled:
            self._enabled = enabled
            self._set_enabled(enabled)

    def _assign(self, state: _ThreadState, iteration: int) -> None:
        state.iteration = iteration
        state.recording = (iteration - 1) % self._trace_interval == 0
        state.records_as = iteration if state.recording and state.in_mode else None
        self.latest = iteration
        self.latest_recording = state.recording

    def _next(self) -> int:
        if self._user is not None:
            return self._user
        if self._steps is not None:
            return self._steps + 1
        self._count += 1
        return self._count

    def nested(self) -> bool:
        """Whether this thread runs a counted call now: a call inside it needs no
        `enter` (nor `exit`), as it can start no iteration."""
        return self.per_thread.state.depth > 0

    def enter(self, *, root: bool, replay: bool = False, module: nn.Module | None = None) -> None:
        """A call of the root module (`root`), a counting submodule or a traced method begins.

        `replay`: a forward recomputed during backward (activation
        checkpointing), which belongs to the iteration that ran it first.
        `module`: the module whose forward hook will report the end; if its
        previous call never did (an exception that skips `always_call`
        hooks: `KeyboardInterrupt`, or any exception in compiled code),
        this thread's depth is reset instead of staying stuck inside that call
        (unless that call is still running: the module calls itself).
        """
        state = self.per_thread.state
        if module is not None:
            key = id(module)
            if key in state.open and not _running(module):
                self._reset(state)  # the call left open ended without saying so
            state.open[key] = state.open.get(key, 0) + 1
        state.depth += 1
        if state.depth > 1 or replay:
            return
        model = self._model
        if root:
            self._root_called = True
            state.outside = None
        elif self._root_called:
            outside = _outermost_call()
            if outside is None or outside is state.outside:
                return  # a helper the loop calls, or a call this iteration counted already
            state.outside = outside
            model = outside.f_locals["self"]
        mode = self._mode
        with self._lock:
            state.counted = True
            state.in_mode = mode == "any" or bool(model.training) == (mode == "train")
            if state.in_mode:
                self.in_mode_calls += 1
                self._assign(state, self._next())
            else:
                self.other_mode_calls += 1
                state.records_as = None
            state.active = state.in_mode and state.recording
            self._active += state.active
            self._switch(self._active > 0)

    def _reset(self, state: _ThreadState) -> None:
        with self._lock:
            self._active -= state.active
        state.active = state.counted = False
        state.depth = 0
        state.open.clear()

    def exit(self, failed: bool, module: nn.Module | None = None) -> None:
        """The call that `enter` saw ends (`failed`: by an exception)."""
        state = self.per_thread.state
        if module is not None:
            key = id(module)
            left = state.open.get(key, 0) - 1
            if left > 0:
                state.open[key] = left
            else:
                state.open.pop(key, None)
        state.depth -= 1
        if state.depth or not state.counted:
            return
        state.counted = False
        with self._lock:
            self._active -= state.active
            state.active = False
            due = False
            if state.in_mode and self._steps is None:
                self._calls += 1
                due = not failed and self._calls % self._gathering_interval == 0
        if due:
            self._flush()
        else:
            self._end()

    def stepped(self) -> None:
        """An optimizer step completed: later records belong to the next iteration."""
        with self._lock:
            self._steps = (self._steps or 0) + 1
            due = self._steps % self._gathering_interval == 0
            self._assign(self.per_thread.state, self._next())
            self._switch(self._active > 0 or self.capturing() is not None)
        if due:
            self._flush()
