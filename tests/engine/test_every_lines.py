"""`binding_line`: which source line bound each value `@every` sends, under every core.

A line event comes before its line runs, so a change is seen one event late: the line
a value is keyed by is the one that ran before (the statement that bound it or changed
it in place), the last line run for a change seen at return, and the function's first
line for an argument.  The lines are found by the comments that end them here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vartrace.engine import Hook, Probe, Selector, attach, detach, frames, methods_of, parse
from vartrace.engine.frames import FrameCore, binding_line

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    """The line of this file that ends in the comment `# <marker>`."""
    (found,) = [n for n, text in enumerate(_SOURCE, 1) if text.endswith(f"# {marker}")]
    return found


def _append(data: bytearray, more: bytes) -> bytearray:
    data += more  # callee
    return data


class Steps:
    def run(self, data: bytearray) -> bytearray:  # def
        grown = bytearray(  # multi-line
            data[:1],
        )
        grown.append(2)  # in place
        for i in range(2):
            grown = grown + bytes([i])  # loop
        copied = _append(grown, b"\x07")  # call
        return copied if data.pop() else data  # return


class Recorder:
    """A sink keeping each leaf as it was sent, with the line that bound it."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, int]] = []

    def __call__(self, site: str, value: Any, grad: bool) -> None:
        self.records.append((site, bytes(value), binding_line()))


@pytest.fixture
def content_change_test() -> Iterator[None]:
    """``@every`` compares contents (as the torch edge sets it), restored afterwards."""
    previous = frames.set_change_test(copy.deepcopy, lambda old, new: old == new)
    yield
    frames.set_change_test(*previous)


def _selector(segment: str, variable: str, callee: Any = None) -> Selector:
    pattern = parse(f"{segment}.{variable}@every")
    states = pattern.step(pattern.step(pattern.start, segment), variable)
    return Selector(variable, f"{segment}.{variable}", pattern, states, callee=callee)


def _traced(probe: Probe) -> list[tuple[str, bytes, int]]:
    steps, recorder = Steps(), Recorder()
    hook = Hook(probe, recorder)
    attach(steps, "run", methods_of(Steps)["run"].code, hook)
    try:
        assert steps.run(bytearray(b"\x05\x09")) == b"\x05\x02\x00\x01\x07"
    finally:
        detach(steps, "run", hook)
    return recorder.records


def test_each_value_is_keyed_by_the_line_that_bound_it(
    core: FrameCore, content_change_test: None
) -> None:
    every = tuple(_selector("run", name) for name in ("data", "grown", "copied"))
    records = _traced(Probe(every=every))
    assert [(site, value, line) for site, value, line in records if site == "run.grown"] == [
        ("run.grown", b"\x05", _line("multi-line")),  # not the line of its last argument
        ("run.grown", b"\x05\x02", _line("in place")),
        ("run.grown", b"\x05\x02\x00", _line("loop")),
        ("run.grown", b"\x05\x02\x00\x01", _line("loop")),
        ("run.grown", b"\x05\x02\x00\x01\x07", _line("call")),  # changed in place by the call
    ]
    assert [(s, v, n) for s, v, n in records if s != "run.grown"] == [
        ("run.data", b"\x05\x09", _line("def")),  # an argument: bound before the first line
        ("run.copied", b"\x05\x02\x00\x01\x07", _line("call")),
        ("run.data", b"\x05", _line("return")),  # changed by the last line, seen at return
    ]


def test_a_called_function_s_values_are_keyed_by_its_own_lines(
    core: FrameCore, content_change_test: None
) -> None:
    (callee,) = methods_of(Steps)["run"].callees
    probe = Probe(calls=(_selector("run>_append", "data", callee.code),))
    assert _traced(probe) == [
        ("run>_append.data", b"\x05\x02\x00\x01", callee.code.co_firstlineno),
        ("run>_append.data", b"\x05\x02\x00\x01\x07", _line("callee")),
    ]
