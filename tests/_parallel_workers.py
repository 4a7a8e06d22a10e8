"""Scenarios of modern parallelism for ``tests/gathers/test_parallelism.py``.

Run by ``tests._dist_workers.entry`` (scenario ``"tests._parallel_workers:<name>"``) on
spawned gloo ranks; each returns what its rank saw, the ground truth from the model's
own hooks and tensors next to what vartrace recorded.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
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


class _ScaledWeight(_TwoLayers):
    """Binds `w`, a DTensor computed from `a.weight`, twice in its `forward` (for
    `forward.w@every`: each binding compared with the last, never by collectives)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a.weight * 2
        w = w + 1
        return self.b(torch.relu(self.a(x))) + 0 * w.to_local().sum()


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
    return parallelize_module(_ScaledWeight(), mesh, plan)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to_local().clone()


def _tp_train(model: nn.Module, truth: dict[str, list[torch.Tensor]] | None) -> list[float]:
    """`STEPS` SGD steps; with `truth`, each step's local shards from the model's own
    tensors, and each layer's output as its caller receives it: from hooks that run
    after tensor parallelism's output hooks (a local tensor; `b`'s all-reduced)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handles = []
    if truth is not None:
        for name in ("a", "b"):

            def hook(_: nn.Module, __: Any, output: torch.Tensor, name: str = name) -> None:
                truth[name].append(torch.Tensor.clone(output).detach())

            handles.append(getattr(model, name).register_forward_hook(hook))
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
            ModelTracer(
                model,
                [*TP_SITES, "forward.w@every"],
                post_gather_callbacks=[saver],
                staging=staging,
            ),
        ):
            warnings.simplefilter("always")
            found[f"losses-{staging}"] = _tp_train(model, truth)
        found[f"truth-{staging}"] = truth
        found[f"warnings-{staging}"] = [str(w.message) for w in seen if "DTensor" in str(w.message)]
    return found


ASSEMBLED_SITES = [
    "a.weight",
    "a.weight@grad",
    "a.bias",
    "b.weight",
    "b.weight@grad",
    "b.bias",
    "b.bias@grad",
    "a",
]


def _full_train(model: nn.Module, truth: dict[str, list[torch.Tensor]]) -> list[float]:
    """`STEPS` SGD steps of a model whose `a` keeps its DTensor output, with each site's
    whole tensor in `truth` (`full_tensor()`: a collective every rank runs alike)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def hook(_: nn.Module, __: Any, output: Any) -> None:
        truth["a"].append(output.full_tensor().detach().clone())

    handle = model.a.register_forward_hook(hook)
    losses = []
    for step in range(1, STEPS + 1):
        params = {name: p for name, p in model.named_parameters() if name in truth}
        for name, param in params.items():
            truth[name].append(param.full_tensor().detach().clone())
        opt.zero_grad()
        loss = model(torch.arange(8.0).reshape(2, 4) * step).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        for name, param in params.items():
            if f"{name}@grad" in truth:
                truth[f"{name}@grad"].append(param.grad.full_tensor().detach().clone())
        opt.step()
    handle.remove()
    return losses


def tensor_parallel_assembled(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Colwise `a` keeping its DTensor output (`use_local_output=False`), rowwise `b`
    (its bias `Replicate()`), `w` a DTensor bound twice (`forward.w@every`), traced
    into a file (both stagings), a file a rank
    (`gather=False`) and in memory: the
    whole tensors from `full_tensor()`, and rank 0's `vartrace.assemble` of the
    tracer's results."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import vartrace
    from vartrace import H5PYSaverCallback, ModelTracer

    found: dict[str, Any] = {}
    for kind in ("sync", "async", "shards", "memory"):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,))
        plan = {"a": ColwiseParallel(use_local_output=False), "b": RowwiseParallel()}
        model = parallelize_module(_ScaledWeight(), mesh, plan)
        truth: dict[str, list[torch.Tensor]] = {name: [] for name in ASSEMBLED_SITES}
        savers = [] if kind == "memory" else [H5PYSaverCallback(out / f"assembled-{kind}.h5")]
        staging = "async" if kind == "async" else "sync"
        with (
            warnings.catch_warnings(),
            ModelTracer(
                model,
                [*ASSEMBLED_SITES, "forward.w@every"],
                post_gather_callbacks=savers,
                staging=staging,
                gather=kind != "shards",  # "shards": each rank's file, its placements
            ) as tracer,
        ):
            warnings.simplefilter("ignore")  # the placements, named once a site
            found[f"losses-{kind}"] = _full_train(model, truth)
        for saver in savers:
            saver.close()
        found[f"truth-{kind}"] = truth
    if rank == 0:  # the in-memory results, gathered on rank 0
        results = tracer.results
        found["placements"] = results.placements
        found["assembled"] = {
            name: [
                vartrace.assemble(results[name if "." in name else f"{name}.forward"], step)
                for step in range(1, STEPS + 1)
            ]
            for name in [*ASSEMBLED_SITES, "forward.w@every"]
        }
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


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.tanh(h)


