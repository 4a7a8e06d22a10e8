"""Port of NeuronX TensorCapture: find where a float32 model departs from its float64 reference.

TensorCapture's workflow for accuracy debugging is: list the modules you
can capture, capture chosen modules' inputs and outputs, register extra
tensors by hand from inside the model, run the same inputs through a
reference and through the model under test, and find the first module
whose values diverge.  In vartrace:

- ``vartrace.list_sites(model, pattern)`` lists capturable sites;
- paths name module inputs (``blocks.*.forward.x``) and outputs (``blocks.*``);
- ``vartrace.record(name, value)`` registers a tensor by hand (a no-op when
  no tracer is active);
- ``vartrace.compare(reference, candidate)`` matches records and reports the
  first divergence in execution order.

Run: ``python examples/tensorcapture_port.py``
"""

from __future__ import annotations

import torch
from torch import nn

import vartrace
from vartrace import compare
from vartrace.tracing.tracer import ModelTracer

WIDTH, DEPTH = 64, 4


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.fc1(self.norm(x)))
        vartrace.record(f"manual.blocks.{self.index}.gelu_absmax", hidden.abs().amax())
        return x + self.fc2(hidden)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(i) for i in range(DEPTH)])
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        vartrace.record("manual.features", x)
        return self.head(x)


def capture(model: nn.Module, inputs: list[torch.Tensor]) -> ModelTracer:
    paths = ["blocks.*.forward.x", "blocks.*", "blocks.*.norm", "blocks.*.fc1", "head", "forward"]
    with ModelTracer(model, paths, mode="eval", change_detection=False) as tracer, torch.no_grad():
        for x in inputs:
            model(x.to(next(model.parameters()).dtype))
    return tracer


def main() -> None:
    torch.manual_seed(0)
    candidate = Model().eval()
    reference = Model().double().eval()
    reference.load_state_dict(candidate.state_dict())

    print("capturable sites (vartrace.list_sites):")
    print("  modules of blocks.0:      ", ", ".join(vartrace.list_sites(candidate, "blocks.0.*")))
    print(
        "  inputs/locals of forward: ",
        ", ".join(vartrace.list_sites(candidate, "blocks.0.forward.*")),
    )

    inputs = [torch.randn(16, WIDTH) * 3 for _ in range(3)]
    ref = capture(reference, inputs)
    test = capture(candidate, inputs)
    manual = sorted(n for n in test.results if n.startswith("manual."))
    print(f"\ncaptured {len(test.results)} sites; registered by hand: {', '.join(manual)}")

    exact = compare(ref, test, atol=0, rtol=0)
    print(f"\nbit-exact? {exact.ok}; first difference: {exact.first_divergence}")
    labels = ("float64 reference", "float32 model")
    report = compare(ref, test, atol=1e-5, rtol=1e-4, labels=labels)
    print(report)

    candidate.blocks[2].norm.eps = 0.5  # a bug: one LayerNorm with the wrong epsilon
    buggy = capture(candidate, inputs)
    report = compare(ref, buggy, atol=1e-5, rtol=1e-4, labels=("float64 reference", "buggy model"))
    site, iteration, _ = report.first_divergence
    print(
        f"\nwith a wrong LayerNorm eps in blocks.2: first divergence at {site} "
        f"(input {iteration}); {sum(s.status != 'ok' for s in report.sites)} sites differ"
    )


if __name__ == "__main__":
    main()
