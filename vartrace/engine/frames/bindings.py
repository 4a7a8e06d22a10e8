"""What `@every` sends: the values a frame's variables took, each once, with the line
that bound it.

A line event (or the frame's return) hands `Bindings.send` the frame's locals; the
names whose value changed since the last event (by the change test, `set_change_test`)
go to the line callback, with `binding_line()` naming the line that bound them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from types import CodeType
from typing import Any

__all__ = ["Bindings", "LineCallback", "binding_line", "set_change_test"]

LineCallback = Callable[[str, Any], None]
Snapshot = Callable[[Any], Any]
Unchanged = Callable[[Any, Any], bool]
_MISSING = object()
_binding = threading.local()


def _identity(value: Any) -> tuple[int, Any]:
    # A tensor changed in place keeps its identity but bumps ``_version``.
    return id(value), getattr(value, "_version", None)


def _same_identity(snapshot: Any, value: Any) -> bool:
    return bool(snapshot == _identity(value))


_change_test: tuple[Snapshot, Unchanged] = (_identity, _same_identity)


def set_change_test(snapshot: Snapshot, unchanged: Unchanged) -> tuple[Snapshot, Unchanged]:
    """Set how `@every` tells a new value of a variable from the one it last sent, and
    return the previous `(snapshot, unchanged)`.

    `snapshot(value)` keeps what the next comparison needs;
    `unchanged(snapshot, value)` says whether `value` still equals it.  The
    default compares identity and `_version` only, which misses in-place
    changes of mutable objects; the torch edge installs a content comparison.
    Example:
        ```python
        previous = set_change_test(copy.deepcopy, lambda old, new: old == new)
        ...
        set_change_test(*previous)
        ```
    """
    global _change_test
    previous, _change_test = _change_test, (snapshot, unchanged)
    return previous


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


class Bindings:
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
