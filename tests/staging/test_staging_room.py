"""Asynchronous staging with a background saver slower than the records: host memory stays
bounded, the staging thread waiting for the writer and the step for the records in flight.

Records staged from a device wait in slots of the host ring (bounded by `max_host_bytes`)
while they are in flight, in the chunk and queued to the saver's writer thread.  The
staging thread makes room for each record it keeps (`H5PYSaverCallback.make_room`, as
the step does on the CPU path), so that the chunk and the records queued to the writer add
up to the saver's bound: one gather (64 MiB at least).  Delivery then pauses, records in
flight pile up to `max_inflight_bytes`, and the step waits at admission.  Before, the next
chunk filled beside the gather being written: one gather more, past the ring into memory
of its own.  gzip makes the writer slower than the steps of the stand-in device.
"""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

import vartrace
from tests._env import run_script
from tests.staging.test_staging_costs import BLOCKS, COLUMNS, ROWS, _inputs, _model, _train
from vartrace import H5PYSaverCallback, ModelTracer

_RECORD = ROWS * COLUMNS * 4  # bytes of a record: 1 MiB
_EVERY = 16  # steps a gather: 64 MiB, the background saver's least bound
_GATHER = _EVERY * BLOCKS * _RECORD
_INFLIGHT = 8 << 20
_STEPS = 2 * _EVERY  # the second gather fills while the first is written


def _trace(
    saver: H5PYSaverCallback, *, max_inflight_bytes: int = 1 << 30, max_host_bytes: int = 1 << 30
) -> ModelTracer:
    """`_STEPS` steps of 4 records of 1 MiB, gathered every `_EVERY` steps into `saver`."""
    model = _model()  # seeds torch's generator: the inputs too are the same in each run
    inputs = _inputs(4)
    with (
        saver,
        ModelTracer(
            model,
            ["blocks.*"],
            post_gather_callbacks=[saver],
            gathering_interval=_EVERY,
            staging="async",
            max_inflight_bytes=max_inflight_bytes,
            max_host_bytes=max_host_bytes,
        ) as tracer,
    ):
        for step in range(_STEPS):
            _train(tracer, [inputs[step % 4]])
    return tracer


def test_a_background_saver_behind_the_records_holds_the_host_memory_within_its_bound(
    tmp_path: Path,
) -> None:
    # The chunk and the records queued to the writer: one gather; the records in flight
    # beside them; the ring 96 MiB.  Before, the next chunk filled beside the gather being
    # written (up to 136 MiB wanted): 33 of the 128 records overflowed, in three runs.
    held = max(_GATHER, 64 << 20) + _INFLIGHT
    saver = H5PYSaverCallback(
        tmp_path / "run.h5", metadata=False, background=True, compression="gzip"
    )
    with pytest.warns(RuntimeWarning, match="waited"):
        tracer = _trace(saver, max_inflight_bytes=_INFLIGHT, max_host_bytes=96 << 20)
    stats = tracer.staging_stats
    assert stats is not None
    assert stats.overflows == 0, stats
    assert stats.host_bytes_peak <= held + (1 << 20), stats  # and the changed-flags' slots
    assert stats.writer_wait_seconds > 0 and stats.waits > 0, stats
    assert stats.kept == _STEPS * BLOCKS, stats
    _trace(H5PYSaverCallback(tmp_path / "foreground.h5", metadata=False))
    with (
        vartrace.open(tmp_path / "foreground.h5") as expected,
        vartrace.open(tmp_path / "run.h5") as run,
    ):
        assert sorted(run) == sorted(expected) == [f"blocks.{i}.forward" for i in range(BLOCKS)]
        for site in expected:
            iterations = expected[site].iterations.tolist()
            assert run[site].iterations.tolist() == iterations == [*range(1, _STEPS + 1)]
            for iteration in iterations:
                assert np.array_equal(
                    np.asarray(run[site].get(iteration)),
                    np.asarray(expected[site].get(iteration)),
                )


_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from tests.staging.test_staging_costs import _inputs, _model, _train
    from vartrace import H5PYSaverCallback, ModelTracer

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    model = _model()
    inputs = _inputs(4)
    saver = H5PYSaverCallback(sys.argv[1], metadata=False, background=True, compression="gzip")
    with saver, ModelTracer(
        model, ["blocks.*"], post_gather_callbacks=[saver], gathering_interval=16,
        staging="async", max_inflight_bytes=8 << 20, max_host_bytes=96 << 20,
    ) as tracer:
        for step in range(48):
            _train(tracer, [inputs[step % 4]])
    stats = tracer.staging_stats
    waited = stats.writer_wait_seconds > 0
    print("failure", saver.failure.errno, "kept", stats.kept, "waited", waited)
    """
)


@pytest.mark.skipif(os.name != "posix", reason="RLIMIT_FSIZE needs a POSIX system")
def test_a_staging_thread_waiting_for_the_writer_goes_on_when_the_disk_is_full(
    tmp_path: Path,
) -> None:
    """The writer fails on the file-size limit while the staging thread waits for it to
    make room: the wait ends, the saver drops the later records, the tracer stops."""
    done = run_script(_FULL_DISK, str(tmp_path / "run.h5"))
    assert done.stdout.splitlines()[-1] == f"failure {errno.EFBIG} kept 192 waited True", (
        done.stdout
    )
    assert "writing the run file failed" in done.stderr, done.stderr
