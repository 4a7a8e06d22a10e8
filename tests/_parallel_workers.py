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


GROUP_SITES = ["forward.x", "a", "a.weight"]


def _group_train(model: nn.Module, rank: int, truth: dict[str, list[torch.Tensor]]) -> list[float]:
    """`STEPS` SGD steps on inputs of this rank's own; each step's values in `truth`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def hook(_: nn.Module, __: Any, output: torch.Tensor) -> None:
        truth["a"].append(output.detach().clone())

    handle = bare.a.register_forward_hook(hook)
    losses = []
    for step in range(1, STEPS + 1):
        x = torch.arange(8.0).reshape(2, 4) * step + 100 * rank
        truth["forward.x"].append(x.clone())
        truth["a.weight"].append(bare.a.weight.detach().clone())
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    handle.remove()
    return losses


def _pairs() -> list[Any]:
    """The groups of ranks {0, 1} and {2, 3} (made on every rank, as `new_group` asks)."""
    import torch.distributed as dist

    return [dist.new_group([0, 1]), dist.new_group([2, 3])]


def _traced_group(rank: int, path: Path, *, ddp: Any, group: Any, staging: str) -> dict:
    """One traced training of this rank's group, into `path` (the group's first rank's)."""
    from vartrace import H5PYSaverCallback, ModelTracer

    torch.manual_seed(0)
    model = _TwoLayers()
    traced = model if ddp is None else nn.parallel.DistributedDataParallel(model, process_group=ddp)
    truth: dict[str, list[torch.Tensor]] = {name: [] for name in GROUP_SITES}
    options = {"staging": staging, **({} if group is None else {"group": group})}
    with (
        H5PYSaverCallback(path) as saver,
        ModelTracer(traced, GROUP_SITES, post_gather_callbacks=[saver], **options),
    ):
        losses = _group_train(traced, rank, truth)
    return {"truth": truth, "losses": losses}


def model_on_two_of_four(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A DDP model on ranks 0 and 1 of 4; ranks 2 and 3 trace nothing and wait at the
    closing barrier of the default group."""
    pairs = _pairs()
    if rank >= 2:
        return {}
    return _traced_group(rank, out / "pair.h5", ddp=pairs[0], group=None, staging="sync")


def two_data_parallel_groups(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Two data-parallel groups, {0, 1} and {2, 3}, each tracing into its own file: DDP
    on each group (the tracer takes DDP's group), then a bare model with `group=` and
    asynchronous staging."""
    from vartrace import ModelTracer

    pairs = _pairs()
    mine = pairs[rank // 2]
    refused = ""
    try:
        ModelTracer(_TwoLayers(), GROUP_SITES, group=mine, gather="node")
    except ValueError as error:
        refused = str(error)
    return {
        "refused": refused,
        "ddp": _traced_group(
            rank, out / f"ddp{rank // 2}.h5", ddp=mine, group=None, staging="sync"
        ),
        "option": _traced_group(
            rank, out / f"option{rank // 2}.h5", ddp=None, group=mine, staging="async"
        ),
    }
