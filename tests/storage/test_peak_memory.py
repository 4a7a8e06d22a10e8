"""Peak host memory while large records are traced into HDF5 (issue 34 item 5).

Each measurement is a fresh process of `tools/bench_host_memory.py`: a model whose
step returns a new 30 MiB tensor runs 12 steps, untraced, or traced and gathered
every 4 steps (a chunk of 120 MiB) into `H5PYSaverCallback`; its peak resident
size (`VmHWM`, reset after the warm-up) is taken above its size before the steps.
The test bounds the traced peak above the untraced one, in chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._peak import host_memory_bench
from vartrace._support import memory as _memory

pytestmark = pytest.mark.skipif(
    _memory._malloc_trim() is None or not Path("/proc/self/clear_refs").exists(),
    reason="glibc and Linux's reset of the peak resident size only",
)

_RECORD, _EVERY, _STEPS = 30 << 20, 4, 12


@pytest.fixture(scope="module")
def untraced_peak() -> int:
    """The untraced step's peak above its start, in bytes: the least of three fresh
    processes (measured 0.00 chunk, and 0.50 in one process of six: two more outputs)."""
    bench = host_memory_bench()
    return min(bench.peak_above_start("untraced", _RECORD, _EVERY, _STEPS, False) for _ in range(3))


@pytest.mark.parametrize(
    ("mode", "bound"),
    [
        # Measured 1.27 chunks (the chunk and the step's own output, which the untraced
        # step keeps in a block of the heap), and 1.52 (one more record alive) in all three
        # processes once, with two test suites running beside them; 1.77-2.08 over three
        # processes when the step's outputs piled up in glibc's heap.
        ("foreground", 1.6),
        # Measured 1.27-1.28 (three processes, twice) since the writer thread writes records
        # cut in chunks from their own memory; 1.40-1.65 while HDF5 copied each chunk into a
        # 7.5 MiB buffer of its own, two of which the thread's malloc arena kept; 1.7-2.0
        # while the next gather filled beside the one written, 2.8-5.1 with a third chunk
        # queued and the written records held until their whole gather was written.  The
        # bound leaves room for one more record alive under load, as the foreground's does;
        # the arena's own test (tests/storage/test_background_memory.py) guards the 7.5 MiB buffers.
        ("background", 1.6),
    ],
)
def test_peak_host_memory_of_large_records_stays_near_the_chunk(
    untraced_peak: int, mode: str, bound: float
) -> None:
    # The least of three processes: one of them may keep one more record alive a while
    # (+0.25 chunk: 1.52 in one foreground process of five, before and after the fix).
    bench = host_memory_bench()
    peaks = [bench.peak_above_start(mode, _RECORD, _EVERY, _STEPS, False) for _ in range(3)]
    chunks = [(peak - untraced_peak) / (_EVERY * _RECORD) for peak in peaks]
    assert min(chunks) < bound, f"{mode}: peaks {chunks} chunks of 120 MiB above the untraced step"
