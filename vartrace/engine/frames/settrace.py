"""The `sys.settrace` frame core (Python < 3.12, and where `sys.monitoring` is not
wanted), with its common case in C (`cores.c`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import CodeType, FrameType
from typing import Any

from vartrace.engine.frames.bindings import LineCallback
from vartrace.engine.frames.watch import (
    LOCALS_DICT,
    Callee,
    FrameCore,
    Watch,
    called_from,
    compiled,
    past_wrappers,
    variables,
)

__all__ = ["SettraceCore"]


class SettraceCore(FrameCore):
    """`sys.settrace` armed only until a traced method's frame starts (Python < 3.12).

    The trace function is installed just before the call and sees the frame's
    `call` event; the frame is then held and its locals are read once the call
    has returned (a finished frame keeps them), so no return event is needed and,
    without `@every` or callees to read, the previous trace function is back in
    place for the whole body of the method.  Every event is chained to the trace function that
    was installed (a debugger, coverage.py), which also stays in charge of what
    the method's own code does: a debugger started inside it (`breakpoint()`)
    keeps running after the method returns.

    The common case (no other tool traces, only the returned frame is read) runs
    through a C trace function (`cores.c`) where it can be built on this machine
    (`compiled=True`, from the first `arm`); the same in Python otherwise.
    """

    name = "settrace"

    def __init__(self, *, compiled: bool = True) -> None:
        self._compiled = compiled

    def arm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        if self._compiled and self.run_plain is None:  # built before the first traced call
            module = compiled()
            self._compiled = module is not None
            self.run_plain = None if module is None else module.settrace_run

    def run(
        self,
        code: CodeType,
        names: tuple[str, ...],
        every: tuple[str, ...],
        on_line: LineCallback | None,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        callees: Mapping[CodeType, Callee] | None = None,
    ) -> tuple[Any, dict[str, Any] | None]:
        if self.run_plain is not None and not (every or callees):
            # The common case in C: no other tool traces (else None), only the returned
            # frame's locals are read.
            answer = self.run_plain(code, names, function, args, kwargs)
            if answer is not None:
                return answer
        if every or callees or sys.gettrace() is not None:
            return _run_chained(code, names, every, on_line, function, args, kwargs, callees)
        # The same in Python, written out: a closure finds the frame and uninstalls itself
        # (a closure costs about a third less a call than _ChainedTracer's bound __call__).
        caller: FrameType | None = sys._getframe()
        found: list[FrameType] = []

        def find(frame: FrameType, event: str, arg: Any) -> None:
            if frame.f_code is code and (frame.f_back is caller or called_from(frame, caller)):
                found.append(frame)
                sys.settrace(None)

        sys.settrace(find)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            found.clear()
            raise
        finally:
            if sys.gettrace() is find:  # the frame was never found: this is still installed
                sys.settrace(None)
            caller = None  # no cycle through the closure to this frame
        if not found:
            return result, None
        if LOCALS_DICT:  # the finished frame's own dict of its locals (names among them)
            return result, found.pop().f_locals
        return result, variables(found.pop(), names)


def _run_chained(code, names, every, on_line, function, args, kwargs, callees):  # type: ignore[no-untyped-def]
    """`SettraceCore.run` under another tool's trace function, or reading lines or callees."""
    watch = Watch(code, sys._getframe(), names, every, on_line, callees)
    tracer = _ChainedTracer(watch, sys.gettrace())
    sys.settrace(tracer)
    try:
        result = function(*args, **kwargs)
    except BaseException:
        tracer.release(False)
        raise
    tracer.release(True)
    return result, watch.snapshot


class _ChainedTracer:
    """A global trace function (the object itself) that finds one frame and defers
    everything to `previous`."""

    __slots__ = ("previous", "previous_local", "target", "watch")

    def __init__(self, watch: Watch, previous: Any) -> None:
        self.watch = watch
        self.previous = previous
        self.previous_local: Any = None
        self.target: FrameType | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        watch = self.watch
        local = None
        if self.previous is not None:
            # This tracer, or a nested traced call's tracer that chains to this one.
            front = sys.gettrace()
            local = self.previous(frame, event, arg)
            current = sys.gettrace()
            if current is not front:
                # The tool called above installed itself (coverage's C tracer does when a
                # Python trace function calls it): chain to it, and put the front back.
                # Only a change made during that call is adopted, so two tracers never
                # adopt each other.
                self.previous = current
                sys.settrace(front)
        if self.target is None:
            # The common case first: the method called by run() itself, no decorator.
            if frame.f_code is watch.code and (
                frame.f_back is watch.caller or called_from(frame, watch.caller)
            ):
                self.target = frame
                if not (watch.every or watch.callees):
                    # Found: the body runs under the previous tool.  A nested tracer in
                    # front sees the change and chains to that tool in this one's place.
                    sys.settrace(self.previous)
                    return local
                if watch.every:
                    self.previous_local = local
                    local = self.local_trace
        elif frame.f_code in watch.callees and (
            frame.f_back is self.target or past_wrappers(frame, self._target) is not None
        ):
            local = _CalleeTracer(watch, local).trace
        return local

    def _target(self, frame: FrameType) -> FrameType | None:
        return frame if frame is self.target else None

    def local_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.previous_local is not None:
            self.previous_local = self.previous_local(frame, event, arg)
        if event == "line":
            self.watch.line(frame, frame.f_lineno)
        return self.local_trace

    def release(self, returned: bool) -> None:
        """Hand tracing back, read the finished frame if the call returned, drop every frame.

        The trace function installed now stays when it is not this one: a
        debugger started inside the method keeps running.
        """
        installed = sys.gettrace() is self  # (an "is" test would narrow self's type)
        if installed:
            sys.settrace(self.previous)
        target = self.target
        if returned and target is not None:
            self.watch.returned(target)
        # Only a watch reading lines installs local_trace (a bound method made per test).
        if target is not None and self.watch.every and target.f_trace == self.local_trace:
            target.f_trace = None
        self.target = None
        self.previous_local = None
        self.watch.caller = None


class _CalleeTracer:
    """The local trace function of one callee frame: reads it when it returns normally."""

    __slots__ = ("previous", "unwinding", "watch")

    def __init__(self, watch: Watch, previous: Any) -> None:
        self.watch = watch
        self.previous = previous
        self.unwinding = False

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.previous is not None:
            self.previous = self.previous(frame, event, arg)
        if event == "return":
            # An exception unwinding the frame reports 'exception' then 'return' (None).
            if not (self.unwinding and arg is None):
                self.watch.called(frame, arg)
            else:
                self.watch.callee_last.pop(frame, None)
            return self.trace
        self.unwinding = event == "exception"
        if event == "line":
            self.watch.callee_line(frame, frame.f_lineno)
        return self.trace
