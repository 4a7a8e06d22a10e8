"""What ``gpu_check.py`` prints as it goes: lines stamped with the seconds since it started,
and errors in one short line."""

from __future__ import annotations

import time

START = time.perf_counter()


def log(text: str) -> None:
    print(f"[{time.perf_counter() - START:5.0f}s] {text}", flush=True)


def describe(error: BaseException) -> str:
    """The error's type and first line, short enough for a table cell."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
