"""How often a 2-rank gloo run aborts at process-group teardown, with and without vartrace.

Usage::

    python tools/teardown_check.py --runs 40                 # every variant, 40 runs each
    python tools/teardown_check.py --runs 40 --variants traced-nobarrier

Each run forks two ranks that join a gloo group over 127.0.0.1, train a small
DDP model for a few steps (traced: ``forward.x`` and ``forward`` gathered to
rank 0 every 2 iterations and at exit; untraced: the same steps without a
tracer) and tear the group down, either at once (``nobarrier``: rank 0 may
still be unpacking the last gather when rank 1 closes its connections) or
after a ``dist.barrier()`` (``barrier``).  A run counts as ``hung`` when a
rank is still running at the deadline (it is killed), else as ``failed``
when a rank exits with a signal (``terminate called without an active
exception`` is SIGABRT, exit code -6) or a non-zero status.  The counts and
the exit codes of the runs that did not succeed are printed per variant as
JSON.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _harness import free_port, parser
from torch import nn

from vartrace import ModelTracer

VARIANTS = ("traced-nobarrier", "untraced-nobarrier", "traced-barrier", "untraced-barrier")
STEPS = 6
DEADLINE_S = 60.0


def _steps(ddp: nn.Module, rank: int) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        optimizer.zero_grad()
        ddp(torch.full((4, 8), float(rank + step))).sum().backward()
        optimizer.step()


def _rank(rank: int, port: int, variant: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        if variant.startswith("traced"):
            with ModelTracer(ddp, ["forward.input", "forward"], gathering_interval=2):
                _steps(ddp, rank)
        else:
            _steps(ddp, rank)
        if variant.endswith("-barrier"):
            dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _one_run(variant: str) -> tuple[list[int | None], bool]:
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, variant)) for r in range(2)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + DEADLINE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    hung = any(proc.is_alive() for proc in procs)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs], hung


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--runs", type=int, default=25, help="runs per variant")
    arguments.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = arguments.parse_args()
    counts: dict[str, dict[str, Any]] = {
        v: {"runs": 0, "failed": 0, "hung": 0, "exit_codes": {}} for v in args.variants
    }
    for _ in range(args.runs):
        for variant in args.variants:  # interleaved, so that machine load hits all alike
            codes, hung = _one_run(variant)
            entry = counts[variant]
            entry["runs"] += 1
            if hung or any(code != 0 for code in codes):
                entry["hung" if hung else "failed"] += 1
                key = ",".join(str(code) for code in codes)
                entry["exit_codes"][key] = entry["exit_codes"].get(key, 0) + 1
    print(json.dumps(counts, indent=2))


if __name__ == "__main__":
    main()
