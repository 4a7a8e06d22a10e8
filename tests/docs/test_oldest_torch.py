"""The oldest torch vartrace supports: pyproject states it, `import vartrace` refuses an
older one with the reason, and `.ci/run` runs a job on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import vartrace

ROOT = Path(__file__).resolve().parents[2]


def _import_with_torch(version: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`import vartrace` in a fresh interpreter that finds a torch distribution of `version`
    first on its path (its metadata only: vartrace must refuse before importing torch)."""
    dist_info = tmp_path / f"torch-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", "import vartrace"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.parametrize("version", ["2.9.1", "2.1.0", "1.13.1+cu117"])
def test_an_older_torch_is_refused_at_import_naming_the_floor(version: str, tmp_path: Path) -> None:
    done = _import_with_torch(version, tmp_path)
    assert done.returncode == 1
    assert (
        f"ImportError: vartrace needs torch >= 2.10, found torch {version}: "
        "it is tested on torch 2.10 and newer only"
    ) in done.stderr


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.13.0a0+git1234abc"])
def test_the_oldest_torch_and_newer_import(version: str, tmp_path: Path) -> None:
    done = _import_with_torch(version, tmp_path)
    assert (done.returncode, done.stderr) == (0, "")


def test_pyproject_states_the_floor_the_import_checks() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = ".".join(map(str, vartrace._OLDEST_TORCH))
    assert f"torch>={floor}" in project["dependencies"]


def test_ci_runs_a_job_on_the_oldest_torch() -> None:
    floor = ".".join(map(str, vartrace._OLDEST_TORCH))
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'step "Python 3.11, the oldest supported torch ({floor}.0)' in ci
    assert f"pip install --quiet torch=={floor}.0 transformers\n" in ci
