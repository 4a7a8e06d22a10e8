"""The `sys.monitoring` frame core (Python >= 3.12), with its common case in C
(`cores.c`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from vartrace._support.warnings import warn
from vartrace.engine.frames.watch import (
    MAX_DECORATOR_FRAMES,
    FrameCore,
    Watch,
    compiled,
    past_wrappers,
)

__all__ = ["MonitoringCore"]


class MonitoringCore(FrameCore):
    """`sys.monitoring` local events on exactly the traced code objects (Python >= 3.12).

    The common case (only the returned frame is read) runs through a C callback and
    `run_plain` (`cores.c`) where they can be built on this machine (`compiled=True`,
    from the first `arm`); every other event goes on to the Python callback.
    """

    name = "monitoring"
    # The free ids first; then the ones Python assigns to OPTIMIZER_ID (5), PROFILER_ID (2),
    # COVERAGE_ID (1) and DEBUGGER_ID (0), least used first.
    _TOOL_IDS = (3, 4, 5, 2, 1, 0)
    _OWNERS = {0: "debuggers", 1: "coverage tools", 2: "profilers (cProfile)", 5: "optimizers"}

    def __init__(self, *, compiled: bool = True) -> None:
        self._compiled = compiled
        self._tool: int | None = None
        self._pending: dict[FrameType, Watch] = {}
        # code -> [users, users wanting lines, users tracing it as a method]
        self._armed: dict[CodeType, list[int]] = {}
        # The ids of the code armed only as a callee (an int's hash is cheap, a code's is not).
        self._callees: set[int] = set()
        self._lock = threading.Lock()

    def _acquire_tool(self) -> int:
        monitoring = sys.monitoring  # type: ignore[attr-defined]
        for tool in self._TOOL_IDS:
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, "vartrace")
                if tool in self._OWNERS:
                    warn(
                        f"vartrace: sys.monitoring tool ids 3 and 4 are taken; using id {tool}, "
                        f"which Python assigns to {self._OWNERS[tool]}: such a tool cannot "
                        "start while vartrace traces",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                events = monitoring.events
                on_return: Callable[[CodeType, int, Any], Any] = self._on_return
                module = compiled() if self._compiled else None
                if module is not None:  # the common case in C, the rest in _on_return
                    on_return = module.monitoring_callback(on_return, self._pending)
                self._compiled = module is not None
                self.run_plain = None if module is None else module.monitoring_run
                monitoring.register_callback(tool, events.PY_RETURN, on_return)
                monitoring.register_callback(tool, events.LINE, self._on_line)
                return tool
        raise RuntimeError("vartrace: every sys.monitoring tool id (0-5) is taken by other tools")

    def _apply(self, code: CodeType) -> None:
        monitoring = sys.monitoring  # type: ignore[attr-defined]
        users, line_users, methods = self._armed.get(code, (0, 0, 0))
        if users and not methods:
            self._callees.add(id(code))
        else:
            self._callees.discard(id(code))
        events = monitoring.events.PY_RETURN if users else monitoring.events.NO_EVENTS
        if line_users:
            events |= monitoring.events.LINE
        monitoring.set_local_events(self._tool, code, events)

    def arm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        with self._lock:
            if self._tool is None:
                self._tool = self._acquire_tool()
            counts = self._armed.setdefault(code, [0, 0, 0])
            counts[0] += 1
            counts[1] += lines
            counts[2] += not callee
            self._apply(code)

    def disarm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        with self._lock:
            counts = self._armed[code]
            counts[0] -= 1
            counts[1] -= lines
            counts[2] -= not callee
            self._apply(code)
            if not counts[0]:
                del self._armed[code]
            if not self._armed and self._tool is not None:
                monitoring = sys.monitoring  # type: ignore[attr-defined]
                events = monitoring.events
                monitoring.register_callback(self._tool, events.PY_RETURN, None)
                monitoring.register_callback(self._tool, events.LINE, None)
                monitoring.free_tool_id(self._tool)
                self._tool = None

    def _find(self, frame: FrameType) -> Watch | None:
        code = frame.f_code
        if id(code) in self._callees:
            return None  # a callee's frame: no walk up the stack
        back = frame.f_back
        pending = self._pending
        for _ in range(MAX_DECORATOR_FRAMES):
            if back is None or back.f_code is code:
                return None
            watch = pending.get(back)
            if watch is not None and not watch.done and watch.code is code:
                return watch  # past other traced calls (a decorator running this one's code)
            back = back.f_back
        return None

    def _caller_watch(self, frame: FrameType) -> Watch | None:
        """The watch of the traced call that called `frame` (through decorators), if any."""
        caller = frame.f_back
        watch = None if caller is None else self._find(caller)  # the common case first
        if watch is None:
            watch = past_wrappers(frame, self._find)
        return watch

    def _on_return(self, code: CodeType, offset: int, retval: Any) -> None:
        frame = sys._getframe(1)
        # The common case first: the traced method called by run() itself, no decorator.
        watch = self._pending.get(frame.f_back)  # type: ignore[arg-type]
        if watch is None:
            watch = self._find(frame)  # through decorators, or not a traced call
        elif watch.done or watch.code is not code:
            watch = None
        if watch is not None:
            watch.returned(frame)
            return
        watch = self._caller_watch(frame)
        if watch is not None and code in watch.callees:
            watch.called(frame, retval)

    def _on_line(self, code: CodeType, line: int) -> None:
        frame = sys._getframe(1)
        watch = self._find(frame)
        if watch is not None:
            if watch.every:
                watch.line(frame, line)
            return
        watch = self._caller_watch(frame)
        if watch is not None and code in watch.callees:
            watch.callee_line(frame, line)

    def run(self, code, names, every, on_line, function, args, kwargs, callees=None):  # type: ignore[no-untyped-def]
        if self.run_plain is not None and not (every or callees):
            return self.run_plain(code, names, function, args, kwargs)  # the common case in C
        # No local may hold this frame (a frame -> locals -> frame cycle outlives the call).
        watch = Watch(code, sys._getframe(), names, every, on_line, callees)
        self._pending[watch.caller] = watch  # type: ignore[index]
        try:
            result = function(*args, **kwargs)
        finally:
            del self._pending[watch.caller]  # type: ignore[arg-type]
            watch.caller = None
        return result, watch.snapshot
