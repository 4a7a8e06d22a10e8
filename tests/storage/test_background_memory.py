"""Host memory of `background=True` with a writer slower than the step (issue 34 item 5).

The tracer waits, record by record, for the saver's thread to write as many bytes of
the previous gathers as it is about to keep: the records held add up to one gather,
not the gather being written and the next one.  Measured in fresh processes of
`tools/bench_host_memory.py` (see `tests/storage/test_peak_memory.py`), with gzip, so that
writing a record takes several steps; the file then holds what the foreground writes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from tests._peak import host_memory_bench
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace._support import memory as _memory
from vartrace.trace import Trace

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


# A fresh process traces 30 MiB records (in chunks of 7.5 MiB) with background=True and
# prints the bytes that the malloc arenas of threads other than the main one ever held
# (glibc's malloc_info: each arena's largest size).
_ARENAS = textwrap.dedent(
    """
    import ctypes, sys
    import xml.etree.ElementTree as ET
    import torch
    from torch import nn
    from vartrace import H5PYSaverCallback, ModelTracer

    class Big(nn.Module):
        def forward(self, x):
            return x * 1.0001

    model, x = Big(), torch.randn(30 * 2**20 // 4)
    saver = H5PYSaverCallback(sys.argv[1], background=True, metadata=False)
    with ModelTracer(model, ["forward"], gathering_interval=4, post_gather_callbacks=[saver]):
        for _ in range(8):
            x.add_(1e-3)
            model(x)
    saver.close()
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    text, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(text), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    heaps = ET.fromstring(text.value).findall("heap")
    print(sum(
        int(heap.find("system[@type='max']").get("size")) for heap in heaps if heap.get("nr") != "0"
    ))
    """
)


@pytest.mark.skipif(_memory._malloc_trim() is None, reason="glibc's malloc_info only")
def test_the_writer_threads_own_malloc_arena_holds_no_chunk_of_records(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ARENAS, str(tmp_path / "run.h5")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    arenas = int(done.stdout.split()[-1])
    # Measured 0.5 MiB; 15.4 MiB while HDF5 copied each new chunk into a 7.5 MiB buffer
    # allocated on the writer thread (two of them kept by its arena: 0.13 chunk at the peak).
    assert arenas < 4 << 20, f"the other threads' malloc arenas reached {arenas / 2**20:.1f} MiB"


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_records_cut_in_several_chunks_round_trip(tmp_path: Path, background: bool) -> None:
    # above 8 MiB a record is cut in chunks: two whole ones, a whole one and one cut by
    # the record's edge, and a record whose chunks are not one piece of its memory
    generator = torch.Generator().manual_seed(0)
    sites = {
        "flat": [torch.randn(3 << 20, generator=generator) for _ in range(2)],
        "edge": [torch.randn(2305, 1024, generator=generator) for _ in range(2)],
        "strided": [torch.randn(1024, 2305, generator=generator).T for _ in range(2)],
        "bf16": [torch.randn(6 << 20, generator=generator).bfloat16() for _ in range(2)],
    }
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, background=background, metadata=False) as saver:
        for name, records in sites.items():
            saver(name, Trace(list(records), [1, 2], [0, 0], [0, 1]))
            saver.flush()
    with vartrace.open(path) as run:
        for name, records in sites.items():
            assert (
                len(run[name].values.chunks) > 1 and run[name].values.chunks[1:] != records[0].shape
            )
            for iteration, want in enumerate(records, 1):
                got = run[name].get(iteration)
                assert got.dtype == want.dtype and torch.equal(got, want), (name, iteration)


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
    """A tensor whose encoding fails on the writer thread (see
    tests/storage/test_storage_tracer.py)."""

    @staticmethod
    def __new__(cls) -> _Undetachable:
        return torch.ones(3).as_subclass(cls)

    def detach(self) -> torch.Tensor:
        raise RuntimeError("this tensor cannot be detached")


def test_a_step_waiting_for_room_goes_on_when_the_writer_fails(tmp_path: Path) -> None:
    from vartrace.storage import WorkerError

    saver = H5PYSaverCallback(tmp_path / "run.h5", background=True, metadata=False)
    big = [torch.zeros(20 << 20) for _ in range(4)]  # 320 MiB: over the 64 MiB floor
    saver("x", Trace(big, [1, 2, 3, 4], [0] * 4, [0, 1, 2, 3]))
    saver("y", Trace([_Undetachable()], [4], [0], [4]))  # fails after x's records
    del big
    saver.flush()
    saver.make_room(320 << 20)  # waits while x's records are written, returns on the failure
    with pytest.raises(WorkerError, match="background job failed"):
        saver.close()
