"""The environment of a test's subprocess: this checkout first on the import path (torch-free)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout prepended to ``PYTHONPATH``, plus ``extra``."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def run_script(
    code: str, *args: str, flags: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh Python (`flags` before ``-c``) that imports this checkout,
    and check that it exited with status 0; its output, as text."""
    done = subprocess.run(
        [sys.executable, *flags, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def run_without_a_compiler(code: str, cache: Path) -> str:
    """Run `code` in a fresh Python whose `$CC` names no compiler, its build cache
    (`$XDG_CACHE_HOME`) in `cache`: it must exit with status 0 and build nothing.  Its
    standard output."""
    env = child_env(CC=str(cache / "no-cc"), XDG_CACHE_HOME=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert not list(cache.rglob("*.so"))
    return done.stdout
