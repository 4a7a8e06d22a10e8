"""Keep torch's OpenMP pool off a background thread, without touching the process's setting.

`torch.set_num_threads` is process-wide: it also sets the team size of every
thread started later (autograd's device threads, a DataLoader's pin thread).
OpenMP's own `omp_set_num_threads` sets only the calling thread's value, so a
vartrace thread calls that, on the OpenMP runtime torch loaded, after torch has
initialised the thread (`torch.get_num_threads`).  Host work on such a thread
then never wakes a team of spinning workers (on a 16-core GPU host, 15 of them
took cores from the training thread).
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["one_openmp_thread"]

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime loaded into this process, from `/proc/self/maps`."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if any(os.path.basename(path).startswith(name) for name in _RUNTIMES):
                    return path
    except OSError:
        pass
    return None


def one_openmp_thread() -> bool:
    """Make torch's CPU ops on the calling thread use one OpenMP thread; `True` if done.

    Other threads, present and future, keep torch's setting.
    """
    torch.get_num_threads()  # torch's lazy per-thread initialisation, before ours
    path = _openmp_runtime()
    if path is None:
        return False
    try:
        runtime = ctypes.CDLL(path)
        runtime.omp_set_num_threads(ctypes.c_int(1))
    except (OSError, AttributeError):
        return False
    return True