PIPE_SITES = ["forward.x", "forward.h"]
MICROBATCHES = 2


def _new_stage(rank: int) -> _Stage:
    torch.manual_seed(rank)
    return _Stage()


def _pipeline_train(
    rank: int,
    kind: str,
    module: _Stage,
    truth: dict[str, list[torch.Tensor]] | None,
    *,
    steps: int = STEPS,
    microbatches: int = MICROBATCHES,
    watch: Callable[[], None] = lambda: None,
) -> list[list[float]]:
    """`steps` steps of a two-stage schedule (`kind`: `"gpipe"` or `"1f1b"`) of
    `microbatches` microbatches, `module` this rank's stage; with `truth`, each
    microbatch's input and `h` from a hook, which then calls `watch`."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if truth is not None:

        def hook(_: nn.Module, args: Any, output: torch.Tensor) -> None:
            truth["forward.x"].append(args[0].detach().clone())
            truth["forward.h"].append(output.detach().clone())
            watch()

        module.lin.register_forward_hook(hook)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule = kinds[kind](stage, microbatches, loss_fn=lambda out, y: (out - y).pow(2).sum())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses: list[list[float]] = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        x = torch.arange(4.0 * microbatches).reshape(microbatches, 4) / 16 * step
        if rank == 0:
            schedule.step(x)
        else:
            found: list[torch.Tensor] = []
            schedule.step(target=torch.ones(microbatches, 4), losses=found)
            losses.append([loss.item() for loss in found])
        opt.step()
    return losses


def pipeline_schedules(rank: int, world: int, out: Path) -> dict[str, Any]:
    """GPipe and 1F1B without `optimizer=` (each microbatch's call an iteration), traced
    with the gathers on the training thread and with asynchronous staging."""
    from vartrace import H5PYSaverCallback, ModelTracer

    found: dict[str, Any] = {}
    for kind in ("gpipe", "1f1b"):
        found[f"untraced-{kind}"] = _pipeline_train(rank, kind, _new_stage(rank), None)
        for staging in ("sync", "async"):
            truth: dict[str, list[torch.Tensor]] = {name: [] for name in PIPE_SITES}
            key = f"{kind}-{staging}"
            stage = _new_stage(rank)
            with (
                warnings.catch_warnings(record=True) as seen,
                H5PYSaverCallback(out / f"{key}.h5") as saver,
                ModelTracer(stage, PIPE_SITES, post_gather_callbacks=[saver], staging=staging),
            ):
                warnings.simplefilter("always")
                found[f"losses-{key}"] = _pipeline_train(rank, kind, stage, truth)
            found[f"truth-{key}"] = truth
            found[f"warnings-{key}"] = [str(w.message) for w in seen]
    return found


def _join_train(
    rank: int,
    ddp: nn.Module,
    truth: dict[str, list[torch.Tensor]],
    *,
    steps: tuple[int, int] = (2, STEPS + 2),
    after: int = 0,
    watch: Callable[[str], None] = lambda phase: None,
    join: Any = None,
) -> list[float]:
    """Uneven inputs under `Join` (`join`, or a new one): rank 0 runs `steps[0]` steps,
    rank 1 `steps[1]`; then `after` steps on every rank, past the `Join`.  `watch` is
    called before each step with its phase (`"join"` or `"after"`)."""
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []

    def step(number: int) -> None:
        x = torch.arange(8.0).reshape(2, 4) * number + 100 * rank
        truth["forward.x"].append(x.clone())
        truth["a.weight"].append(ddp.module.a.weight.detach().clone())
        opt.zero_grad()
        loss = ddp(x).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        opt.step()

    with Join([ddp]) if join is None else join:
        for number in range(1, steps[rank] + 1):
            watch("join")
            step(number)
    for number in range(steps[rank] + 1, steps[rank] + after + 1):
        watch("after")
        step(number)
    return losses


def _join_ddp() -> nn.Module:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(_TwoLayers())


def join_uneven_inputs(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A traced `Join` with uneven inputs, the tracer outside it (both stagings), and a
    tracer started inside a `Join`, refused at its start."""
    from torch.distributed.algorithms.join import Join

    from vartrace import H5PYSaverCallback, ModelTracer

    sites = ["forward.x", "a.weight"]
    found: dict[str, Any] = {"untraced": _join_train(rank, _join_ddp(), {s: [] for s in sites})}
    for staging in ("sync", "async"):
        ddp = _join_ddp()
        truth: dict[str, list[torch.Tensor]] = {name: [] for name in sites}
        with (
            warnings.catch_warnings(record=True) as seen,
            H5PYSaverCallback(out / f"join-{staging}.h5") as saver,
            ModelTracer(ddp, sites, post_gather_callbacks=[saver], staging=staging),
        ):
            warnings.simplefilter("always")
            found[f"losses-{staging}"] = _join_train(rank, ddp, truth)
        found[f"truth-{staging}"] = truth
        found[f"warnings-{staging}"] = [str(w.message) for w in seen]
    ddp = _join_ddp()
    with Join([ddp]):
        try:
            ModelTracer(ddp, sites).start()
        except ValueError as error:
            found["refused"] = str(error)
    return found


def fsdp2_bf16(rank: int, world: int, out: Path) -> dict[str, Any]:
    """FSDP2 (`fully_shard`, a bf16 `MixedPrecisionPolicy`): what a parameter's records
    are (the unsharded bf16 compute copy, and the sharded fp32 `.grad` the optimizer
    uses), next to the full fp32 parameter and that `.grad` read in the step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from vartrace import ModelTracer

    torch.manual_seed(0)
    model = _TwoLayers()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.a, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truth: dict[str, list[torch.Tensor]] = {"full": [], "sharded_grad": []}
    with ModelTracer(model, ["a.weight", "a.weight@grad"]) as tracer:
        for step in range(1, STEPS + 1):
            truth["full"].append(model.a.weight.full_tensor().detach().clone())
            opt.zero_grad()
            model(torch.arange(8.0).reshape(2, 4) * step + rank).pow(2).sum().backward()
            truth["sharded_grad"].append(model.a.weight.grad.to_local().clone())
            opt.step()
    records = {name: tracer.results[name] for name in tracer.results} if rank == 0 else {}
    return {"truth": truth, "records": records}


FSDP_GRADS = ["a.weight", "a.bias", "b.weight"]


class _Checkpointed(_TwoLayers):
    """`a` under activation checkpointing (recomputed in the backward); a reentrant
    checkpoint's input requires grad, or its parameters would get none."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x.detach().requires_grad_(self.reentrant)
        return self.b(torch.relu(checkpoint(self.a, x, use_reentrant=self.reentrant)))


def _fsdp2_model(reentrant: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.a, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _fsdp2_train(model: nn.Module, rank: int, truth: dict[str, list] | None) -> list[float]:
    """`STEPS` SGD steps; with `truth`, each parameter's sharded `.grad` (its local shard
    and the whole tensor) read before the optimizer's step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    losses = []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss = model(torch.arange(8.0).reshape(2, 4) * step + rank).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        if truth is not None:
            for name in FSDP_GRADS:
                grad = params[name].grad
                truth[f"{name}@grad"].append(grad.to_local().clone())
                truth[f"{name}@grad whole"].append(grad.full_tensor().clone())
        opt.step()
    return losses


def fsdp2_sharded_grad(rank: int, world: int, out: Path) -> dict[str, Any]:
    """FSDP2 (`fully_shard`, a bf16 `MixedPrecisionPolicy`, `a` checkpointed): each
    parameter's `@grad` traced into a file (both stagings; and with `a` under a
    reentrant checkpoint, whose forward runs under `torch.no_grad()`: its parameters'
    `@grad` are watched when the backward recomputes it), next to the sharded fp32
    `.grad` the optimizer uses, read in the step."""
    from vartrace import H5PYSaverCallback, ModelTracer

    found: dict[str, Any] = {"untraced": _fsdp2_train(_fsdp2_model(), rank, None)}
    found["untraced-reentrant"] = _fsdp2_train(_fsdp2_model(reentrant=True), rank, None)
    sites = [f"{name}@grad" for name in FSDP_GRADS]
    for staging in ("sync", "async", "reentrant"):
        model = _fsdp2_model(reentrant=staging == "reentrant")
        truth: dict[str, list] = {f"{n}@grad{w}": [] for n in FSDP_GRADS for w in ("", " whole")}
        with (
            warnings.catch_warnings(record=True) as seen,
            H5PYSaverCallback(out / f"fsdp2-{staging}.h5") as saver,
            ModelTracer(
                model,
                sites,
                post_gather_callbacks=[saver],
                staging="async" if staging == "async" else "sync",
            ),
        ):
            warnings.simplefilter("always")
            found[f"losses-{staging}"] = _fsdp2_train(model, rank, truth)
        found[f"truth-{staging}"] = truth
        found[f"warnings-{staging}"] = [str(w.message) for w in seen]
    return found


class _Held:
    """What a tracer's records in memory come to while its gathers are held back: each
    chunk that leaves memory (a pre-gather callback: its records count) and the most of
    its records alive at once (weak references, counted when `count` is called)."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.most_alive = 0
        self._alive: list[weakref.ref[torch.Tensor]] = []

    def __call__(self, _: str, trace: Any) -> None:
        self.chunks.append(len(trace))
        self._alive.extend(weakref.ref(value) for value in trace.values)

    def count(self, *_: Any) -> None:
        alive = sum(ref() is not None for ref in self._alive)
        self.most_alive = max(self.most_alive, alive)


HELD_STEPS = 8
HELD_MICROBATCHES = 4


def pipeline_held_back(rank: int, world: int, out: Path) -> dict[str, Any]:
    """GPipe and 1F1B over `HELD_STEPS` steps of `HELD_MICROBATCHES` microbatches, each
    call an iteration whose gather is held back: what memory holds meanwhile, and the
    saver's file at the end."""
    from vartrace import H5PYSaverCallback, ModelTracer

    found: dict[str, Any] = {}
    shape = {"steps": HELD_STEPS, "microbatches": HELD_MICROBATCHES}
    for kind in ("gpipe", "1f1b"):
        found[f"untraced-{kind}"] = _pipeline_train(rank, kind, _new_stage(rank), None, **shape)
        truth: dict[str, list[torch.Tensor]] = {name: [] for name in PIPE_SITES}
        held = _Held()
        stage = _new_stage(rank)
        with (
            warnings.catch_warnings(record=True) as seen,
            H5PYSaverCallback(out / f"held-{kind}.h5") as saver,
            ModelTracer(
                stage, PIPE_SITES, post_gather_callbacks=[saver], pre_gather_callbacks=[held]
            ),
        ):
            warnings.simplefilter("always")
            found[f"losses-{kind}"] = _pipeline_train(
                rank, kind, stage, truth, watch=held.count, **shape
            )
        found[f"truth-{kind}"] = truth
        found[f"held-{kind}"] = (held.chunks, held.most_alive)
        found[f"warnings-{kind}"] = [str(w.message) for w in seen]
    return found


JOIN_STEPS = (2, 12)
AFTER_JOIN = 3


def _join_every_other(rank: int, out: Path, sites: list[str]) -> dict[str, Any]:
    """A tracer gathering every other iteration around a `Join` whose ranks ran 2 and 5
    steps, then `AFTER_JOIN` steps: the ranks' iteration counts differ by an odd number
    past the `Join`."""
    from vartrace import H5PYSaverCallback, ModelTracer

    shape = {"steps": (2, 5), "after": AFTER_JOIN}
    untraced = _join_train(rank, _join_ddp(), {s: [] for s in sites}, **shape)
    ddp = _join_ddp()
    truth: dict[str, list[torch.Tensor]] = {name: [] for name in sites}
    with (
        warnings.catch_warnings(record=True) as seen,
        H5PYSaverCallback(out / "join-every-other.h5") as saver,
        ModelTracer(ddp, sites, post_gather_callbacks=[saver], gathering_interval=2),
    ):
        warnings.simplefilter("always")
        losses = _join_train(rank, ddp, truth, **shape)
    return {
        "every-other": {"losses": losses, "untraced": untraced, "truth": truth},
        "warnings-every-other": [str(w.message) for w in seen],
    }


def join_held_back(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A `Join` of uneven inputs inside a tracer, then steps past it: what memory holds
    while the gathers are held back, whether they go on once the `Join` is over (the
    phase a post-gather callback ran in on rank 0), and a tracer started after a `Join`
    that ended (kept by a name, as a `Join` built before its `with` is)."""
    from torch.distributed.algorithms.join import Join

    from vartrace import H5PYSaverCallback, ModelTracer

    sites = ["forward.x", "a.weight"]
    shape = {"steps": JOIN_STEPS, "after": AFTER_JOIN}
    untraced = _join_train(rank, _join_ddp(), {s: [] for s in sites}, **shape)
    found: dict[str, Any] = {"untraced": untraced}
    ddp = _join_ddp()
    truth: dict[str, list[torch.Tensor]] = {name: [] for name in sites}
    held = _Held()
    phases: list[str] = ["join"]
    gathered_in: list[str] = []

    def watch(phase: str) -> None:
        phases.append(phase)
        held.count()

    with (
        warnings.catch_warnings(record=True) as seen,
        H5PYSaverCallback(out / "join-held.h5") as saver,
        ModelTracer(
            ddp,
            sites,
            pre_gather_callbacks=[held],
            post_gather_callbacks=[saver, lambda name, trace: gathered_in.append(phases[-1])],
        ),
    ):
        warnings.simplefilter("always")
        found["losses"] = _join_train(rank, ddp, truth, watch=watch, **shape)
        phases.append("stop")
    found["truth"] = truth
    found["held"] = (held.chunks, held.most_alive)
    found["gathered_in"] = gathered_in
    found["warnings"] = [str(w.message) for w in seen]

    found.update(_join_every_other(rank, out, sites))
    runs: dict[str, list[float]] = {}
    for traced in (False, True):
        ddp = _join_ddp()
        join = Join([ddp])
        losses = _join_train(rank, ddp, {s: [] for s in sites}, join=join)
        ended: dict[str, list[torch.Tensor]] = {name: [] for name in sites}
        even = {"steps": (0, 0), "after": STEPS, "join": contextlib.nullcontext()}
        if not traced:
            runs["untraced"] = losses + _join_train(rank, ddp, ended, **even)
            continue
        with (
            warnings.catch_warnings(record=True) as seen,
            H5PYSaverCallback(out / "after-join.h5") as saver,
            ModelTracer(ddp, sites, post_gather_callbacks=[saver]),
        ):
            warnings.simplefilter("always")
            runs["traced"] = losses + _join_train(rank, ddp, ended, **even)
        found["truth-after"] = ended
        found["warnings-after"] = [str(w.message) for w in seen]
    found["losses-after"], found["untraced-after"] = runs["traced"], runs["untraced"]
    return found


def join_phases(rank: int, world: int, out: Path) -> dict[str, Any]:
    """`join_live` of a joinable through the phases of its `Join`s: before, in the body,
    in `__exit__` (a join hook's post-hook runs there), after; a `Join` kept by a name,
    entered twice; one entered by an `ExitStack`."""
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook

    from vartrace.distributed.collisions import join_live

    seen: list[tuple[str, bool]] = []

    class _Hook(JoinHook):
        def post_hook(self, is_last_joiner: bool) -> None:
            seen.append(("exit", join_live(joinable)))

    class _Joinable(Joinable):
        def __init__(self) -> None:
            super().__init__()

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return _Hook()

        @property
        def join_device(self) -> torch.device:
            return torch.device("cpu")

        @property
        def join_process_group(self) -> Any:
            import torch.distributed as dist

            return dist.group.WORLD

    joinable = _Joinable()
    seen.append(("before", join_live(joinable)))
    with Join([joinable]):
        seen.append(("body", join_live(joinable)))
    seen.append(("after", join_live(joinable)))
    named = Join([joinable])
    seen.append(("built", join_live(joinable)))
    for _ in range(2):
        with named:
            seen.append(("body", join_live(joinable)))
        seen.append(("after", join_live(joinable)))
    with contextlib.ExitStack() as stack:
        stack.enter_context(Join([joinable]))
        seen.append(("body", join_live(joinable)))
    seen.append(("after", join_live(joinable)))
    return {"seen": seen}
