"""Code shapes met in real training code (issue 22): nested tensors, torch.func transforms,
optimizer wrappers, objects with ``__slots__``, pre-save callbacks returning structures.

Each test runs the shape of the real code in a small model of its own; where the real
library installs here (accelerate), a test runs it too, skipped with a reason without it.
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._models import TinyTransformer, tokens
from vartrace import H5PYSaverCallback, ModelTracer

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.filterwarnings("ignore:`torch.jit.(trace|script):DeprecationWarning"),
]


class Echo(nn.Module):
    """Returns what it is given, through a local."""

    def forward(self, value: Any) -> Any:
        held = value
        return held


def _every_key(function: Callable[..., Any], name: str, statement: str) -> str:
    """The `@every` key of `forward.<name>` bound by the line of `function` that starts
    with `statement` (found in the source it runs, so an edit that moves it moves the key)."""
    lines, first = inspect.getsourcelines(function)
    (found,) = [first + n for n, text in enumerate(lines) if text.strip().startswith(statement)]
    return f"forward.{name}@every:L{found}"


def _nested(scale: float, layout: torch.layout) -> torch.Tensor:
    parts = [torch.arange(6.0).view(2, 3) * scale, torch.arange(12.0).view(4, 3) * scale]
    return torch.nested.nested_tensor(parts, layout=layout)


# -- nested tensors ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_compared_by_components_and_stored(
    tmp_path: Path, layout: torch.layout
) -> None:
    model = Echo()
    first, changed = _nested(1.0, layout), _nested(2.0, layout)
    path = tmp_path / "run.h5"
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward", "forward.held@every"], post_gather_callbacks=[saver]),
    ):
        model(first)
        model(_nested(1.0, layout))  # equal components: not recorded again
        model(changed)
    held = _every_key(Echo.forward, "held", "held = value")
    with vartrace.open(path) as run:
        assert run["forward"].iterations.tolist() == [1, 3]
        assert [name for name in run if name.startswith("forward.held")] == [held]
        assert run[held].iterations.tolist() == [1, 3]
        got = run["forward"].get(iteration=3)
    assert got.is_nested
    for part, expected in zip(got.unbind(), changed.unbind(), strict=True):
        assert part.equal(expected)


def test_a_nested_tensor_differs_from_a_dense_one_of_the_same_values() -> None:
    model = Echo()
    nested = _nested(1.0, torch.strided)
    with ModelTracer(model, ["forward"]) as tracer:
        model(nested)
        model(torch.arange(6.0).view(2, 3))
        model(nested)
    assert tracer.results["forward"].iterations == [1, 2, 3]


def test_every_on_the_transformer_encoder_fast_path_records_its_nested_output() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad(), ModelTracer(encoder, ["forward.output@every"], mode="eval") as tracer:
        encoder(x, src_key_padding_mask=mask)
        encoder(x, src_key_padding_mask=mask)
    forward = nn.TransformerEncoder.forward
    (packed,) = tracer.results[_every_key(forward, "output", "output = torch._nested_")].values
    assert packed.is_nested  # the fast path ran: the input became a nested tensor
    assert packed.unbind()[1].shape == (3, 8)  # the padded positions are left out
    layers = tracer.results[_every_key(forward, "output", "output = mod(")]
    assert layers.iterations == [1, 1, 2, 2]  # each layer's output, two layers a call
    assert all(value.is_nested for value in layers.values)
    padded = tracer.results[_every_key(forward, "output", "output = output.to_padded_tensor(")]
    assert not padded.values[0].is_nested


# -- torch.func ------------------------------------------------------------------------------


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h * 2
        return h.sum()


def test_records_under_vmap_and_grad_are_plain_tensors_and_reach_the_file(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = Affine()
    x = torch.randn(4, 3)
    params = dict(model.named_parameters())
    path = tmp_path / "run.h5"
    with (
        warnings.catch_warnings(record=True) as caught,
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward.h", "forward.x"], post_gather_callbacks=[saver]),
    ):
        warnings.simplefilter("always")
        torch.func.vmap(model)(x)
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x[1],)))(params)
        torch.func.vmap(
            torch.func.grad(lambda p, xi: torch.func.functional_call(model, p, xi)),
            in_dims=(None, 0),
        )(params, x[:2] + 1)
    said = sorted(str(w.message) for w in caught if "torch.func" in str(w.message))
    assert len(said) == 2  # once per site, not once per record
    assert "forward.h is computed under torch.func.vmap" in said[0] and "(4, 2)" in said[0]
    with torch.no_grad():
        expected = model.lin(x) * 2
    with vartrace.open(path) as run:
        assert run["forward.h"].iterations.tolist() == [1, 2, 3]
        assert run["forward.x"].get(iteration=1).equal(x)
        assert run["forward.h"].get(iteration=1).equal(expected)  # the mapped dimension first
        assert run["forward.h"].get(iteration=2).equal(expected[1])
        assert run["forward.x"].get(iteration=3).equal(x[:2] + 1)


def test_every_under_nested_vmaps_puts_the_outer_mapped_dimension_first() -> None:
    model = Affine()
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))
    with (
        pytest.warns(UserWarning, match="2 mapped dimension"),
        ModelTracer(model, ["forward.h@every"]) as tracer,
    ):
        torch.func.vmap(torch.func.vmap(model, in_dims=1))(x)  # inner maps x's dimension 2
    with torch.no_grad():
        lin = model.lin(x.transpose(1, 2))  # (2, 5, 2): outer, inner, features
    (linear,) = tracer.results[_every_key(Affine.forward, "h", "h = self.lin(x)")].values
    (doubled,) = tracer.results[_every_key(Affine.forward, "h", "h = h * 2")].values
    assert len(tracer.results) == 2
    assert [v.shape for v in (linear, doubled)] == [(2, 5, 2), (2, 5, 2)]
    assert type(linear) is torch.Tensor and type(doubled) is torch.Tensor
    assert linear.equal(lin) and doubled.equal(lin * 2)


# -- optimizer wrappers --------------------------------------------------------------------


class Wrapped:
    """The shape of accelerate's AcceleratedOptimizer: subclasses nothing it initialises,
    holds the torch optimizer in ``.optimizer`` and skips the step on accumulation steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, every: int) -> None:
        self.optimizer = optimizer
        self.every = every
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.calls % self.every == 0:
            self.optimizer.zero_grad()


