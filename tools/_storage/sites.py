"""``bench_storage.py sites``: many small sites through the saver, against plain h5py and
``os.write``, then the time to open the file and list its sites.

``--instructions`` counts instead of timing: the saver and plain h5py each write the same
records in a child process of their own (``bench_storage.py --_sites-child``) under
callgrind, instrumented for that write only (after a warm-up run on a few sites that
imports and caches what both need), all threads counted.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import handshake, instructions, need_callgrind, rotated, versions

from _storage import GATHER

_COMMAND = Path(__file__).resolve().parent.parent / "bench_storage.py"
_WARM_SITES = 4  # sites of the warm-up run of --instructions


def _sites_raw(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """The floor: every record's bytes through ``os.write``, one file, one write a record."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(0, steps, gather):
            for site in range(sites):
                for step in range(gather):
                    os.write(fd, records[(site + step) % len(records)])
    finally:
        os.close(fd)


def _sites_h5py(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """What a user would write by hand: one chunked dataset a site, resized and written each
    gather, a flush after each gather (the datasets stay open)."""
    import h5py
    import numpy as np

    width = len(records[0])
    with h5py.File(path, "w", libver="latest") as handle:
        datasets = [
            handle.create_dataset(
                f"site{site}",
                (0, width),
                np.float32,
                maxshape=(None, width),
                chunks=(gather, width),
            )
            for site in range(sites)
        ]
        handle.swmr_mode = True
        for start in range(0, steps, gather):
            for site, dataset in enumerate(datasets):
                block = np.stack([records[(site + step) % len(records)] for step in range(gather)])
                dataset.resize(start + gather, axis=0)
                dataset[start : start + gather] = block
            handle.flush()


def _sites_saver(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """The saver, called as the tracer calls it: one call a site a gather, a flush a gather."""
    from vartrace.storage import H5PYSaverCallback
    from vartrace.trace import Trace

    names = [f"layers.{site}.forward.x" for site in range(sites)]
    with H5PYSaverCallback(path, overwrite=True, metadata=False) as saver:
        for start in range(0, steps, gather):
            for site, name in enumerate(names):
                trace = Trace()
                for step in range(start, start + gather):
                    record = records[(site + step) % len(records)]
                    trace.append(record, step + 1, 0, step * sites + site)
                saver(name, trace)
            saver.flush()


def _open_and_list(path: Path) -> float:
    """Seconds ``vartrace.open(path)`` and its ``names`` take (the run closed after)."""
    import vartrace

    start = time.perf_counter()
    with vartrace.open(path) as run:
        _ = run.names
        return time.perf_counter() - start


_Contender = Callable[[Path, list[Any], int, int, int], None]
_CONTENDERS: dict[str, _Contender] = {
    "raw os.write": _sites_raw,
    "plain h5py": _sites_h5py,
    "vartrace saver": _sites_saver,
}


def _records() -> list[Any]:
    """The 16 float32 records of 4 KiB the sites take turns writing."""
    import numpy as np

    generator = np.random.default_rng(0)
    return [generator.standard_normal(1024).astype(np.float32) for _ in range(16)]


def sites_child(name: str, sites: int, steps: int) -> None:
    """A contender's side of :func:`bench_sites_instructions`, under callgrind: a warm-up
    run on a few sites, then the measured run between two handshakes."""
    import gc

    records = _records()
    with tempfile.TemporaryDirectory() as folder:
        _CONTENDERS[name](Path(folder) / "warm.bin", records, _WARM_SITES, GATHER * 2, GATHER)
        gc.collect()
        handshake()
        _CONTENDERS[name](Path(folder) / "sites.bin", records, sites, steps, GATHER)
        handshake()


def bench_sites_instructions(sites: int, steps: int) -> str:
    """Instructions (callgrind's Ir, all threads) of the saver and of plain h5py writing
    ``sites`` sites x ``steps`` records of 4 KiB, each contender in a child process."""
    need_callgrind(control=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    names = ["plain h5py", "vartrace saver"]
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, name in enumerate(names):
            argv = [str(_COMMAND), "sites", "--_sites-child", name, str(sites), str(steps)]
            counts[name] = instructions(argv, Path(folder) / f"callgrind.{index}", env, True)
    records = sites * steps
    lines = [
        f"sites --instructions: {sites} sites x 4 KiB float32 records x {steps} steps, gather "
        f"every {GATHER} steps, flush a gather; callgrind Ir, all threads; {versions()}",
        f"{'contender':<16} {'M instr':>10} {'vs h5py':>8} {'k instr a record':>17}",
    ]
    for name in names:
        lines.append(
            f"{name:<16} {counts[name] / 1e6:10.1f} {counts[name] / counts[names[0]]:7.3f}x "
            f"{counts[name] / records / 1e3:17.1f}"
        )
    return "\n".join(lines)


def bench_sites(sites: int, steps: int, rounds: int) -> str:
    """``sites`` sites of one 4 KiB float32 record a step, ``steps`` steps gathered every
    :data:`GATHER`: wall and CPU time of the saver against plain h5py and ``os.write``;
    then the time to open the saver's file and list its sites (``vartrace.open(path).names``)."""
    records = _records()
    contenders = _CONTENDERS
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    listing: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        names = list(contenders)
        for round_ in range(rounds):
            for name in rotated(names, round_):
                path = Path(folder) / "sites.bin"
                start, used = time.perf_counter(), time.process_time()
                contenders[name](path, records, sites, steps, GATHER)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - used)
                if name == "vartrace saver":
                    listing.append(_open_and_list(path))
                path.unlink()
    count = sites * steps
    lines = [
        f"sites: {sites} sites x 4 KiB float32 records x {steps} steps ({count} records), "
        f"gather every {GATHER} steps, flush a gather; min / median / max of {rounds} rounds "
        "(contenders rotate)",
        f"{'contender':<16} {'wall s':>24} {'vs h5py':>21} {'CPU a record':>16}",
    ]
    base = [f(wall["plain h5py"]) for f in (min, statistics.median, max)]
    for name in names:
        spread = [f(wall[name]) for f in (min, statistics.median, max)]
        per = min(cpu[name]) / count * 1e6, statistics.median(cpu[name]) / count * 1e6
        lines.append(
            f"{name:<16} {' / '.join(f'{t:6.2f}' for t in spread)} "
            f"{' / '.join(f'{t / b:5.2f}' for t, b in zip(spread, base, strict=True))}x "
            f"{per[0]:6.0f} / {per[1]:4.0f} µs"
        )
    opened = " / ".join(f"{f(listing):.3f}" for f in (min, statistics.median, max))
    lines.append(f"vartrace.open(path).names of the saver's file: {opened} s (min / median / max)")
    return "\n".join(lines)
