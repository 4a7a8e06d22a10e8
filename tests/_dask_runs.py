"""Sharded runs for the Dask tests, written shard by shard by the real saver.

Each rank's shard holds a float32 site and its alias, a site called twice an
iteration, ragged records, bfloat16, statistics rows (`vartrace.stats`) of
bfloat16 values, text and None records, and a site of rank 0 only.  Run as a
script it writes one shard and keeps its writer open (a live shard):
`python tests/_dask_runs.py FOLDER RANK WORLD`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

import vartrace
from vartrace.reduced import ReducedFrom
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import RunContext, Trace

ITERATIONS = 5
ALIAS, TARGET = "blocks.0.forward.h", "blocks.0.forward"
Key = tuple[str, int, int]  # (site, iteration, rank)


def _records(rank: int, iteration: int, seed: int) -> list[tuple[str, Any]]:
    """The (site, value) records of one rank's iteration, in capture order."""
    g = torch.Generator().manual_seed(seed * 10_000 + rank * 100 + iteration)
    found: list[tuple[str, Any]] = [
        ("embed", torch.randn(8, 16, generator=g)),
        (TARGET, torch.randn(16, 32, generator=g)),
        ("calls", torch.randn(4, generator=g)),
        ("ragged", torch.randn(iteration + rank, 3, generator=g)),
        ("bf16", torch.randn(4, 5, generator=g).to(torch.bfloat16)),
        ("stats", vartrace.stats()("stats", torch.randn(4, 8, generator=g).bfloat16(), iteration)),
        ("calls", torch.randn(4, generator=g)),
        ("note", f"step {iteration}" if iteration % 2 else None),
    ]
    if rank == 0:
        found.append(("rank0.only", torch.randn(3, generator=g)))
    return found


def write_shard(
    folder: Path,
    rank: int,
    world: int,
    *,
    seed: int = 0,
    perturb: Collection[Key] = (),
    drop: Collection[Key] = (),
    extra: bool = False,
    close: bool = True,
    **options: Any,
) -> H5PYSaverCallback:
    """Write `folder/run.rank<rank>.h5`: `perturb` adds 1 to records, `drop` leaves them
    out, `extra` adds a site; `close=False` leaves the writer open (flushed)."""
    folder.mkdir(parents=True, exist_ok=True)
    saver = H5PYSaverCallback(folder / "run.h5", metadata=False, **options)
    saver.on_start(RunContext(rank=rank, world_size=world, sharded=True))
    saver.alias(ALIAS, TARGET)
    order = 0
    for iteration in range(1, ITERATIONS + 1):
        for name, value in _records(rank, iteration, seed):
            order += 1
            if (name, iteration, rank) in drop:
                continue
            if (name, iteration, rank) in perturb:
                value = value + 1 if isinstance(value, torch.Tensor) else "changed"
            saver(name, Trace([value], [iteration], [rank], [order]))
            if name == "stats" and iteration == 1:
                saver.reduced("stats", ReducedFrom("bfloat16", (4, 8)))
        if extra:
            saver("extra", Trace([torch.ones(2)], [iteration], [rank], [order + 100]))
        saver.flush()
    if close:
        saver.close()
    return saver


def write_run(folder: Path, world: int, *, missing: Collection[int] = (), **options: Any) -> str:
    """Every shard of a `world`-rank run but those of `missing`; the run's glob."""
    for rank in range(world):
        if rank not in missing:
            write_shard(folder, rank, world, **options)
    return str(folder / "run.rank*.h5")


if __name__ == "__main__":
    write_shard(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), close=False)
    print("flushed", flush=True)
    time.sleep(600)
