"""Scenarios of modern parallelism for ``tests/gathers/test_parallelism.py``.

Run by ``tests._dist_workers.entry`` (scenario ``"tests._parallel_workers:<name>"``) on
spawned gloo ranks; each returns what its rank saw, the ground truth from the model's
own hooks and tensors next to what vartrace recorded.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 3
TP_SITES = ["a.weight", "a.weight@grad", "b.weight", "b.weight@grad", "a", "b"]


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _tensor_parallel() -> nn.Module:
    """`a` column-wise and `b` row-wise over every rank (the same initial weights on each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    plan = {"a": ColwiseParallel(), "b": RowwiseParallel()}
    return parallelize_module(_TwoLayers(), mesh, plan)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to_local().clone()


def _tp_train(model: nn.Module, truth: dict[str, list[torch.Tensor]] | None) -> list[float]:
    """`STEPS` SGD steps; with `truth`, each step's local shards from the model's own
    tensors and from hooks that run before tensor parallelism's output hooks."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handles = []
    if truth is not None:
        for name in ("a", "b"):

            def hook(_: nn.Module, __: Any, output: torch.Tensor, name: str = name) -> None:
                truth[name].append(_local(output))

            handles.append(getattr(model, name).register_forward_hook(hook, prepend=True))
    losses = []
    for step in range(1, STEPS + 1):
        if truth is not None:
            for layer in ("a", "b"):
                truth[f"{layer}.weight"].append(_local(getattr(model, layer).weight))
        opt.zero_grad()
        loss = model(torch.arange(8.0).reshape(2, 4) * step).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        if truth is not None:
            for layer in ("a", "b"):
                truth[f"{layer}.weight@grad"].append(_local(getattr(model, layer).weight.grad))
        opt.step()
    for handle in handles:
        handle.remove()
    return losses


def tensor_parallel(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Colwise/rowwise `parallelize_module` traced (both stagings), into a file on rank
    0: every parameter, its `@grad` and each layer's output are DTensors."""
    from vartrace import H5PYSaverCallback, ModelTracer

    found: dict[str, Any] = {"untraced": _tp_train(_tensor_parallel(), None)}
    for staging in ("sync", "async"):
        model = _tensor_parallel()
        truth: dict[str, list[torch.Tensor]] = {name: [] for name in TP_SITES}
        path = out / f"tp-{staging}.h5"
        with (
            warnings.catch_warnings(record=True) as seen,
            H5PYSaverCallback(path) as saver,
            ModelTracer(model, TP_SITES, post_gather_callbacks=[saver], staging=staging),
        ):
            warnings.simplefilter("always")
            found[f"losses-{staging}"] = _tp_train(model, truth)
        found[f"truth-{staging}"] = truth
        found[f"warnings-{staging}"] = [str(w.message) for w in seen if "DTensor" in str(w.message)]
    return found
