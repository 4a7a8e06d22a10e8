"""Sharded runs written by the saver (as `ModelTracer(gather=False)` writes them) for the
manifest, path and remote tests, and a check that two opened runs read the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from vartrace.storage import H5PYSaverCallback
from vartrace.trace import RunContext, Trace


def write_shard(folder: Path, rank: int, world: int, *, flushes: int = 3, **options: Any) -> Path:
    """Rank `rank`'s shard of a `world`-rank run under `folder`: float, ragged, bfloat16,
    string, None and int records over `flushes` gathers, and an alias."""
    saver = H5PYSaverCallback(folder / "run.h5", metadata=False, **options)
    saver.on_start(RunContext(rank=rank, world_size=world, sharded=True))
    order = 0
    for gather in range(flushes):
        iteration = gather + 1
        records = {
            "blocks.0.forward.x": [torch.full((2, 3), float(10 * rank + gather))],
            "blocks.0.forward.ragged": [torch.arange(float(gather + 1 + rank))],
            "blocks.1.forward.bf16": [torch.full((4,), 0.5 + gather, dtype=torch.bfloat16)],
            "blocks.1.forward.label": [f"rank {rank} gather {gather}"],
            "blocks.1.forward.maybe": [None if gather % 2 else 1.5 * rank],
            "step": [iteration * 100 + rank],
        }
        if rank == 0 and gather == flushes - 1:
            records["late.only_rank0"] = [torch.ones(1)]
        for name, values in records.items():
            saver(name, Trace(values, [iteration], [rank], [order]))
            order += 1
        if gather == 0:
            saver.alias("blocks.0.forward.x_alias", "blocks.0.forward.x")
        saver.flush()
    saver.close()
    return folder / f"run.rank{rank}.h5"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def assert_same_run(run: Any, other: Any) -> None:
    """Site for site, value for value, tag for tag: `run` reads what `other` reads."""
    assert run.names == other.names
    assert run.aliases == other.aliases and run.missing_ranks == other.missing_ranks
    assert len(run) == len(other)
    for name in run.names:
        site, same = run[name], other[name]
        assert len(site) == len(same), name
        for tag in ("iterations", "ranks", "order", "kinds", "shapes", "in_values"):
            assert np.array_equal(getattr(site, tag), getattr(same, tag)), (name, tag)
        assert site.dtype == same.dtype, name
        for index in range(len(site)):
            assert _same(site.record(index), same.record(index)), (name, index)
        values, held = site.values, same.values
        assert (values is None) == (held is None), name
        if values is not None and values.dtype.kind in "biufc":
            assert np.array_equal(values[:], held[:]), name
    frame, expected = run.to_frame(["mean", "max"]), other.to_frame(["mean", "max"])
    assert frame.equals(expected)
