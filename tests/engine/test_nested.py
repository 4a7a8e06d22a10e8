"""Nested traced calls never recurse: every variant, with and without other tools, both cores.

A traced method calling another traced method (``_nested.py``), the outer
one read at return, ``@every`` or through a called function, under no
other tool, under a Python trace function (a debugger, coverage's
PyTracer) and under coverage.py's C tracer (a subprocess run by
``coverage run``).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._env import ROOT, child_env
from tests.engine._nested import (
    EXPECTED,
    VARIANTS,
    Inner,
    Outer,
    _scale,
    _selector,
    run_variant,
)
from vartrace.engine import Hook, Probe, attach, detach, methods_of
from vartrace.engine.frames import FrameCore

SCRIPT = Path(__file__).with_name("_nested.py")
FRAME_CORES = ["settrace"] + (["monitoring"] if hasattr(sys, "monitoring") else [])
COVERAGE_CORES = ["ctrace", "pytrace"] + (["sysmon"] if hasattr(sys, "monitoring") else [])


class _Debugger:
    """A Python trace function as debuggers have them: a global one returning a local one."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.lines = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            self.calls.append(frame.f_code)
        return self.local

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        self.lines += event == "line"
        return self.local


@pytest.mark.parametrize("variant", VARIANTS)
def test_nested_traced_calls(core: FrameCore, variant: str) -> None:
    assert run_variant(variant) == EXPECTED[variant]


@pytest.mark.parametrize("variant", VARIANTS)
def test_nested_traced_calls_under_a_python_trace_function(core: FrameCore, variant: str) -> None:
    debugger = _Debugger()
    previous = sys.gettrace()
    sys.settrace(debugger)
    try:
        records = run_variant(variant)
        after = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert records == EXPECTED[variant]
    assert after is debugger
    # Two outer calls, six inner ones, two of _scale: the debugger saw each of them.
    codes = (Outer.step.__code__, Inner.step.__code__, _scale.__code__)
    assert [debugger.calls.count(code) for code in codes] == [2, 6, 2]
    assert debugger.lines > 0


@pytest.mark.parametrize("coverage_core", COVERAGE_CORES)
@pytest.mark.parametrize("frame_core", FRAME_CORES)
def test_nested_traced_calls_under_coverage(
    frame_core: str, coverage_core: str, tmp_path: Path
) -> None:
    coverage = pytest.importorskip("coverage")
    data_file = tmp_path / "coverage.data"
    command = ["-m", "coverage", "run", f"--data-file={data_file}", str(SCRIPT), frame_core]
    done = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        env=child_env(COVERAGE_CORE=coverage_core),
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = next(row for row in done.stdout.splitlines() if row.startswith("RECORDS "))
    state = json.loads(line.removeprefix("RECORDS "))
    assert state["records"] == EXPECTED
    if coverage_core != "sysmon":
        assert ("CTracer" if coverage_core == "ctrace" else "PyTracer") in state["trace"]
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    measured = next(f for f in data.measured_files() if f.endswith("_nested.py"))
    source = SCRIPT.read_text().splitlines()
    body = {
        i for i, row in enumerate(source, 1) if row.strip() in ("y = x + 1", "scaled = value * 3")
    }
    assert body <= set(data.lines(measured))


class _Runner:
    """Runs a function for its caller, then scales the result (a checkpoint-like helper)."""

    def call(self, function: Any, *args: Any) -> int:
        out = function(*args)
        return _scale(out)


_RUNNER = _Runner()


def _through_runner(method: Any) -> Any:
    """A decorator running the method through another object's traced method."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any) -> Any:
        return _RUNNER.call(method, self, *args)

    return wrapper


class _Routed:
    @_through_runner
    def step(self, x: int) -> int:
        doubled = x * 2
        return doubled


@pytest.mark.parametrize("debugger", [False, True], ids=["alone", "debugger"])
def test_a_method_found_inside_another_traced_call(core: FrameCore, debugger: bool) -> None:
    """The method's frame starts while the runner's tracer is in front: both are read."""
    records: list[tuple[str, Any]] = []
    previous = sys.gettrace()
    if debugger:
        sys.settrace(_Debugger())

    def sink(site: str, value: Any, grad: bool) -> None:
        records.append((site, value))

    (callee,) = methods_of(_Runner)["call"].callees
    scaled = _selector("call>_scale.scaled", "scaled", callee.code)
    hooks = [
        (_RUNNER, "call", Hook(Probe(calls=(scaled,)), sink)),
        (_Routed(), "step", Hook(Probe(exit=(_selector("step.doubled", "doubled"),)), sink)),
    ]
    for instance, name, hook in hooks:
        attach(instance, name, methods_of(type(instance))[name].code, hook)
    try:
        assert hooks[1][0].step(5) == 30
    finally:
        sys.settrace(previous)
        for instance, name, hook in hooks:
            detach(instance, name, hook)
    assert records == [("call>_scale.scaled", 30), ("step.doubled", 10)]
