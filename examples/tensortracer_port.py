"""Port of the TensorTracer README's three usages (single-process versions).

TensorTracer (``tensortrace``) traced ``forward`` / ``forward.x`` of a model
while it trained and offered three recipes; each maps to vartrace one to one:

1. stack the records with ``stack_padded_tensors`` as they are gathered
   (every 4 iterations) and read ``tracer.results`` at the end;
2. stream them into HDF5 with ``H5PYSaverCallback`` as they are gathered
   (every 2 iterations) and read them back with ``vartrace.open``;
3. reduce each gathered chunk to its mean over records and batch, so memory
   stays at one vector per gather (``reduce_chunk``).

The distributed (DDP) versions are in ``examples/ddp_tracing.py``.

Run: ``python examples/tensortracer_port.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import vartrace
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.tracing.callbacks import reduce_chunk, stack_padded_tensors
from vartrace.tracing.tracer import ModelTracer

BATCH, FEATURES, CLASSES, EPOCHS = 8, 10, 3, 2


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(60, FEATURES, generator=generator)  # 60 samples: the last batch has 4
    target = torch.randint(0, CLASSES, (60,), generator=generator)
    return DataLoader(TensorDataset(data, target), batch_size=BATCH, shuffle=False)


def train(tracer: ModelTracer, model: nn.Module) -> int:
    """The README's training loop; returns the number of iterations."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    with tracer:
        for _ in range(EPOCHS):
            model.train()
            for data, target in make_loader():
                optimizer.zero_grad()
                loss = loss_fn(model(data), target.long())
                loss.backward()
                optimizer.step()
                steps += 1
    return steps


def usage_1_stacked_results() -> None:
    torch.manual_seed(0)
    model = Classifier()
    tracer = ModelTracer(
        model,
        ["forward", "forward.x"],
        pre_gather_callbacks=[stack_padded_tensors],
        post_gather_callbacks=[stack_padded_tensors],
        post_trace_callbacks=[stack_padded_tensors],
        gathering_interval=4,
    )
    steps = train(tracer, model)
    x = tracer.results["forward.x"]
    print(f"1. stacked results after {steps} iterations")
    print(f"   forward.x values: tensor {tuple(x.values.shape)} (records, padded batch, features)")
    print(f"   true shapes of the last two records: {[tuple(s) for s in x.shapes[-2:]]}")
    print(f"   iterations: {x.iterations[:6].tolist()} ...")


def usage_2_hdf5(out: Path) -> None:
    torch.manual_seed(0)
    model = Classifier()
    path = out / "tensortracer_usage2.h5"
    saver = H5PYSaverCallback(path, overwrite=True)
    tracer = ModelTracer(
        model,
        ["forward", "forward.x"],
        post_gather_callbacks=[stack_padded_tensors, saver],
        gathering_interval=2,
    )
    train(tracer, model)
    print(f"2. streamed to {path.name}: dataset {saver.datasets['forward.x'].shape}")
    saver.close()
    with vartrace.open(path) as run:
        site = run["forward.x"]
        first, last_iteration = int(site.iterations[0]), int(site.iterations[-1])
        print(f"   read back: {len(site)} records, iterations {first}..{last_iteration}")
        last = site.get(last_iteration)
        print(f"   last record (exact shape): {tuple(last.shape)} {last.dtype}")


def usage_3_mean_per_gather() -> None:
    torch.manual_seed(0)
    model = Classifier()
    mean_over_batch = reduce_chunk(lambda records: torch.cat(records).float().mean(dim=0))
    tracer = ModelTracer(
        model,
        ["forward", "forward.x"],
        post_gather_callbacks=[mean_over_batch],
        post_trace_callbacks=[stack_padded_tensors],
        gathering_interval=4,
    )
    steps = train(tracer, model)
    x = tracer.results["forward.x"]
    print(f"3. one mean per gather: forward.x {tuple(x.values.shape)} for {steps} iterations")
    print(f"   (gathers end at iterations {x.iterations.tolist()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for the HDF5 file (default: temp)")
    args = parser.parse_args()
    usage_1_stacked_results()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        usage_2_hdf5(out)
    usage_3_mean_per_gather()


if __name__ == "__main__":
    main()
