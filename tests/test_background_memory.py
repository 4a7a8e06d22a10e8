"""Host memory of `background=True` with a writer slower than the step (issue 34 item 5).

The tracer waits, record by record, for the saver's thread to write as many bytes of
the previous gathers as it is about to keep: the records held add up to one gather,
not the gather being written and the next one.  Measured in fresh processes of
`tools/bench_host_memory.py` (see `tests/test_peak_memory.py`), with gzip, so that
writing a record takes several steps; the file then holds what the foreground writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from tests._peak import host_memory_bench
from vartrace import H5PYSaverCallback, ModelTracer, _memory

_RECORD, _EVERY, _STEPS = 30 << 20, 4, 8  # the second gather fills while the first is written


@pytest.mark.skipif(
    _memory._malloc_trim() is None or not Path("/proc/self/clear_refs").exists(),
    reason="glibc and Linux's reset of the peak resident size only",
)
def test_a_background_writer_slower_than_the_step_holds_about_one_gather() -> None:
    # Measured 1.40 chunks in each of three processes of 12 steps; 2.40 when the next gather
    # filled while the previous one was written (two chunks and the step's own output).
    bench = host_memory_bench()
    peaks = [
        bench.peak_above_start("background", _RECORD, _EVERY, _STEPS, False, "gzip")
        for _ in range(2)
    ]
    chunks = [peak / (_EVERY * _RECORD) for peak in peaks]
    assert min(chunks) < 1.8, f"peaks {chunks} chunks of 120 MiB above the start"


class _Big(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0001


def _trace(path: Path, *, background: bool) -> None:
    model, x = _Big(), torch.arange(float(5 << 20)) / (5 << 20)  # 20 MiB records
    saver = H5PYSaverCallback(path, background=background, metadata=False, compression="gzip")
    with (
        saver,
        ModelTracer(model, ["forward"], gathering_interval=2, post_gather_callbacks=[saver]),
    ):
        for _ in range(7):
            x.add_(1.0)
            model(x)


def test_a_background_saver_that_makes_the_step_wait_writes_the_foregrounds_records(
    tmp_path: Path,
) -> None:
    _trace(tmp_path / "foreground.h5", background=False)
    _trace(tmp_path / "background.h5", background=True)
    with (
        vartrace.open(tmp_path / "foreground.h5") as expected,
        vartrace.open(tmp_path / "background.h5") as run,
    ):
        site = "forward"
        assert run[site].iterations.tolist() == expected[site].iterations.tolist() == [*range(1, 8)]
        for iteration in range(1, 8):
            assert np.array_equal(
                np.asarray(run[site].get(iteration)), np.asarray(expected[site].get(iteration))
            )


class _Undetachable(torch.Tensor):
    """A tensor whose encoding fails on the writer thread (see tests/test_storage_tracer.py)."""

    @staticmethod
    def __new__(cls) -> _Undetachable:
        return torch.ones(3).as_subclass(cls)

    def detach(self) -> torch.Tensor:
        raise RuntimeError("this tensor cannot be detached")


def test_a_step_waiting_for_room_goes_on_when_the_writer_fails(tmp_path: Path) -> None:
    from vartrace.storage import WorkerError
    from vartrace.trace import Trace

    saver = H5PYSaverCallback(tmp_path / "run.h5", background=True, metadata=False)
    big = [torch.zeros(20 << 20) for _ in range(4)]  # 320 MiB: over the 64 MiB floor
    saver("x", Trace(big, [1, 2, 3, 4], [0] * 4, [0, 1, 2, 3]))
    saver("y", Trace([_Undetachable()], [4], [0], [4]))  # fails after x's records
    del big
    saver.flush()
    saver.make_room(320 << 20)  # waits while x's records are written, returns on the failure
    with pytest.raises(WorkerError, match="background job failed"):
        saver.close()
