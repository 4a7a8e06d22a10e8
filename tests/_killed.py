"""Run a writer script in a process of its own and SIGKILL it at a point it reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def kill_when_ready(script: str, path: Path, ready: str = "unflushed") -> None:
    """Run `script` (given `path` as its argument) until it prints the line `ready`,
    then SIGKILL it: the file is left as a killed writer leaves it."""
    source = path.parent / "writer.py"
    source.write_text(script)
    process = subprocess.Popen(
        [sys.executable, str(source), str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == f"{ready}\n"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
