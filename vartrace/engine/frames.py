"""Frame capture: reading a running method's locals, with one interface and two cores.

A patched method that needs locals at return (or every value a variable
takes) calls the method through `FrameCore.run`, which returns the
method's result and a snapshot of the requested variables as they were
when it returned.  How the frame is observed depends on the Python:

* `MonitoringCore` (Python >= 3.12) enables `sys.monitoring`
  *local* events (`PY_RETURN`, and `LINE` for `@every`) on exactly
  the code objects being traced.  Other code runs at full speed, and the
  `sys.settrace` / `sys.monitoring` use of other tools is untouched.
* `SettraceCore` (older Pythons) arms `sys.settrace` only until the
  traced call's frame starts (for its whole duration with `@every` or
  callees), chains
  every event to the trace function already installed (a debugger,
  coverage.py), and reads the locals from the finished frame afterwards.

Both cores leave other tools' state alone: the `sys.monitoring` tool ids
that Python assigns to debuggers, coverage, profilers and optimizers are
taken only when the free ones are not, and a trace function that another
tool installs during a traced call (`breakpoint()`) stays installed.

A frame is recognised as the traced call when its code object is the
method's and its caller chain reaches the `run` frame
(through at most a few decorator frames, never through another frame of
the same code): calls of the same code on untraced instances, or nested
recursive calls, are not mistaken for it.

*Callees* are plain functions the traced method calls (Hugging Face's
`eager_attention_forward`), each described by a `Callee`: a frame
of a callee's code whose caller is the traced call's frame is read when it
returns (and on each line for `@every`), once per call, and handed to the
callee's callbacks at once.

A line event comes before its line runs: the values `@every` finds changed
there were bound (or changed in place) by the line that ran before it, which
`binding_line` names while a line callback runs.  The values found at
return belong to the last line that ran; arguments (and other names bound
before the first line) to the function's first line (`co_firstlineno`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import CodeType, FrameType, FunctionType
from typing import Any

from vartrace._support.native import load
from vartrace._support.warnings import warn

__all__ = [
    "Callee",
    "FrameCore",
    "MonitoringCore",
    "SettraceCore",
    "binding_line",
    "default_core",
    "set_change_test",
]

LineCallback = Callable[[str, Any], None]
Snapshot = Callable[[Any], Any]
Unchanged = Callable[[Any, Any], bool]
_MISSING = object()
_MAX_DECORATOR_FRAMES = 8
# Whether a frame's `f_locals` is a dict of its own: from 3.13 (PEP 667) it is a proxy
# that holds the frame, whose `f_back` (the patch's frame) holds the proxy: a cycle a call.
_LOCALS_DICT = sys.version_info < (3, 13)
_binding = threading.local()


def _called_from(frame: FrameType, caller: FrameType | None) -> bool:
    code = frame.f_code
    back = frame.f_back
    for _ in range(_MAX_DECORATOR_FRAMES):
        if back is None or back.f_code is code:
            return False
        if back is caller:
            return True
        back = back.f_back
    return False


def _wraps(frame: FrameType, code: CodeType) -> bool:
    """Whether `frame` is a decorator's wrapper around the function of `code`.

    A `functools.wraps` wrapper (transformers' `create_causal_mask`)
    holds the function it calls in its closure, itself or through the
    `__wrapped__` chain of nested decorators.
    """
    if not frame.f_code.co_freevars:
        return False
    f_locals = frame.f_locals
    for name in frame.f_code.co_freevars:
        function = f_locals.get(name)
        for _ in range(_MAX_DECORATOR_FRAMES):
            if not isinstance(function, FunctionType):
                break
            if function.__code__ is code:
                return True
            function = vars(function).get("__wrapped__")
    return False


def _past_wrappers(frame: FrameType, check: Callable[[FrameType], Any]) -> Any:
    """The first `check(caller)` not `None`, past the decorators of `frame`'s function.

    While the frame's caller is a decorator's wrapper around the function
    (`functools.wraps`), the wrapper's caller is checked; the direct
    caller itself is the caller's to check first (the common case).
    """
    code = frame.f_code
    back = frame.f_back
    for _ in range(_MAX_DECORATOR_FRAMES):
        if back is None or not _wraps(back, code):
            return None
        back = back.f_back
        if back is None:
            return None
        found = check(back)
        if found is not None:
            return found
    return None


def _identity(value: Any) -> tuple[int, Any]:
    # A tensor changed in place keeps its identity but bumps ``_version``.
    return id(value), getattr(value, "_version", None)


def _same_identity(snapshot: Any, value: Any) -> bool:
    return bool(snapshot == _identity(value))


_change_test: tuple[Snapshot, Unchanged] = (_identity, _same_identity)


def set_change_test(snapshot: Snapshot, unchanged: Unchanged) -> None:
    """Set how `@every` tells a new value of a variable from the one it last sent.

    `snapshot(value)` keeps what the next comparison needs;
    `unchanged(snapshot, value)` says whether `value` still equals it.  The
    default compares identity and `_version` only, which misses in-place
    changes of mutable objects; the torch edge installs a content comparison.
    Example:
        ```python
        set_change_test(copy.deepcopy, lambda old, new: old == new)
        ```
    """
    global _change_test
    _change_test = (snapshot, unchanged)


def _changed(
    last: dict[str, Any], f_locals: Mapping[str, Any], names: tuple[str, ...]
) -> Iterator[tuple[str, Any]]:
    """The variables of `names` bound to another object (or changed in place) since `last`.

    `last` holds a snapshot per name, taken and compared by the change test
    (`set_change_test`).
    """
    snapshot, unchanged = _change_test
    for name in names:
        value = f_locals.get(name, _MISSING)
        if value is _MISSING:
            continue
        previous = last.get(name, _MISSING)
        if previous is _MISSING or not unchanged(previous, value):
            last[name] = snapshot(value)
            yield name, value


def binding_line() -> int:
    """The source line that bound the value a line callback of this thread is receiving.

    The line of the statement that ran last in the frame when the change was
    seen: the one that bound the variable or changed it in place (`scores =
    ...` or `scores.add_(mask)`); the function's first line for a value it
    held before its first line ran (an argument).  Only meaningful inside a
    `LineCallback` (an `@every` value).  Example:

    ```python
    def on_line(name, value):
        print(name, "bound at line", binding_line())
    ```
    """
    line: int = _binding.line
    return line


class _Bindings:
    """What `@every` last sent from one frame: a snapshot per name (see `_changed`),
    and the line that ran last (where the changes seen next were made)."""

    __slots__ = ("line", "values")

    def __init__(self, code: CodeType) -> None:
        self.line = code.co_firstlineno  # arguments are bound before the first line
        self.values: dict[str, Any] = {}

    def send(
        self,
        f_locals: Mapping[str, Any],
        names: tuple[str, ...],
        on_line: LineCallback,
        next_line: int | None,
    ) -> None:
        """Hand each changed name of `names` to `on_line`, as bound at the last line run;
        `next_line` is the line about to run (`None` at return)."""
        for name, value in _changed(self.values, f_locals, names):
            _binding.line = self.line
            on_line(name, value)
        if next_line is not None:
            self.line = next_line


class Callee:
    """A function to watch inside a traced call, and what to do with its frames.

    `on_return(variables, return_value)` receives `names` read when a
    call returns; `on_line(name, value)` each new value of a name in
    `every` (line events), as for the method's own `@every`, with
    `binding_line()` saying which line of the callee bound it.
    """

    __slots__ = ("every", "names", "on_line", "on_return")

    def __init__(
        self,
        names: tuple[str, ...],
        every: tuple[str, ...],
        on_return: Callable[[dict[str, Any], Any], None],
        on_line: LineCallback | None = None,
    ) -> None:
        self.names = names
        self.every = every
        self.on_return = on_return
        self.on_line = on_line


class _Watch:
    """The state of one traced call: what to read and what was read."""

    __slots__ = (
        "callee_last",
        "callees",
        "caller",
        "code",
        "done",
        "every",
        "last",
        "names",
        "on_line",
        "snapshot",
    )

    def __init__(
        self,
        code: CodeType,
        caller: FrameType,
        names: tuple[str, ...],
        every: tuple[str, ...],
        on_line: LineCallback | None,
        callees: Mapping[CodeType, Callee] | None = None,
    ) -> None:
        self.code = code
        self.caller: FrameType | None = caller
        self.names = names
        self.every = every
        self.on_line = on_line
        self.callees = callees or {}
        self.callee_last: dict[FrameType, _Bindings] = {}
        # What `@every` last sent (made only where lines are read: most calls read none).
        self.last = _Bindings(code) if every else None
        self.snapshot: dict[str, Any] | None = None
        self.done = False

    def callee_line(self, frame: FrameType, line: int | None) -> None:
        """A line of a callee's frame is about to run (`None`: it returns): report the
        `every` variables that changed."""
        callee = self.callees[frame.f_code]
        if callee.every:
            last = self.callee_last.get(frame)
            if last is None:
                last = self.callee_last[frame] = _Bindings(frame.f_code)
            last.send(frame.f_locals, callee.every, callee.on_line, line)  # type: ignore[arg-type]

    def called(self, frame: FrameType, value: Any) -> None:
        """A callee's frame returned `value`: hand its variables over."""
        callee = self.callees[frame.f_code]
        self.callee_line(frame, None)
        self.callee_last.pop(frame, None)
        f_locals = frame.f_locals
        callee.on_return({n: f_locals[n] for n in callee.names if n in f_locals}, value)

    def line(self, frame: FrameType, line: int | None) -> None:
        """A line of the traced frame is about to run (`None`: it returns): report the
        `every` variables that changed."""
        assert self.last is not None  # made for every watch that reads lines
        self.last.send(frame.f_locals, self.every, self.on_line, line)  # type: ignore[arg-type]

    def returned(self, frame: FrameType) -> None:
        if self.every:
            self.line(frame, None)
        self.snapshot = _variables(frame, self.names)
        self.done = True


def _variables(frame: FrameType, names: tuple[str, ...]) -> dict[str, Any]:
    """The `names` bound in `frame`'s locals, with their values."""
    f_locals = frame.f_locals
    snapshot: dict[str, Any] = {}
    for name in names:  # a loop: a comprehension is a call of its own before 3.12
        if name in f_locals:
            snapshot[name] = f_locals[name]
    return snapshot


class FrameCore:
    """The interface both cores implement.

    `arm(code, lines, callee)` / `disarm(code, lines, callee)` are
    reference counted and bracket the time a code object may be traced
    (`callee`: as a function a traced method calls);
    `run` calls `function` and returns `(result, snapshot)`, where
    `snapshot` maps each name in `names` still bound at return to its
    value, and may map the frame's other locals too (`None` if the call was
    not observed, which cannot happen for a plain Python method).  `callees`
    maps the code of each function to watch inside the call to its `Callee`.
    """

    name = "abstract"
    #: `run` without `every`, `on_line` or `callees`, where the core has a shortcut for
    #: that common case: `run_plain(code, names, function, args, kwargs)`, which returns
    #: `None`, calling nothing, where it cannot observe the call (then `run` does).
    run_plain: Callable[..., tuple[Any, dict[str, Any] | None] | None] | None = None

    def arm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        """Start observing `code` (with line events if `lines`)."""

    def disarm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        """Stop observing `code` once no armed user is left."""

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
        raise NotImplementedError


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
    through a C trace function (`settrace.c`) where it can be built on this machine
    (`compiled=True`, from the first `arm`); the same in Python otherwise.
    """

    name = "settrace"

    def __init__(self, *, compiled: bool = True) -> None:
        self._compiled = compiled

    def arm(self, code: CodeType, lines: bool, callee: bool = False) -> None:
        if self._compiled and self.run_plain is None:  # built before the first traced call
            module = load(Path(__file__).with_name("settrace.c"), "vartrace_settrace")
            self._compiled = module is not None
            self.run_plain = None if module is None else module.find

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
            if frame.f_code is code and (frame.f_back is caller or _called_from(frame, caller)):
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
        if _LOCALS_DICT:  # the finished frame's own dict of its locals (names among them)
            return result, found.pop().f_locals
        return result, _variables(found.pop(), names)


def _run_chained(code, names, every, on_line, function, args, kwargs, callees):  # type: ignore[no-untyped-def]
    """`SettraceCore.run` under another tool's trace function, or reading lines or callees."""
    watch = _Watch(code, sys._getframe(), names, every, on_line, callees)
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

    def __init__(self, watch: _Watch, previous: Any) -> None:
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
                frame.f_back is watch.caller or _called_from(frame, watch.caller)
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
            frame.f_back is self.target or _past_wrappers(frame, self._target) is not None
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

    def __init__(self, watch: _Watch, previous: Any) -> None:
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


class MonitoringCore(FrameCore):
    """`sys.monitoring` local events on exactly the traced code objects (Python >= 3.12)."""

    name = "monitoring"
    # The free ids first; then the ones Python assigns to OPTIMIZER_ID (5), PROFILER_ID (2),
    # COVERAGE_ID (1) and DEBUGGER_ID (0), least used first.
    _TOOL_IDS = (3, 4, 5, 2, 1, 0)
    _OWNERS = {0: "debuggers", 1: "coverage tools", 2: "profilers (cProfile)", 5: "optimizers"}

    def __init__(self) -> None:
        self._tool: int | None = None
        self._pending: dict[FrameType, _Watch] = {}
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
                monitoring.register_callback(tool, events.PY_RETURN, self._on_return)
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

    def _find(self, frame: FrameType) -> _Watch | None:
        code = frame.f_code
        if id(code) in self._callees:
            return None  # a callee's frame: no walk up the stack
        back = frame.f_back
        pending = self._pending
        for _ in range(_MAX_DECORATOR_FRAMES):
            if back is None or back.f_code is code:
                return None
            watch = pending.get(back)
            if watch is not None and not watch.done and watch.code is code:
                return watch  # past other traced calls (a decorator running this one's code)
            back = back.f_back
        return None

    def _caller_watch(self, frame: FrameType) -> _Watch | None:
        """The watch of the traced call that called `frame` (through decorators), if any."""
        caller = frame.f_back
        watch = None if caller is None else self._find(caller)  # the common case first
        if watch is None:
            watch = _past_wrappers(frame, self._find)
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
        # No local may hold this frame (a frame -> locals -> frame cycle outlives the call).
        watch = _Watch(code, sys._getframe(), names, every, on_line, callees)
        self._pending[watch.caller] = watch  # type: ignore[index]
        try:
            result = function(*args, **kwargs)
        finally:
            del self._pending[watch.caller]  # type: ignore[arg-type]
            watch.caller = None
        return result, watch.snapshot


def default_core() -> FrameCore:
    """The best core for this Python: `sys.monitoring` where it exists."""
    return MonitoringCore() if hasattr(sys, "monitoring") else SettraceCore()
