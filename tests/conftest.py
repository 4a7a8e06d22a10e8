"""Suite-wide settings. Kept torch-optional: the engine tests run where torch is absent."""

from __future__ import annotations

try:
    import torch
except ImportError:  # the torch-free engine environments (Python 3.12 / 3.13 in CI)
    torch = None  # type: ignore[assignment]

if torch is not None:
    # One intra-op thread per test process: on a shared 2-core machine, more threads only
    # contend with each other and with the multi-process tests.
    torch.set_num_threads(1)
