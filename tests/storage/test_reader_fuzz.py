"""Reader fuzz: a few hundred damaged and crafted run files from a seeded generator.

Every case must end in a clear error (``ValueError``, ``OSError``, ``KeyError``, each
command's one-line message) or a completed read, within :data:`CASE_TIMEOUT_S`, with the
memory Python and numpy allocate for it under :data:`PEAK_LIMIT`, the worker's own peak
resident memory under :data:`RSS_LIMIT` (and its address space capped, see
tests/_reader_fuzz.py, so a runaway allocation fails instead of swapping).  A completed
read is checked against itself (shapes, dtypes, kinds, one row and one statistic per record,
the file equal to itself): see ``read_everything`` there.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace

SEED = 20241125
CASES = 300
CASE_TIMEOUT_S = 20.0
START_TIMEOUT_S = 180.0
#: What one case may allocate through Python and numpy: the reader's free read
#: (vartrace.storage.reader.FREE_READ_BYTES, 64 MiB) converted once to float64, and change.
PEAK_LIMIT = 200 << 20
RSS_LIMIT = 1 << 30


def _base(path: Path) -> None:
    """A genuine run holding every kind of record: ragged floats, bfloat16, scalars, a big
    int, None, str and bytes, with the full metadata."""
    with H5PYSaverCallback(path) as saver:
        ragged = [torch.randn(3, 2), torch.randn(4, 2), torch.randn(2, 2)]
        saver("x", Trace(ragged, [1, 2, 3], [0] * 3, [0, 3, 6]))
        saver("loss", Trace([0.5, 0.25, 2**80, None], [1, 2, 3, 3], [0] * 4, [1, 4, 7, 8]))
        saver("note", Trace(["a", b"bytes", "c"], [1, 2, 3], [0] * 3, [2, 5, 9]))
        saver("h", Trace([torch.ones(2, dtype=torch.bfloat16)] * 2, [1, 2], [0, 0], [10, 11]))


def _run_worker(tmp_path: Path, cases: int) -> tuple[list[dict], dict]:
    """The worker's record of each case, and its final line (its own peak memory)."""
    base = tmp_path / "base.h5"
    _base(base)
    work = tmp_path / "cases"
    work.mkdir()
    worker = Path(__file__).parents[1] / "_reader_fuzz.py"
    process = subprocess.Popen(
        [sys.executable, str(worker), str(base), str(work), str(SEED), str(cases)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    results: list[dict] = []
    started: dict = {}
    final: dict = {}
    try:
        while not final:
            # Until its first line the worker is starting (importing torch and h5py), which
            # a loaded machine can stretch past a case's time.
            timeout = CASE_TIMEOUT_S if started else START_TIMEOUT_S
            ready, _, _ = select.select([process.stdout], [], [], timeout)
            if not ready:
                if not started:
                    raise AssertionError(f"the worker did not start within {timeout:.0f} s")
                raise AssertionError(f"a case ran past {timeout:.0f} s: {started}")
            line = process.stdout.readline()
            if not line:
                raise AssertionError(f"the worker died: {process.stderr.read()[-3000:]}")
            record = json.loads(line)
            if "started" in record:
                started = record
            elif "done" in record:
                final = record
            else:
                results.append(record)
    finally:
        process.kill()
        process.wait(timeout=60)
    return results, final


def test_damaged_and_crafted_files_end_in_a_clear_error_or_a_read(tmp_path: Path) -> None:
    results, final = _run_worker(tmp_path, CASES)
    assert len(results) == CASES
    crashes = [r for r in results if r["outcome"] == "crash"]
    assert not crashes, json.dumps(crashes[:3], indent=1)
    heavy = [r for r in results if r["peak"] > PEAK_LIMIT]
    assert not heavy, json.dumps(heavy[:3], indent=1)
    assert final["peak_rss_kib"] * 1024 < RSS_LIMIT
    outcomes = {r["outcome"] for r in results}
    assert outcomes == {"read", "error"}, outcomes  # the generator makes both kinds
    refused = [r for r in results if "external" in " ".join(r["mutations"])]
    assert refused and not any("hunter2" in r["detail"] for r in results)


def test_the_worker_reports_its_own_peak_memory_not_the_suites(tmp_path: Path) -> None:
    """A suite grown past :data:`RSS_LIMIT` does not fail the fuzz test: on Linux a child's
    ``ru_maxrss`` keeps the high-water mark of the process it was started from."""
    ballast = np.ones(RSS_LIMIT + (128 << 20), np.uint8)  # touched: resident in this process
    try:
        _, final = _run_worker(tmp_path, 0)
    finally:
        del ballast
    assert 0 < final["peak_rss_kib"] * 1024 < RSS_LIMIT, final


@pytest.mark.xfail(
    strict=True,
    reason="HDF5 2.0 loops forever reading variable-length data from a damaged global heap "
    "collection (H5HG__cache_heap_deserialize, in C): no reader in the process can stop it",
)
def test_a_damaged_global_heap_collection_ends_in_time(tmp_path: Path) -> None:
    """The one damage the fuzz generator spares, kept in view: strict, this fails once HDF5
    no longer hangs there, and the generator's exclusion can go."""
    from tests._reader_fuzz import heap_collections

    path = tmp_path / "run.h5"
    _base(path)
    data = bytearray(path.read_bytes())
    start, end = heap_collections(bytes(data))[0]
    data[(start + end) // 2 : end] = bytes(end - (start + end) // 2)
    path.write_bytes(bytes(data))
    read = "import sys, vartrace\nwith vartrace.open(sys.argv[1]) as run: run.names, run.meta"
    try:
        subprocess.run([sys.executable, "-c", read, str(path)], timeout=15, capture_output=True)
    except subprocess.TimeoutExpired:
        pytest.fail("reading the file hangs")
