"""The peak resident memory of this process alone, for tests that bound a subprocess's memory.

``getrusage(...).ru_maxrss`` will not do on Linux: a child started by fork + exec keeps the
high-water mark of the process it was forked from (the test suite, often far larger), so
the child's own peak is read from ``VmHWM`` in /proc/self/status, reset at exec.

``python tests/_peak.py ARGS...`` runs ``vartrace ARGS...`` and writes its peak (KiB) to the
file named by $VARTRACE_TEST_PEAK when it exits, however it exits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def peak_rss_kib() -> int:
    """This process's peak resident memory since its exec, in KiB (``VmHWM``)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def host_memory_bench() -> ModuleType:
    """``tools/bench_host_memory.py`` as a module (its ``peak_above_start`` runs a fresh
    process and measures it)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "bench_host_memory.py"
    spec = importlib.util.spec_from_file_location("bench_host_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_vartrace() -> None:
    import atexit
    import os
    import runpy
    import sys

    def write_peak() -> None:
        with open(os.environ["VARTRACE_TEST_PEAK"], "w") as out:
            out.write(str(peak_rss_kib()))

    atexit.register(write_peak)
    del sys.path[0]  # this folder: the command sees the path a `vartrace` command would
    runpy.run_module("vartrace", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_vartrace()
