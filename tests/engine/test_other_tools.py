"""Other tools in the same process: coverage.py and pdb keep working while a method is traced.

Each test runs ``_scenario.py`` (a traced ``Worker.step``) in a subprocess
under the real tool: ``coverage run`` with each of its cores, or ``pdb``
driven through stdin.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._env import ROOT, child_env
from tests.engine._cores import CORES

SCENARIO = Path(__file__).with_name("_scenario.py")
FRAME_CORES = list(CORES)
COVERAGE_CORES = ["ctrace", "pytrace"] + (["sysmon"] if hasattr(sys, "monitoring") else [])
EXPECTED = {"step.y": [60, 30]}
EXPECTED_EVERY = {"step.acc": [0, 1, 3, 6, 0, 1, 3], "step.y": [60, 30]}


def _run(args: list[str], stdin: str = "", **env: str) -> tuple[str, dict]:
    """Run the scenario (after ``args``); return its output and the state it printed."""
    done = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=child_env(**env),
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(row for row in done.stdout.splitlines() if "RECORDS " in row)  # after a prompt
    return done.stdout, json.loads(line.partition("RECORDS ")[2])


def _body_lines() -> set[int]:
    """The line numbers of ``Worker.step``'s statements that run without ``debug``."""
    source = SCENARIO.read_text().splitlines()
    start = next(i for i, row in enumerate(source, 1) if "def step(" in row)
    end = next(i for i, row in enumerate(source, 1) if i > start and "return z" in row)
    skipped = {i for i, row in enumerate(source, 1) if "self.debug = False" in row}
    skipped |= {i for i, row in enumerate(source, 1) if "breakpoint()" in row}
    return set(range(start + 1, end + 1)) - skipped


@pytest.mark.parametrize("every", [False, True], ids=["return", "every"])
@pytest.mark.parametrize("coverage_core", COVERAGE_CORES)
@pytest.mark.parametrize("frame_core", FRAME_CORES)
def test_coverage_and_tracer_both_record(
    frame_core: str, coverage_core: str, every: bool, tmp_path: Path
) -> None:
    coverage = pytest.importorskip("coverage")
    data_file = tmp_path / "coverage.data"
    args = ["-m", "coverage", "run", f"--data-file={data_file}", str(SCENARIO), frame_core]
    _, state = _run(args + (["every"] if every else []), COVERAGE_CORE=coverage_core)
    assert state["records"] == (EXPECTED_EVERY if every else EXPECTED)
    if coverage_core == "sysmon":
        assert state["tools"][1] == "coverage.py"
    else:  # coverage's trace function is back in place
        tracer = "CTracer" if coverage_core == "ctrace" else "PyTracer"
        assert tracer in state["trace"]
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    measured = next(f for f in data.measured_files() if f.endswith("_scenario.py"))
    assert _body_lines() <= set(data.lines(measured))


@pytest.mark.parametrize("every", [False, True], ids=["return", "every"])
@pytest.mark.parametrize("frame_core", FRAME_CORES)
def test_pdb_inside_traced_method(frame_core: str, every: bool) -> None:
    """breakpoint() in a traced method stops on its lines, the local is recorded, and the
    debugger still stops at a breakpoint in the caller once the method has returned."""
    from tests.engine._scenario import AFTER_CALL

    source = SCENARIO.read_text().splitlines()
    inside = next(i for i, row in enumerate(source, 1) if row.strip() == "z = y + 1")
    after = next(i for i, row in enumerate(source, 1) if row.strip() == AFTER_CALL)
    commands = [f"tbreak {SCENARIO}:{inside}", "c", "p y", f"tbreak {SCENARIO}:{after}", "c"]
    commands += ["p acc", "c"]
    args = [str(SCENARIO), frame_core, "debug"] + (["every"] if every else [])
    output, state = _run(args, "\n".join(commands) + "\n", PYTHONBREAKPOINT="pdb.set_trace")
    printed = [row.rsplit("(Pdb) ", 1)[-1] for row in output.splitlines()]  # after prompts
    stops = [row.removeprefix("-> ") for row in printed if row.startswith("-> ")]
    # pdb starts on the breakpoint() line or the next one (Python 3.13 under a trace function)
    assert stops[0] in ("breakpoint()", "y = acc * 10")
    assert stops[1:] == [
        "z = y + 1",  # a breakpoint in the traced method
        AFTER_CALL,  # a breakpoint in the caller, after the method returned
    ]
    assert "60" in printed  # p y
    assert "*** NameError: name 'acc' is not defined" in printed  # p acc, in the caller
    assert state["records"] == (EXPECTED_EVERY if every else EXPECTED)
