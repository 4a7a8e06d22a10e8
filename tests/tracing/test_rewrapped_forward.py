"""A ``forward`` the program re-wraps while traced, decorated forwards, parametrized weights
(issue 32, items 1, 5 and 8).

Mixed precision set up inside the tracer (``accelerator.prepare``, ``Trainer(bf16=True)``)
rebuilds ``model.forward`` from ``model.forward.__func__``; a ``functools.wraps`` decorator
may take a keyword of its own; ``weight_norm`` / ``spectral_norm`` compute ``weight`` on
access.  Each runs in a small model here, and on the real library where it installs.
"""

from __future__ import annotations

import functools
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import vartrace
from tests._hf import tiny_llama
from vartrace import ModelTracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.relu()


def _recorded(tracer: ModelTracer) -> dict[str, list[int]]:
    return {name: trace.iterations for name, trace in tracer.results.items()}


@pytest.fixture
def fresh_accelerator_state() -> Iterator[None]:
    """accelerate keeps one process-wide state: an ``Accelerator`` made by an earlier test
    (``cpu=True`` without mixed precision) refuses another mixed precision."""
    state = pytest.importorskip("accelerate.state", reason="accelerate is not installed")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_mixed_precision_prepared_inside_the_tracer_records_the_root_forward(
    fresh_accelerator_state: None,
) -> None:
    import accelerate

    model = Net()
    with ModelTracer(model, ["forward.x", "forward.h", "lin.forward.input"]) as tracer:
        prepared = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
        for _ in range(2):
            prepared(torch.randn(2, 4))
    assert _recorded(tracer) == {
        "forward.x": [1, 2],
        "forward.h": [1, 2],
        "lin.forward.input": [1, 2],
    }
    assert tracer.results["forward.h"].values[0].dtype == torch.bfloat16, "under autocast"
    assert "forward" in vars(model), "accelerate's forward stays"


def test_a_forward_rebuilt_from_its_func_under_autocast_records() -> None:
    """The shape of accelerate's rebuild, without accelerate."""
    model = Net()
    with ModelTracer(model, ["forward.x", "forward.h"]) as tracer:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        model.forward = types.MethodType(autocast(model.forward.__func__), model)  # type: ignore[method-assign]
        model(torch.randn(2, 4))
    assert _recorded(tracer) == {"forward.x": [1], "forward.h": [1]}
    assert tracer.results["forward.h"].values[0].dtype == torch.bfloat16


def test_hf_trainer_with_bf16_records_the_root_forward() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    model = tiny_llama()
    torch.manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))}
        for _ in range(4)
    ]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            out,
            bf16=True,
            use_cpu=True,
            max_steps=2,
            per_device_train_batch_size=2,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        with ModelTracer(model, ["forward.input_ids", "forward.labels"]) as tracer:
            transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert _recorded(tracer) == {"forward.input_ids": [1, 2], "forward.labels": [1, 2]}


def test_a_forward_replaced_without_the_patch_is_named_as_the_reason() -> None:
    """A replacement that calls the class's function directly loses the sites: the warning
    says so, not 'a branch the run did not take'."""
    model = Net()
    with pytest.warns(UserWarning) as caught, ModelTracer(model, ["forward.x"]) as tracer:
        model.forward = types.MethodType(Net.forward, model)  # type: ignore[method-assign]
        model(torch.randn(2, 4))
    assert _recorded(tracer) == {}
    messages = [str(w.message) for w in caught if "recorded nothing" in str(w.message)]
    assert len(messages) == 1
    assert "<root>.forward was replaced on the module after the tracer started" in messages[0]
    assert "a method bound to Net.forward" in messages[0]
    assert "branch" not in messages[0]