class SubclassWrapper(torch.optim.Optimizer):
    """A wrapper that is an Optimizer by class but never ran ``Optimizer.__init__``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)


def _accumulate(model: nn.Module, optimizer: Any, micro_batches: int) -> None:
    for batch in range(micro_batches):
        model(tokens(batch)).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("kind", ["attribute", "subclass"])
def test_an_optimizer_wrapper_counts_the_steps_of_the_optimizer_it_holds(kind: str) -> None:
    model = TinyTransformer()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapper = Wrapped(sgd, every=2) if kind == "attribute" else Wrapped(SubclassWrapper(sgd), 2)
    site = "layers.0.attn.forward.scores"
    with ModelTracer(model, [site], optimizer=wrapper, change_detection=False) as tracer:
        _accumulate(model, wrapper, 4)
    assert tracer.results[site].iterations == [1, 1, 2, 2]


def test_an_object_holding_no_optimizer_is_refused_naming_its_type() -> None:
    with pytest.raises(TypeError, match="not Wrapped"):
        ModelTracer(TinyTransformer(), ["head"], optimizer=Wrapped(None, 1))  # type: ignore[arg-type]


def test_accelerate_prepared_optimizer_numbers_iterations_by_real_steps() -> None:
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = TinyTransformer()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    site = "layers.0.attn.forward.scores"
    with ModelTracer(model, [site], optimizer=optimizer, change_detection=False) as tracer:
        for batch in range(6):
            with accelerator.accumulate(model):
                accelerator.backward(model(tokens(batch)).logits.sum())
                optimizer.step()
                optimizer.zero_grad()
    assert tracer.results[site].iterations == [1, 1, 2, 2, 3, 3]


# -- __slots__ and pre-save structures -------------------------------------------------------


class State:
    __slots__ = ("__private", "hidden", "steps")

    def __init__(self, hidden: torch.Tensor, private: torch.Tensor) -> None:
        self.hidden = hidden
        self.__private = private
        self.steps = 3


class MoreState(State):
    __slots__ = ("cell", "unset")


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> MoreState:
        state = MoreState(self.lin(x), x * 2)  # graph tensors: deepcopy refuses them
        state.cell = self.lin(x).tanh()
        return state


def test_an_object_with_slots_is_split_into_the_tensors_its_slots_hold() -> None:
    model = Recurrent()
    x = torch.randn(2, 3)
    with (
        pytest.warns(UserWarning, match="MoreState holding tensors"),
        ModelTracer(model, ["forward"]) as tracer,
    ):
        out = model(x)
    assert sorted(tracer.results) == ["forward._State__private", "forward.cell", "forward.hidden"]
    assert tracer.results["forward.hidden"].values[0].equal(out.hidden.detach())
    assert tracer.results["forward.cell"].values[0].equal(out.cell.detach())
    assert tracer.results["forward._State__private"].values[0].equal(x * 2)


def test_a_pre_save_callback_returning_a_dict_of_graph_tensors_gives_leaves(
    tmp_path: Path,
) -> None:
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)

    def summary(name: str, value: torch.Tensor, iteration: int) -> Any:
        return {"mean": value.mean(), "extremes": (value.max(), value.min())}

    path = tmp_path / "run.h5"
    with (
        warnings.catch_warnings(),
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(
            model, ["forward"], pre_save_callbacks=[summary], post_gather_callbacks=[saver]
        ),
    ):
        warnings.simplefilter("error")  # no marker, no warning
        out = model(x)
    with vartrace.open(path) as run:
        assert sorted(run.names) == ["forward.extremes.0", "forward.extremes.1", "forward.mean"]
        assert run["forward.mean"].get(iteration=1).equal(out.mean().detach())
        assert run["forward.extremes.1"].get(iteration=1).equal(out.min().detach())


# -- torch.jit submodules --------------------------------------------------------------------


class Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2


class HoldsScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.inner = torch.jit.script(Scripted())
        self.traced = torch.jit.trace(nn.Linear(3, 3), torch.zeros(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        out = self.inner(h)
        return self.traced(out)


def test_a_model_holding_scripted_modules_traces_the_rest() -> None:
    model = HoldsScripted()
    x = torch.randn(2, 3)
    paths = ["pre", "forward.h", "forward.out", "pre.weight", "**.bias"]
    with ModelTracer(model, paths) as tracer:
        result = model(x)
    assert sorted(tracer.results) == [
        "forward.h",
        "forward.out",
        "pre.bias",
        "pre.forward",
        "pre.weight",
    ]
    with torch.no_grad():
        h = model.pre(x)
        assert tracer.results["forward.out"].values[0].equal(model.inner(h))
    assert result.shape == (2, 3)
    listed = vartrace.list_sites(model)
    assert "forward.out" in listed and not any(s.startswith(("inner", "traced")) for s in listed)


@pytest.mark.parametrize("pattern", ["inner", "inner.forward.y", "inner.lin", "traced.weight"])
def test_a_pattern_inside_scripted_code_is_refused_saying_why(pattern: str) -> None:
    model = HoldsScripted()
    with pytest.raises(ValueError, match=r"inside a torch\.jit module: '(inner|traced)' is a"):
        ModelTracer(model, [pattern])
    with pytest.warns(UserWarning, match="TorchScript runs outside Python"):
        ModelTracer(model, ["pre", pattern], strict=False)


def test_a_scripted_model_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="the model is a RecursiveScriptModule"):
        ModelTracer(torch.jit.script(Scripted()), ["forward.y"])


# -- a process group that starts after the tracer (Lightning DDP) ----------------------------

_LATE_DEADLINE_S = 300.0  # two processes importing torch on a loaded machine


def late_group_rank(out_dir: str, rank: int, port: int) -> None:
    """One rank of a run whose tracer starts before ``torch.distributed`` does, as around
    Lightning's ``trainer.fit``: the saver is built and the tracer started, then the
    group initialised, then three DDP steps (run in a subprocess by the test below)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    out = Path(out_dir)
    model = TinyTransformer()
    site = "layers.0.attn.forward.scores"
    saver = H5PYSaverCallback(out / "run.h5")
    seen = []

    def keep(name: str, value: torch.Tensor, iteration: int) -> torch.Tensor:
        seen.append(value.detach().clone())
        return value

    with ModelTracer(model, [site], pre_save_callbacks=[keep], post_gather_callbacks=[saver]):
        # The launcher's rank 0 has no rank variable yet; the others have LOCAL_RANK.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=90))
        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step in range(3):
            optimizer.zero_grad()
            wrapped(tokens(10 * rank + step)).logits.sum().backward()
            optimizer.step()
    saver.close()
    torch.save(seen, out / f"seen{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_group_started_after_the_tracer_leaves_the_file_to_rank_0(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "import sys; from tests.integrations.test_real_code import late_group_rank; "
        "late_group_rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"
    )
    root = str(Path(__file__).resolve().parents[2])
    procs = []
    for rank in (0, 1):
        launcher = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "WORLD_SIZE")
        env = {k: v for k, v in os.environ.items() if k not in launcher}
        if rank:
            env.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2")  # as Lightning sets
        command = [sys.executable, "-c", code, str(tmp_path), str(rank), str(port)]
        # A file, not a pipe: a rank retrying its connection while the other starts writes
        # warnings enough to fill a pipe nobody reads yet, and would block there.
        with open(tmp_path / f"stderr{rank}.txt", "w") as stderr:
            procs.append(subprocess.Popen(command, cwd=root, env=env, stderr=stderr))
    end = time.monotonic() + _LATE_DEADLINE_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below, with what each rank wrote
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    errors = [(tmp_path / f"stderr{rank}.txt").read_text()[-3000:] for rank in (0, 1)]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(errors)
    seen = [torch.load(tmp_path / f"seen{rank}.pt") for rank in (0, 1)]
    with vartrace.open(tmp_path / "run.h5") as run:
        scores = run["layers.0.attn.forward.scores"]
        tags = zip(scores.iterations.tolist(), scores.ranks.tolist(), strict=True)
        assert sorted(tags) == [(i, r) for i in (1, 2, 3) for r in (0, 1)]
        for rank in (0, 1):
            for iteration in (1, 2, 3):
                got = scores.get(iteration=iteration, rank=rank)
                assert got.equal(seen[rank][iteration - 1])


