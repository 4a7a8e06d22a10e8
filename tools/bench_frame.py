"""Benchmark: `run.to_frame` of the seven summary statistics over a sharded run.

Writes the shards of a `--shards`-rank run (default 16) with the saver, as
`ModelTracer(gather=False)` writes them, about `--mib` MiB in all (default 256): per shard
and iteration, 8 float32 sites and 2 bfloat16 sites of 16 KiB records (64 x 64), and 8
sites of statistics records (`vartrace.stats(histogram=True)` of the float32 records).
Then it times `run.to_frame(["mean", "std", "var", "min", "max", "absmax", "norm"])`
(`--repeat` times, the median printed; the first, with cold imports, is not counted) in
this process, and with `--workers N` on a Dask `LocalCluster` of N single-thread worker
processes too (needs `pip install 'torch-vartrace[dask]'`), checking that both give the
same frame.  The CPU time of this process is printed beside the wall time in process: on a
busy machine it is the steadier of the two.  The bar (issue 43): at most 0.7x the time of
the record-by-record reader.

Usage::

    python tools/bench_frame.py                          # 16 shards, ~256 MiB
    python tools/bench_frame.py --mib 32 --repeat 1      # quick
    python tools/bench_frame.py --keep /tmp/frame-run    # keep the files (reused if there)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import vartrace
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import RunContext, Trace

STATS = ["mean", "std", "var", "min", "max", "absmax", "norm"]
FLOAT_SITES, BF16_SITES, STAT_SITES = 8, 2, 8
SIDE = 64  # records of SIDE x SIDE elements


def write_shards(folder: Path, shards: int, mib: float) -> None:
    """The `shards` shards of one run of about `mib` MiB under `folder`."""
    per_iteration = SIDE * SIDE * (4 * FLOAT_SITES + 2 * BF16_SITES) * shards
    iterations = max(1, round(mib * 2**20 / per_iteration))
    reducer = vartrace.stats(histogram=True)
    generator = torch.Generator().manual_seed(0)
    for rank in range(shards):
        saver = H5PYSaverCallback(folder / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=shards, sharded=True))
        order = 0
        for iteration in range(1, iterations + 1):
            sites: list[tuple[str, Any]] = []
            for site in range(FLOAT_SITES):
                value = torch.randn((SIDE, SIDE), generator=generator) * (site + 1)
                sites.append((f"blocks.{site}.forward.h", value))
                if site < STAT_SITES:
                    stats = reducer(f"blocks.{site}.stats", value, iteration)
                    sites.append((f"blocks.{site}.stats", stats))
            for site in range(BF16_SITES):
                value = torch.randn((SIDE, SIDE), generator=generator).bfloat16()
                sites.append((f"blocks.{site}.forward.bf16", value))
            for name, value in sites:
                saver(name, Trace([value], [iteration], [rank], [order]))
                order += 1
            saver.flush()
        saver.close()


def _seconds(run: Any, repeat: int, **options: Any) -> tuple[float, float, Any]:
    """The median wall and CPU seconds (of this process) of `repeat` to_frame calls (after
    one not counted), and the frame."""
    frame = run.to_frame(STATS, **options)
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        frame = run.to_frame(STATS, **options)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16, help="ranks of the run (16)")
    parser.add_argument("--mib", type=float, default=256, help="size of the run (256 MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls (3)")
    parser.add_argument("--keep", type=Path, help="write the shards here and keep them")
    parser.add_argument("--workers", type=int, default=0, help="also on a LocalCluster")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="vartrace-bench-frame-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if not any(folder.glob("run.rank*.h5")):
            write_shards(folder, args.shards, args.mib)
        size = sum(path.stat().st_size for path in folder.glob("run.rank*.h5")) / 2**20
        with vartrace.open(folder) as run:
            here, cpu, frame = _seconds(run, args.repeat)
            print(
                f"to_frame of {len(STATS)} statistics, {len(run.paths)} shards, {size:.0f} MiB, "
                f"{len(frame):,} rows: {here:.3f} s in process ({cpu:.3f} s CPU)"
            )
            if args.workers > 0:
                from distributed import Client, LocalCluster

                with (
                    LocalCluster(n_workers=args.workers, threads_per_worker=1) as cluster,
                    Client(cluster) as client,
                ):
                    there, _, on_dask = _seconds(run, args.repeat, scheduler=client)
                assert frame.equals(on_dask), "to_frame on the cluster differs from in process"
                print(f"{'':>{len('to_frame')}} on {args.workers} workers: {there:.3f} s")
    finally:
        if args.keep is None:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
