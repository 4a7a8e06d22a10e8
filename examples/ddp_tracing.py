"""Tracing a DistributedDataParallel model: the TensorTracer README's DDP usages, in vartrace.

Runs on CPU with gloo, two ranks spawned by ``torch.multiprocessing``::

    python examples/ddp_tracing.py            # writes into a temporary directory
    python examples/ddp_tracing.py --out runs # keeps the HDF5 files in ./runs

Four runs of the same small DDP training, each showing one usage:

1. every gather interval, padded stacking: each rank stacks its records
   (``pre_gather``), rank 0 stacks the gathered chunk (``post_gather``) and the
   accumulated results (``post_trace``); the last batch of an epoch is smaller,
   so the records are ragged and ``trace.shapes`` keeps their true shapes;
2. the HDF5 saver: rank 0 streams every gathered chunk into ``ddp.h5``;
3. a mean-reduction callback: each rank collapses its chunk to the mean over
   records and batch before the gather, so one vector per rank travels;
4. shards (``gather=False``): every rank writes ``shards.rank<r>.h5`` itself and
   ``vartrace.open("shards.rank*.h5")`` reads them as one run.

Rank 0 prints what it read back.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, reduce_chunk, stack_padded_tensors

WORLD = 2
EPOCHS = 2
PATHS = ["forward", "forward.x"]


class SimpleModel(nn.Module):
    """Two linear layers; ``forward.x`` is its input, ``forward`` its output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _train(ddp: nn.Module, loader: DataLoader, sampler: DistributedSampler) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        ddp.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss_fn(ddp(data), target).backward()
            optimizer.step()


def _mean_over_records_and_batch(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values).float().mean(dim=0)


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(minutes=2),
    )
    try:
        _run(rank, Path(out))
        # The safe shutdown order on gloo: every rank done with its collectives (the
        # tracer's last gather included), then tear the group down, then exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(rank: int, out: Path) -> None:
    torch.manual_seed(0)
    # 100 samples per rank in batches of 8: the last batch of each epoch holds 4.
    dataset = TensorDataset(torch.randn(200, 16), torch.randint(0, 4, (200,)))
    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    ddp = DDP(SimpleModel())

    # 1. Gather every 4 iterations, padded stacking on each rank and on rank 0.
    stacking = [stack_padded_tensors]
    with ModelTracer(
        ddp,
        PATHS,
        pre_gather_callbacks=stacking,
        post_gather_callbacks=stacking,
        post_trace_callbacks=stacking,
        gathering_interval=4,
    ) as tracer:
        _train(ddp, loader, sampler)
    if rank == 0:
        x = tracer.results["forward.x"]
        ragged = sorted({tuple(s) for s in x.shapes})
        print(f"1. stacked forward.x: {tuple(x.values.shape)} (records x padded batch x features)")
        print(f"   ranks {sorted(set(x.ranks.tolist()))}, true shapes {ragged}")

    # 2. The HDF5 saver on rank 0: every gathered chunk is appended and flushed.
    with (
        H5PYSaverCallback(out / "ddp.h5") as saver,
        ModelTracer(
            ddp, PATHS, post_gather_callbacks=[stack_padded_tensors, saver], gathering_interval=2
        ),
    ):
        _train(ddp, loader, sampler)
    if rank == 0:
        with vartrace.open(out / "ddp.h5") as run:
            site = run["forward.x"]
            ranks = sorted(set(site.ranks.tolist()))
            print(f"2. ddp.h5 forward.x: values {site.values.shape}, ranks {ranks}")
            print(f"   iterations {min(site.iterations)}..{max(site.iterations)}")

    # 3. Mean over records and batch on each rank before every 4-iteration gather.
    mean = reduce_chunk(_mean_over_records_and_batch)
    with ModelTracer(
        ddp,
        ["forward.x"],
        pre_gather_callbacks=[mean],
        post_trace_callbacks=stacking,
        gathering_interval=4,
    ) as tracer:
        _train(ddp, loader, sampler)
    if rank == 0:
        means = tracer.results["forward.x"]
        print(f"3. mean of forward.x per rank and gather: {tuple(means.values.shape)}")
        print(f"   iterations {means.iterations.tolist()}")

    # 4. Shards: each rank writes its own file; no gather at all.
    with (
        H5PYSaverCallback(out / "shards.h5") as saver,
        ModelTracer(ddp, PATHS, post_gather_callbacks=[saver], gather=False),
    ):
        _train(ddp, loader, sampler)
    dist.barrier()
    if rank == 0:
        with vartrace.open(str(out / "shards.rank*.h5")) as run:
            site = run["forward"]
            print(f"4. shards read as one run: forward has {len(site.iterations)} records,")
            files = sorted(p.name for p in out.glob("shards*"))
            print(f"   ranks {sorted(set(site.ranks.tolist()))}, files {files}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory for the HDF5 files (default: temp)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        mp.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
