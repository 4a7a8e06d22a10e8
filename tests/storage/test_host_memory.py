"""Host memory of large records given back once written (issue 34 item 5).

glibc keeps freed blocks of 10-100 MB in its heap once its mmap threshold rose to
their size: without `malloc_trim` after a gather, a process writing 30 MiB records
stays 2-6 chunks larger than before the run.  Run in a fresh process, so that
the heap holds only this run's blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vartrace._support import memory as _memory

pytestmark = pytest.mark.skipif(
    _memory._malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)"
)

_RUN = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    from vartrace import H5PYSaverCallback, ModelTracer

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    class Big(nn.Module):
        def forward(self, x):
            return x * 1.0001

    model, x = Big(), torch.randn(30 * 2**20 // 4)  # a 30 MiB record a step
    for _ in range(3):
        model(x)
    saver = H5PYSaverCallback(sys.argv[1], background=sys.argv[2] == "background")
    before = resident()
    with ModelTracer(model, ["forward"], gathering_interval=4, post_gather_callbacks=[saver]):
        for step in range(12):
            x.add_(1e-3)
            model(x)
    saver.close()
    print((resident() - before) / (4 * 30 * 2**20))
    """
)


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_the_memory_of_written_chunks_goes_back_to_the_system(tmp_path: Path, mode: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(tmp_path / "run.h5"), mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    chunks_kept = float(done.stdout.split()[-1])
    # Without malloc_trim: 2.3-5.7 chunks.  With it, 0.01-0.85 (the last record change
    # detection keeps, a quarter of a chunk, and what other threads' arenas hold at the time).
    assert chunks_kept < 1.0, f"{chunks_kept:.2f} chunks of 120 MiB still resident after the run"


@pytest.mark.parametrize(
    ("environment", "expected"), [({}, "True"), ({"MALLOC_MMAP_THRESHOLD_": "1"}, "False")]
)
def test_a_users_own_mmap_threshold_is_left_alone(
    environment: dict[str, str], expected: str
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from vartrace._support import memory as _memory; print(_memory.map_large_blocks())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **environment},
    )
    assert done.stdout.split() == [expected]
