"""A module's output is what its caller receives: the value its forward hooks left (QAT's
fake quantization, a hook registered after the tracer started, a global module hook),
checked bit-exact against what the next layer receives."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from vartrace.tracing.tracer import ModelTracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=generator) for _ in range(3)]


def _received(module: nn.Module) -> list[torch.Tensor]:
    """What `module` receives as its first argument, call by call (a forward pre-hook)."""
    got: list[torch.Tensor] = []
    module.register_forward_pre_hook(lambda _, args: got.append(args[0].detach().clone()))
    return got


def _train(model: nn.Module, sites: list[str], during: object = None) -> ModelTracer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ModelTracer(model, sites, change_detection=False) as tracer:
        if callable(during):
            during()
        for x in _inputs():
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
    return tracer


def _bit_exact(recorded: list[torch.Tensor], received: list[torch.Tensor]) -> bool:
    return len(recorded) == len(received) == 3 and all(
        torch.equal(a, b) for a, b in zip(recorded, received, strict=True)
    )


def test_a_forward_hook_that_replaces_the_output_is_what_the_output_site_records() -> None:
    torch.manual_seed(0)
    model = Net()
    model.fc1.register_forward_hook(lambda _, args, out: out.round())
    received = _received(model.act)
    tracer = _train(model, ["fc1"])
    trace = tracer.results["fc1.forward"]
    assert trace.iterations == [1, 2, 3]
    assert _bit_exact(trace.values, received)


@pytest.fixture
def _global_hook() -> Iterator[None]:
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out * 2 if isinstance(module, nn.ReLU) else None
    )
    yield
    handle.remove()


@pytest.mark.usefixtures("_global_hook")
def test_hooks_registered_after_the_start_and_global_hooks_count_too() -> None:
    torch.manual_seed(0)
    model = Net()
    received = _received(model.fc2)
    late = _received(model.act)

    def register_late() -> None:
        model.fc1.register_forward_hook(lambda _, args, out: out - 1)

    tracer = _train(model, ["fc1", "act", "forward"], during=register_late)
    assert _bit_exact(tracer.results["fc1.forward"].values, late)
    assert _bit_exact(tracer.results["act.forward"].values, received)


def test_the_model_output_after_its_own_hook_keeps_its_iterations() -> None:
    torch.manual_seed(0)
    model = Net()
    got: list[torch.Tensor] = []
    model.register_forward_hook(lambda _, args, out: out + 100)

    def caller_sees() -> None:
        model.register_forward_hook(lambda _, args, out: got.append(out.detach().clone()))

    tracer = _train(model, ["forward"], during=caller_sees)
    trace = tracer.results["forward"]
    assert trace.iterations == [1, 2, 3]
    assert _bit_exact(trace.values, got)


def test_forward_called_directly_runs_no_hooks_and_records_its_return_value() -> None:
    torch.manual_seed(0)
    model = Net()
    model.fc1.register_forward_hook(lambda _, args, out: out + 1)
    x = _inputs()[0]
    with ModelTracer(model, ["fc1"], change_detection=False) as tracer:
        model(x)
        direct = model.fc1.forward(x)
    values = tracer.results["fc1.forward"].values
    assert len(values) == 2
    assert torch.equal(values[0], direct + 1) and torch.equal(values[1], direct)


def test_quantization_aware_training_records_the_fake_quantized_output() -> None:
    quantization = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    model = Net()
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        quantization.prepare_qat(model, inplace=True)
    assert model.fc1._forward_hooks  # the observer that fake-quantizes fc1's output
    received = _received(model.act)
    tracer = _train(model, ["fc1"])
    recorded = tracer.results["fc1.forward"].values
    assert _bit_exact(recorded, received)
    raw = model.fc1.forward(_inputs()[0])
    assert not torch.equal(raw, model.fc1(_inputs()[0]))  # the hook changes the value
