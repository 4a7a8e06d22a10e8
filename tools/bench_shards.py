"""Benchmark: opening a run of many small shards, with and without their manifests.

Writes the shards of an N-rank run (default 1,000) with the saver, as
`ModelTracer(gather=False)` writes them (`run.rank<r>.h5`, each with its `shard` attribute
and its manifest `run.rank<r>.h5.manifest.json`): 13 sites of small float32 records over
4 gathers a shard.  Then, in this process, it times `vartrace.open` of the directory,
`run.names`, `run.to_frame("mean")` and `run.close()` (every file open by then): once with
the manifests, then again with them deleted, and prints a small table with the ratios
(files / manifests: above 1, the manifests are faster).  With manifests the files are
opened by `to_frame` instead of by `open`: the total, not `to_frame` alone, compares the
two.  The bar (issue 43): open and list 1,000 shards with manifests in at most 1 s.

With `--workers N` (N > 0, needs `pip install 'torch-vartrace[dask]'`) it then times
`run.to_frame("mean")` and `vartrace.compare(run, run)` in this process and on a Dask
`LocalCluster` of N single-thread worker processes (`scheduler=client`), and checks that
both give the same frame and the same report.

Usage::

    python tools/bench_shards.py                    # 1,000 shards
    python tools/bench_shards.py --shards 100 --keep /tmp/shards   # quick, keeps the files
    python tools/bench_shards.py --workers 2        # and on a LocalCluster of 2 workers
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import vartrace
from vartrace.storage.manifest import MANIFEST_SUFFIX
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import RunContext, Trace

SITES = 13
GATHERS = 4


def write_shards(folder: Path, shards: int) -> None:
    """The `shards` shards of one run under `folder`, each with its manifest."""
    for rank in range(shards):
        saver = H5PYSaverCallback(folder / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=shards, sharded=True))
        order = 0
        for gather in range(GATHERS):
            for site in range(SITES):
                value = torch.full((8, 16), float(rank + gather + site))
                saver(f"blocks.{site}.forward.h", Trace([value], [gather + 1], [rank], [order]))
                order += 1
            saver.flush()
        saver.close()


def _timed(step: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = step()
    return time.perf_counter() - start, out


def measure(folder: Path) -> dict[str, float]:
    """Seconds of open, names, to_frame("mean") and close of the run in `folder`."""
    opened, run = _timed(lambda: vartrace.open(folder))
    listed, names = _timed(lambda: run.names)
    framed, frame = _timed(lambda: run.to_frame("mean"))
    closed, _ = _timed(run.close)
    assert len(names) == SITES and len(frame) == SITES * GATHERS * len(run.paths)
    return {
        "open": opened,
        "names": listed,
        "open+names": opened + listed,
        "to_frame": framed,
        "close": closed,
        "total": opened + listed + framed + closed,
    }


def on_cluster(folder: Path, workers: int) -> None:
    """Print to_frame and compare of the run in `folder`, in process and on a LocalCluster."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=workers, threads_per_worker=1, processes=True) as cluster,
        Client(cluster) as client,
        vartrace.open(folder) as run,
    ):
        frame_here, frame = _timed(lambda: run.to_frame("mean"))
        frame_there, frame_dask = _timed(lambda: run.to_frame("mean", scheduler=client))
        compare_here, report = _timed(lambda: vartrace.compare(run, run))
        compare_there, report_dask = _timed(lambda: vartrace.compare(run, run, scheduler=client))
    assert frame.equals(frame_dask), "to_frame on the cluster differs from in process"
    assert report.to_frame().equals(report_dask.to_frame()), "compare on the cluster differs"
    print(f"{'step':<12}{'in process':>12}{f'{workers} workers':>12}{'ratio':>9}")
    for step, here, there in (
        ("to_frame", frame_here, frame_there),
        ("compare", compare_here, compare_there),
    ):
        print(f"{step:<12}{here:>11.3f}s{there:>11.3f}s{here / there:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000, help="ranks of the run (1000)")
    parser.add_argument("--keep", type=Path, help="write the shards here and keep them")
    parser.add_argument(
        "--workers", type=int, default=0, help="also time on a LocalCluster of this many workers"
    )
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="vartrace-bench-shards-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        took, _ = _timed(lambda: write_shards(folder, args.shards))
        print(f"wrote {args.shards} shards of {SITES} sites x {GATHERS} gathers in {took:.1f} s")
        with warnings.catch_warnings():  # (the other ranks are missing from this one)
            warnings.simplefilter("ignore")
            with vartrace.open(folder / "run.rank0.h5") as run:  # imports warmed up
                run.to_frame("mean")
        manifests = measure(folder)
        for manifest in folder.glob(f"*{MANIFEST_SUFFIX}"):
            manifest.unlink()
        files = measure(folder)
        print(f"{'step':<12}{'manifests':>12}{'files':>12}{'ratio':>9}")
        for step, seconds in manifests.items():
            ratio = files[step] / seconds if seconds else float("inf")
            print(f"{step:<12}{seconds:>11.3f}s{files[step]:>11.3f}s{ratio:>8.1f}x")
        if args.workers > 0:
            on_cluster(folder, args.workers)
    finally:
        if args.keep is None:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
