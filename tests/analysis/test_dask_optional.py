"""Dask stays optional: without it the in-process paths run and `scheduler=` says what to
install (a real interpreter in which `dask` and `distributed` cannot be imported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._dask_runs import write_run

_WITHOUT_DASK = """
import sys
sys.modules["dask"] = sys.modules["distributed"] = None   # as if not installed
import vartrace
run = sys.argv[1]
report = vartrace.compare(run, run)
assert report.ok
try:
    vartrace.compare(run, run, scheduler="threads")
except ImportError as error:
    print(error)
"""


def test_without_dask_compare_runs_in_process_and_a_scheduler_names_the_extra(
    tmp_path: Path,
) -> None:
    run = write_run(tmp_path / "run", 2)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DASK, run],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'torch-vartrace[dask]'" in done.stdout
