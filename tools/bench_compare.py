"""Benchmark: ``vartrace.compare`` on two files against reading both files once with h5py.

Writes two runs with :class:`~vartrace.storage.writer.H5PYSaverCallback`
(default: 50 sites x 40 iterations of 256 KiB float32 records, about
500 MB each; the second run is the first plus small noise on every fifth
site from the middle iteration on), then alternates a plain h5py read of
every ``values`` dataset of both files with a full ``vartrace.compare`` of
them, so both see the same page-cache state, and prints the medians (wall
and CPU time), their ratios, and the min-median-max of the paired ratios
(each compare against the mean of the reads just before and after it).
The bar: compare takes under 1.5x the plain read (wall).  The CPU ratio
tells what the wall ratio would be on a machine with no core to spare.

``--instructions`` counts instead of timing (for an A/B of the engine on a busy
machine; about three minutes): a process under ``valgrind --tool=callgrind`` compares the
two runs once, another three times, and the difference, halved, is the instructions of one
compare (the imports and the first call's warm-up cancel out), within half a percent run
after run (the engine's two threads interleave differently).  Memory stalls, which the
count does not see, are what the wall-clock ratio adds; the plain read is not counted, as
valgrind swaps the C library's ``memcpy``, most of the read, for its own.

Usage::

    python tools/bench_compare.py                 # the bar's configuration
    python tools/bench_compare.py --sites 10 --iterations 8 --repeat 3   # quick
    python tools/bench_compare.py --instructions  # callgrind, 10 sites x 16 iterations
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from _harness import instructions, need_callgrind, parser

from vartrace import compare
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace


def write_runs(
    directory: Path, sites: int, iterations: int, record_kib: int, chunk: int
) -> tuple[Path, Path]:
    """Write run ``a.h5`` and its perturbed twin ``b.h5``; return their paths."""
    side = int(np.sqrt(record_kib * 1024 // 4))
    shape = (record_kib * 1024 // 4 // side, side)
    rng = np.random.default_rng(0)
    paths = (directory / "a.h5", directory / "b.h5")
    savers = [H5PYSaverCallback(p) for p in paths]
    order = 0
    for start in range(1, iterations + 1, chunk):
        its = list(range(start, min(iterations, start + chunk - 1) + 1))
        for k in range(sites):
            name = f"layers.{k}.block.forward.hidden"
            values = rng.standard_normal((len(its), *shape), dtype=np.float32)
            orders = [order + i * sites for i in range(len(its))]
            tags = (
                torch.tensor(its),
                torch.zeros(len(its), dtype=torch.long),
                torch.tensor(orders),
            )
            perturbed = values.copy()
            if k % 5 == 0:
                late = np.asarray(its) > iterations // 2
                noise = rng.standard_normal(perturbed[late].shape, dtype=np.float32) * 1e-4
                perturbed[late] += noise
            for saver, block in zip(savers, (values, perturbed), strict=True):
                saver(name, Trace(torch.from_numpy(block.copy()), *tags))
            order += 1
        order += (len(its) - 1) * sites
        for saver in savers:
            saver.flush()
    for saver in savers:
        saver.close()
    return paths


def read_all(paths: tuple[Path, ...]) -> tuple[float, float]:
    """(wall, CPU) seconds to read every ``values`` dataset of ``paths`` with plain h5py."""
    start, cpu = time.perf_counter(), time.process_time()
    for path in paths:
        with h5py.File(path, "r") as f:
            for group in f["vars"].values():
                group["values"][...]
    return time.perf_counter() - start, time.process_time() - cpu


def time_compare(paths: tuple[Path, Path]) -> tuple[float, float, object]:
    """(wall, CPU) seconds of a full comparison, and its report."""
    start, cpu = time.perf_counter(), time.process_time()
    report = compare(*paths, atol=1e-6, rtol=1e-5)
    return time.perf_counter() - start, time.process_time() - cpu, report


def count_instructions(paths: tuple[Path, Path], repeat: int, out: Path) -> int:
    """Instructions (callgrind's Ir) of a fresh process that compares ``paths`` ``repeat``
    times."""
    argv = [__file__, "--_child", str(repeat), *map(str, paths)]
    # BLAS's own threads would add their spinning, which varies from run to run.
    environment = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return instructions(argv, out, environment)


def bench_instructions(paths: tuple[Path, Path], directory: Path) -> None:
    """Print the instructions of one compare of both runs."""
    need_callgrind()
    once, thrice = (count_instructions(paths, n, directory / f"callgrind.{n}") for n in (1, 3))
    print(f"compare: {(thrice - once) / 2 / 1e6:.1f} M instructions (callgrind Ir, one call)")


def _child(repeat: int, paths: tuple[Path, Path]) -> None:
    for _ in range(repeat):
        compare(*paths, atol=1e-6, rtol=1e-5)


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--sites", type=int, default=50)
    arguments.add_argument("--iterations", type=int, default=40)
    arguments.add_argument("--record-kib", type=int, default=256)
    arguments.add_argument("--chunk", type=int, default=8, help="records per gather (writes)")
    arguments.add_argument("--repeat", type=int, default=5)
    arguments.add_argument("--dir", type=Path, default=None, help="where to write (default: temp)")
    arguments.add_argument(
        "--instructions", action="store_true", help="count instructions (callgrind) instead"
    )
    arguments.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = arguments.parse_args()
    if args._child:
        repeat, a, b = args._child
        _child(int(repeat), (Path(a), Path(b)))
        return
    if args.instructions:
        default = arguments.get_default
        sites = 10 if args.sites == default("sites") else args.sites
        iterations = 16 if args.iterations == default("iterations") else args.iterations
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            paths = write_runs(Path(tmp), sites, iterations, args.record_kib, args.chunk)
            print(f"2 runs of {sites} sites x {iterations} iterations x {args.record_kib} KiB")
            bench_instructions(paths, Path(tmp))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        paths = write_runs(Path(tmp), args.sites, args.iterations, args.record_kib, args.chunk)
        size = sum(p.stat().st_size for p in paths)
        print(
            f"wrote 2 runs: {args.sites} sites x {args.iterations} iterations x "
            f"{args.record_kib} KiB = {size / 2**20:.0f} MiB in all "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        read_all(paths)  # warm up: both measurements then see the same cache state
        reads, compares = [], []
        report = None
        for _ in range(args.repeat):
            reads.append(read_all(paths))
            *seconds, report = time_compare(paths)
            compares.append(seconds)
        reads.append(read_all(paths))
    read_s, read_cpu = (statistics.median(x) for x in zip(*reads, strict=True))
    compare_s, compare_cpu = (statistics.median(x) for x in zip(*compares, strict=True))
    speed = size / read_s / 2**30
    cores = os.cpu_count()
    print(f"machine: {cores} cores, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'':28s} {'wall':>9s} {'CPU':>9s}")
    print(f"{'h5py read of both files':28s} {read_s:8.3f}s {read_cpu:8.3f}s  ({speed:.2f} GiB/s)")
    print(f"{'vartrace.compare':28s} {compare_s:8.3f}s {compare_cpu:8.3f}s")
    print(
        f"ratio compare / read: {compare_s / read_s:.2f} wall, {compare_cpu / read_cpu:.2f} CPU"
        "  (bar: < 1.5 wall)"
    )
    paired = [
        c[0] / ((before[0] + after[0]) / 2)
        for c, before, after in zip(compares, reads, reads[1:], strict=False)
    ]
    print(
        f"paired wall ratios over {len(paired)} repeats: min {min(paired):.2f}, "
        f"median {statistics.median(paired):.2f}, max {max(paired):.2f}"
    )
    assert report is not None
    diverged = sum(1 for s in report.sites if s.status != "ok")
    print(
        f"report: ok={report.ok} first_divergence={report.first_divergence} "
        f"differing sites={diverged}"
    )


if __name__ == "__main__":
    main()
