"""``@grad`` sites inside activation-checkpointed regions, reentrant or not.

A reentrant checkpoint (``use_reentrant=True``) runs its forward under
``torch.no_grad()`` and recomputes it with grad enabled during backward: the
gradients recorded there must be those of the same model run without
checkpointing, bit for bit, tagged with the forward's iteration.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tests._hf import tiny_llama
from vartrace.tracing.tracer import ModelTracer

SITES = [
    "blocks.*@grad",  # module outputs
    "blocks.*.forward.h@grad",  # a local computed in the region
    "blocks.1.forward.x@grad",  # the region's input
    "blocks.0.forward.self.fc.weight@grad",  # a parameter used only in the region
    "head.forward.self.weight@grad",  # a parameter outside it
]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(self.norm(x)))
        return x + self.out(h)


class Net(nn.Module):
    """Two blocks, each checkpointed when ``reentrant`` is set (``None``: no checkpoint)."""

    def __init__(self, reentrant: bool | None, d: int = 8) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 4, generator=generator) for _ in range(count)]


def _train(reentrant: bool | None) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Three steps: one forward per backward, then two forwards summed into one backward
    (gradient accumulation), then one again; the records by site."""
    torch.manual_seed(0)
    model = Net(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = _inputs(4)
    with ModelTracer(model, SITES, change_detection=False) as tracer:
        for batches in (inputs[:1], inputs[1:3], inputs[3:]):
            optimizer.zero_grad()
            torch.stack([model(x).pow(2).mean() for x in batches]).sum().backward()
            optimizer.step()
    return {name: (trace.iterations, trace.values) for name, trace in tracer.results.items()}


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradients_in_a_checkpointed_region_equal_those_without(reentrant: bool) -> None:
    plain = _train(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointed = _train(reentrant)
    assert not [str(w.message) for w in caught if "vartrace" in str(w.message)]
    assert set(checkpointed) == set(plain)
    assert len(plain) == 7  # two outputs, two locals, the input, two parameters
    for name, (iterations, values) in plain.items():
        assert checkpointed[name][0] == iterations, name
        assert all(torch.equal(a, b) for a, b in zip(checkpointed[name][1], values, strict=True))
    # One record per backward for a parameter, tagged with the last forward before it.
    assert plain["blocks.0.forward.self.fc.weight@grad"][0] == [1, 3, 4]
    assert sorted(plain["blocks.0.forward.h@grad"][0]) == [1, 2, 3, 4]


def test_a_reentrant_region_never_recomputed_says_so() -> None:
    torch.manual_seed(0)
    model = Net(reentrant=True)
    sites = ["blocks.0.forward.h@grad", "blocks.0.forward.self.fc.weight@grad"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, sites) as tracer:
            model(_inputs(1)[0])  # no backward
    messages = [str(w.message) for w in caught if "no gradient is recorded" in str(w.message)]
    assert len(messages) == 2
    local, parameter = sorted(messages)
    assert "blocks.0.forward.h@grad: it was computed inside a reentrant activation" in local
    assert "fc.weight@grad: the parameter was used inside a reentrant activation" in parameter
    assert all("no backward recomputed it" in m for m in messages)
    assert not tracer.results


def _train_llama(reentrant: bool | None) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    model = tiny_llama()
    if reentrant is not None:
        kwargs = {"use_reentrant": reentrant}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    sites = [
        "model.layers.*@grad",
        "model.layers.*.mlp@grad",
        "model.layers.*.self_attn.forward.query_states@grad",
        "model.layers.0.self_attn.forward.self.q_proj.weight@grad",
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ModelTracer(model, sites, change_detection=False) as tracer:
        for _ in range(2):
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    return {name: (trace.iterations, trace.values) for name, trace in tracer.results.items()}


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_records_the_gradients_without_it(reentrant: bool) -> None:
    pytest.importorskip("transformers")
    plain = _train_llama(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointed = _train_llama(reentrant)
    assert not [str(w.message) for w in caught if "vartrace" in str(w.message)]
    assert set(checkpointed) == set(plain)
    assert len(plain) == 7
    for name, (iterations, values) in plain.items():
        assert checkpointed[name][0] == iterations == [1, 2], name
        assert all(torch.equal(a, b) for a, b in zip(checkpointed[name][1], values, strict=True))