def _with_keyword(function: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator taking a keyword of its own (``temperature``), hidden from ``function``."""

    @functools.wraps(function)
    def wrapper(self: nn.Module, *args: Any, temperature: float = 1.0, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs) / temperature

    return wrapper


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @_with_keyword
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(x)
        return h if mask is None else h * mask


def test_a_decorated_forward_called_with_the_decorators_keyword_runs_and_records() -> None:
    model = Scaled()
    x = torch.randn(2, 4)
    expected = model(x, temperature=2.0)
    with (
        pytest.warns(UserWarning, match=r"Scaled\.forward .* does not take \(temperature\)"),
        ModelTracer(model, ["forward.x", "forward.mask", "forward.h"]) as tracer,
    ):
        assert torch.equal(model(x, temperature=2.0), expected)
        model(x + 1, torch.ones(4), temperature=0.5)
    assert _recorded(tracer) == {"forward.x": [1, 2], "forward.h": [1, 2], "forward.mask": [1, 2]}
    first, second = tracer.results["forward.mask"].values
    assert first is None and torch.equal(second, torch.ones(4))


class Orthogonal(nn.Module):
    """A parametrization of one's own: the skew-symmetric part, exponentiated."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.matrix_exp(weight.triu(1) - weight.triu(1).T)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wn = parametrizations.weight_norm(nn.Linear(3, 3))
        self.sn = parametrizations.spectral_norm(nn.Linear(3, 3))
        self.own = parametrize.register_parametrization(nn.Linear(3, 3), "weight", Orthogonal())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.sn(self.wn(x)))


def test_parametrized_weights_record_the_value_the_module_computes() -> None:
    model = Normed()
    patterns = ["wn.weight", "sn.weight", "own.weight", "sn.weight@grad"]
    with ModelTracer(model, patterns, change_detection=False) as tracer:
        for _ in range(3):  # spectral_norm runs a power iteration at each training forward
            model(torch.randn(2, 3)).sum().backward()
    assert _recorded(tracer) == {
        "wn.weight": [1, 2, 3],
        "sn.weight": [1, 2, 3],
        "own.weight": [1, 2, 3],
        "sn.weight@grad": [1, 2, 3],
    }
    model.eval()  # spectral_norm reads its last power iteration, without a new one
    for name in ("wn", "sn", "own"):
        assert torch.equal(tracer.results[f"{name}.weight"].values[-1], getattr(model, name).weight)
    grad = tracer.results["sn.weight@grad"].values[-1]
    assert grad.shape == (3, 3) and grad.abs().sum() > 0


def test_parametrized_weights_are_listed_and_suggested() -> None:
    model = Normed()
    assert vartrace.list_sites(model, "*.weight") == ["wn.weight", "sn.weight", "own.weight"]
    with pytest.raises(ValueError, match=r"closest existing sites: wn\.weight"):
        ModelTracer(model, ["wn.wieght"])
    # The names of the older torch.nn.utils.weight_norm / spectral_norm.
    with pytest.raises(
        ValueError,
        match=r"closest existing sites: wn\.weight, wn\.parametrizations\.weight\.original0, "
        r"wn\.parametrizations\.weight\.original1 \(",
    ):
        ModelTracer(model, ["wn.weight_g"])
    with pytest.raises(
        ValueError,
        match=r"closest existing sites: sn\.weight, sn\.parametrizations\.weight\.original \(",
    ):
        ModelTracer(model, ["sn.weight_orig"])
    with pytest.raises(
        ValueError,
        match=r"wn\.weight is a parametrized tensor, computed by wn\.parametrizations\.weight "
        r".*\(wn\.parametrizations\.weight\.original\*\)",
    ):
        ModelTracer(model, ["wn.weight@entry"])


def test_parametrized_weight_tracing_keeps_the_run_bit_exact() -> None:
    torch.manual_seed(0)
    model, untraced = Normed(), Normed()
    untraced.load_state_dict(model.state_dict())
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["*.weight"]):
            traced = [model(x) for _ in range(3)]
    assert all(torch.equal(a, untraced(x)) for a in traced)
    u = "sn.parametrizations.weight.0._u"  # spectral_norm's power iteration: once a call
    assert torch.equal(model.state_dict()[u], untraced.state_dict()[u])
