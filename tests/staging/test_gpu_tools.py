"""The GPU tools' control flow, on a tiny CPU model: a lent GPU is rare and its minutes are
few, so the scripts must run the first time they meet one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=TOOLS.parent
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_gpu_steps_prints_every_contender_with_its_steps() -> None:
    out = _run(str(TOOLS / "gpu_steps.py"), "--smoke-cpu")
    table = out[out.index("\ncontender ") + 1 :].splitlines()[1:]
    names = [line[:38].strip() for line in table if line.strip()]
    assert "untraced" in names and "async statistics, 12 blocks + @grad" in names
    assert len(names) == 10  # every contender but device=cuda, none failed
    for line in table:
        assert line.split()[-3].endswith("x") and line.split()[-2].endswith("x"), line


@pytest.mark.slow
def test_gpu_check_runs_its_control_flow(tmp_path: Path) -> None:
    out = _run(str(TOOLS / "gpu_check.py"), "--smoke-cpu", "--out", str(tmp_path))
    assert "0 mismatches against blocking copies" in out
    assert "FAIL" not in out
    assert (tmp_path / "gpu_check.json").is_file()