_LIGHTNING_SCRIPT = """
import sys

import lightning
import torch

from tests._models import TinyTransformer
from vartrace import H5PYSaverCallback, ModelTracer


class Lit(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyTransformer()

    def training_step(self, batch, index):
        return self.model(batch[0]).logits.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 16, (8, 5)))
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    lit = Lit()
    saver = H5PYSaverCallback(sys.argv[1])
    paths = ["model.layers.0.attn.forward.scores"]
    with ModelTracer(lit, paths, post_gather_callbacks=[saver], gathering_interval=2):
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    saver.close()
"""


@pytest.mark.slow
def test_real_lightning_ddp_with_the_tracer_around_fit_writes_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="lightning is not installed")
    script = tmp_path / "train.py"
    script.write_text(_LIGHTNING_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run.h5")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=_LATE_DEADLINE_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with vartrace.open(tmp_path / "run.h5") as run:
        scores = run["model.layers.0.attn.forward.scores"]
        tags = zip(scores.iterations.tolist(), scores.ranks.tolist(), strict=True)
        assert sorted(tags) == [(i, r) for i in (1, 2, 3) for r in (0, 1)]


def test_a_launcher_rank_other_than_0_leaves_the_file_alone_until_the_group_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.h5"
    path.write_bytes(b"rank 0's file")
    model = Echo()
    # Lightning's launcher starts rank 1 with these; its group starts inside trainer.fit.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    saver = H5PYSaverCallback(path, overwrite=True)
    with ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
        assert path.read_bytes() == b"rank 0's file"  # not replaced, not opened
    saver.close()
    assert path.read_bytes() == b"rank 0's file"


def test_a_rank_variable_without_a_world_of_several_writes_as_usual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")  # one task of a sweep: a process of its own
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with vartrace.open(_trace_to_file(tmp_path / "run.h5")) as run:
        assert run["forward"].iterations.tolist() == [1]


def _trace_to_file(path: Path) -> Path:
    model = Echo()
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward"], post_gather_callbacks=[saver]),
    ):
        model(torch.ones(2))
    return path


def test_records_under_functionalize_and_jacrev_are_the_values_they_stand_for() -> None:
    model = Affine()
    x = torch.randn(3, generator=torch.Generator().manual_seed(2))
    with ModelTracer(model, ["forward.h@every"], change_detection=False) as tracer:
        torch.func.functionalize(model)(x)
        torch.func.jacrev(model)(x)
    with torch.no_grad():
        lin = model.lin(x)
    records = sorted(
        (order, name, value)
        for name, trace in tracer.results.items()
        for order, value in zip(trace.order, trace.values, strict=True)
    )
    assert all(type(v) is torch.Tensor and v.requires_grad is False for _, _, v in records)
    linear = _every_key(Affine.forward, "h", "h = self.lin(x)")
    doubled = _every_key(Affine.forward, "h", "h = h * 2")
    assert [(name, v.tolist()) for _, name, v in records] == [
        (linear, lin.tolist()),
        (doubled, (lin * 2).tolist()),
    ] * 2
