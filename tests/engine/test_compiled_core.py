"""The frame cores' common case in C (`vartrace/engine/frames/cores.c`), and its fallback.

Every core test runs under each core's compiled common case (`settrace`, `monitoring`)
and its Python one (`settrace-python`, `monitoring-python`, see `_cores.py`); these
check that the compiled one is the one a tracer gets wherever it can be built, and the
Python one where it cannot.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from tests._env import run_without_a_compiler
from vartrace.engine.frames import FrameCore, MonitoringCore, SettraceCore

COMPILED = [SettraceCore] + ([MonitoringCore] if hasattr(sys, "monitoring") else [])


def _body(x: int) -> int:
    doubled = x * 2
    return doubled + 1


def _can_build() -> bool:
    """Whether this machine has what `vartrace._support.native` builds C modules with."""
    command = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    return bool(command) and shutil.which(command[0]) is not None and headers.exists()


@pytest.mark.parametrize("make", COMPILED, ids=lambda make: make.name)
def test_a_core_finds_frames_in_c_where_it_can_be_built(make: type[FrameCore]) -> None:
    core = make()
    core.arm(_body.__code__, False)
    try:
        assert (core.run_plain is not None) is _can_build()
        result, snapshot = core.run(_body.__code__, ("doubled",), (), None, _body, (4,), {})
    finally:
        core.disarm(_body.__code__, False)
    assert result == 9
    assert snapshot is not None and snapshot["doubled"] == 8
    assert sys.gettrace() is None


def test_under_another_trace_function_the_compiled_core_chains_to_it() -> None:
    events: list[str] = []

    def other(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is _body.__code__:
            events.append(event)
        return other

    core = SettraceCore()
    core.arm(_body.__code__, False)
    sys.settrace(other)
    try:
        result, snapshot = core.run(_body.__code__, ("doubled",), (), None, _body, (1,), {})
    finally:
        installed = sys.gettrace()
        sys.settrace(None)
    assert installed is other  # still the other tool's, which saw the whole call
    assert (result, snapshot and snapshot["doubled"]) == (3, 2)
    assert events[0] == "call" and events[-1] == "return" and "line" in events


WITHOUT_A_COMPILER = """
from vartrace.engine.frames import {core}
def body(x):
    doubled = x * 2
    return doubled
core = {core}()
core.arm(body.__code__, False)
result, snapshot = core.run(body.__code__, ("doubled",), (), None, body, (5,), {{}})
print(core.run_plain, snapshot["doubled"])
"""


@pytest.mark.parametrize("make", COMPILED, ids=lambda make: make.name)
def test_without_a_compiler_a_core_finds_frames_in_python(
    make: type[FrameCore], tmp_path: Path
) -> None:
    script = WITHOUT_A_COMPILER.format(core=make.__name__)
    assert run_without_a_compiler(script, tmp_path).split() == ["None", "10"]
