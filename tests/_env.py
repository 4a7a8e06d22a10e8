"""The environment of a test's subprocess: this checkout first on the import path (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout prepended to ``PYTHONPATH``, plus ``extra``."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
