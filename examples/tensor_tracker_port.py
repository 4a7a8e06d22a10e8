"""Port of Graphcore's tensor_tracker: outputs and gradients of every module in a DataFrame.

tensor_tracker::

    with tensor_tracker.track(module) as tracker:
        module(inputs).backward()
    tracker.to_frame()          # name, type, grad, std

vartrace: name every submodule's output and its ``@grad``, then turn
``tracer.results`` into a DataFrame with a statistic column.  Unlike the
original, the same tracer also works over many training steps (one row per
record, tagged with its iteration) and can stream to HDF5.

Run: ``python examples/tensor_tracker_port.py``
"""

from __future__ import annotations

import torch
from torch import nn

import vartrace
from vartrace.analysis.sources import results_frame
from vartrace.tracing.tracer import ModelTracer


class Model(nn.Module):
    """The toy model of tensor_tracker's usage notebook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.project = nn.Linear(4, 4)
        self.unembed = nn.Linear(4, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.unembed(self.project(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(end_dim=-2), tokens.flatten())


def main() -> None:
    torch.manual_seed(100)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    modules = vartrace.sites_of_type(model, nn.Module)  # every submodule path
    paths = [*modules, *(f"{m}@grad" for m in modules)]
    with ModelTracer(model, paths, change_detection=False) as tracer:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randint(0, 10, (3, 5))).backward()
            optimizer.step()

    frame = results_frame(tracer.results, stat="std")
    frame["grad"] = frame["site"].str.endswith("@grad")
    frame["name"] = frame["site"].str.removesuffix("@grad").str.removesuffix(".forward")
    types = dict(model.named_modules())
    frame["type"] = [type(types[n]).__name__ for n in frame["name"]]
    frame = frame.sort_values(["iteration", "order"])
    columns = ["iteration", "name", "type", "grad", "shape", "std"]
    print(frame[columns].to_string(index=False))
    print()
    print("mean std per module over iterations:")
    print(frame.pivot_table(index="name", columns="grad", values="std").to_string())
    print(
        f"\n{len(frame)} records: {int(frame['grad'].sum())} gradients, "
        f"{int((~frame['grad']).sum())} outputs"
    )


if __name__ == "__main__":
    main()
