"""What both frame cores share: the interface (`FrameCore`), the state of one traced
call (`Watch`), the functions watched inside it (`Callee`), and how a frame is told to
be the traced call's (its caller chain, past decorators' wrappers)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

from vartrace._support.native import load
from vartrace.engine.frames.bindings import Bindings, LineCallback

__all__ = [
    "LOCALS_DICT",
    "MAX_DECORATOR_FRAMES",
    "Callee",
    "FrameCore",
    "Watch",
    "called_from",
    "compiled",
    "past_wrappers",
    "variables",
]

MAX_DECORATOR_FRAMES = 8
# Whether a frame's `f_locals` is a dict of its own: from 3.13 (PEP 667) it is a proxy
# that holds the frame, whose `f_back` (the patch's frame) holds the proxy: a cycle a call.
LOCALS_DICT = sys.version_info < (3, 13)


def compiled() -> ModuleType | None:
    """The cores' common case in C (`cores.c`), built on first use; `None` where this
    machine cannot build it."""
    return load(Path(__file__).with_name("cores.c"), "vartrace_frames")


def called_from(frame: FrameType, caller: FrameType | None) -> bool:
    code = frame.f_code
    back = frame.f_back
    for _ in range(MAX_DECORATOR_FRAMES):
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
        for _ in range(MAX_DECORATOR_FRAMES):
            if not isinstance(function, FunctionType):
                break
            if function.__code__ is code:
                return True
            function = vars(function).get("__wrapped__")
    return False


def past_wrappers(frame: FrameType, check: Callable[[FrameType], Any]) -> Any:
    """The first `check(caller)` not `None`, past the decorators of `frame`'s function.

    While the frame's caller is a decorator's wrapper around the function
    (`functools.wraps`), the wrapper's caller is checked; the direct
    caller itself is the caller's to check first (the common case).
    """
    code = frame.f_code
    back = frame.f_back
    for _ in range(MAX_DECORATOR_FRAMES):
        if back is None or not _wraps(back, code):
            return None
        back = back.f_back
        if back is None:
            return None
        found = check(back)
        if found is not None:
            return found
    return None


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


class Watch:
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
        self.callee_last: dict[FrameType, Bindings] = {}
        # What `@every` last sent (made only where lines are read: most calls read none).
        self.last = Bindings(code) if every else None
        self.snapshot: dict[str, Any] | None = None
        self.done = False

    def callee_line(self, frame: FrameType, line: int | None) -> None:
        """A line of a callee's frame is about to run (`None`: it returns): report the
        `every` variables that changed."""
        callee = self.callees[frame.f_code]
        if callee.every:
            last = self.callee_last.get(frame)
            if last is None:
                last = self.callee_last[frame] = Bindings(frame.f_code)
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
        self.snapshot = variables(frame, self.names)
        self.done = True


def variables(frame: FrameType, names: tuple[str, ...]) -> dict[str, Any]:
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
