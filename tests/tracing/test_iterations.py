"""Iteration numbers in real training loops: trainers that never call the root, optimizer
steps, threads, and models compiled after the tracer started."""

from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._models import TinyTransformer, tokens
from vartrace import H5PYSaverCallback, ModelTracer

SCORES = "model.layers.*.attn.forward.scores"


class LitLike(nn.Module):
    """The shape of a LightningModule: ``training_step`` calls ``self.model``, never ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()
        self.loss_fn = nn.MSELoss()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a trainer that calls training_step never calls forward")

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch).logits
        return self.loss_fn(logits, torch.zeros_like(logits))


def test_training_step_calling_a_submodule_counts_iterations_and_streams(tmp_path: Path) -> None:
    lit = LitLike()
    optimizer = torch.optim.SGD(lit.parameters(), lr=0.01)
    saver = H5PYSaverCallback(tmp_path / "run.h5")
    with ModelTracer(lit, [SCORES], post_gather_callbacks=[saver]) as tracer:
        for step in range(3):
            optimizer.zero_grad()
            lit.training_step(tokens(step)).backward()
            optimizer.step()
            # Each step reaches the file when it ends, not at exit.
            assert len(saver.datasets["model.layers.0.attn.forward.scores"]) == step + 1
            assert tracer.iteration == step + 1
    saver.close()
    with vartrace.open(tmp_path / "run.h5") as run:
        for layer in (0, 1):
            iterations = run[f"model.layers.{layer}.attn.forward.scores"].iterations
            assert iterations.tolist() == [1, 2, 3]


def test_optimizer_steps_number_iterations_under_gradient_accumulation() -> None:
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    name = "layers.0.attn.forward.scores"
    with ModelTracer(
        model, ["layers.0.attn.forward.scores"], optimizer=optimizer, change_detection=False
    ) as tracer:
        for step in range(3):
            for micro in range(2):
                model(tokens(2 * step + micro)).logits.sum().backward()
            assert tracer.iteration == step + 1
            optimizer.step()
            optimizer.zero_grad()
            # gathered after each step: the step's records are in the results already
            assert tracer.results[name].iterations[-2:] == [step + 1, step + 1]
    assert tracer.results[name].iterations == [1, 1, 2, 2, 3, 3]


class Rendezvous(nn.Module):
    """Two threads are inside ``forward`` at once on every call (a barrier in the middle)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait(timeout=30)
        h = x * self.scale
        return h


def test_outermost_calls_are_counted_per_thread(tmp_path: Path) -> None:
    calls = 20
    model = Rendezvous(threading.Barrier(2))
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for i in range(calls):
                model(torch.full((3,), float(first + i)))
        except BaseException as error:
            errors.append(error)

    saver = H5PYSaverCallback(tmp_path / "run.h5")
    with ModelTracer(
        model, ["forward.x", "forward.h"], change_detection=False, post_gather_callbacks=[saver]
    ):
        threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    saver.close()
    assert not errors
    # Both threads' chunks reached the file (one gather at a time), each call its own tag,
    # and records of one call share it: h == 2 * x at every iteration.
    with vartrace.open(tmp_path / "run.h5") as run:
        xs, hs = run["forward.x"], run["forward.h"]
        assert sorted(xs.iterations.tolist()) == list(range(1, 2 * calls + 1))
        assert sorted(hs.iterations.tolist()) == list(range(1, 2 * calls + 1))
        x_of = {int(i): xs.values[row] for row, i in enumerate(xs.iterations)}
        for row, iteration in enumerate(hs.iterations):
            assert (hs.values[row] == 2 * x_of[int(iteration)]).all()


class _Graphs:
    """A torch.compile backend that runs each graph as captured and keeps its operators."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        self.ops += [
            str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")
        ]
        return gm.forward


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiling_after_the_tracer_started_keeps_the_rest_compiled(how: str) -> None:
    torch._dynamo.reset()
    model = TinyTransformer()
    graphs = _Graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["head.forward.input"]) as tracer:
            if how == "torch.compile":
                run = torch.compile(model, backend=graphs)
            else:
                model.compile(backend=graphs)
                run = model
            for step in range(2):
                run(tokens(step))
    torch._dynamo.reset()
    assert tracer.results["head.forward.input"].iterations == [1, 2]
    ours = [str(w.message) for w in caught if str(w.message).startswith("vartrace")]
    assert len(ours) == 1
    assert "compiled" in ours[0] and "head.forward" in ours[0]
    # Only the traced method leaves the graph: the root's forward (its embedding) and the
    # layers (their softmax) stay compiled although the root counts iterations.
    assert any("embedding" in op for op in graphs.ops)
    assert any("softmax" in op for op in graphs.ops)


def test_real_lightning_trainer_counts_training_steps(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning")

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyTransformer()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(batch[0]).logits.pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randint(0, 16, (8, 5)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = lightning.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    lit = Lit()
    saver = H5PYSaverCallback(tmp_path / "run.h5")
    with ModelTracer(lit, [SCORES], post_gather_callbacks=[saver]):
        trainer.fit(lit, loader)
    saver.close()
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["model.layers.0.attn.forward.scores"].iterations.tolist() == [1, 2, 3]


def test_root_forward_called_directly_still_counts_and_eval_calls_do_not() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["forward.x", "layers.0.attn.forward.scores"]) as tracer:
        for step in range(2):
            model.forward(tokens(step))  # no module hooks run
        model.eval()
        model(tokens(5))  # mode="train": not an iteration, nothing recorded
        model.train()
        model(tokens(6))
    assert tracer.results["forward.x"].iterations == [1, 2, 3]
    assert tracer.results["layers.0.attn.forward.scores"].iterations == [1, 2, 3]


def test_checkpointed_recompute_during_backward_is_not_an_iteration() -> None:
    lit = LitLike()
    name = "model.layers.0.attn.forward.scores"

    def step(batch: torch.Tensor) -> torch.Tensor:
        x = lit.model.embed(batch)
        x = torch.utils.checkpoint.checkpoint(lit.model.layers[0], x, use_reentrant=False)
        return x.pow(2).mean()

    with ModelTracer(lit, [name], change_detection=False) as tracer:
        for i in range(3):
            step(tokens(i)).backward()
    assert tracer.results[name].iterations == [1, 2, 3]


class Interruptible(nn.Module):
    """Raises ``KeyboardInterrupt`` (which skips ``always_call`` forward hooks) on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.interrupt:
            raise KeyboardInterrupt
        return h


def test_an_interrupted_call_does_not_leave_later_calls_nested() -> None:
    model = Interruptible()
    with ModelTracer(model, ["lin.forward.input"], change_detection=False) as tracer:
        for step in range(4):
            model.interrupt = step == 1
            with contextlib.suppress(KeyboardInterrupt):
                model(torch.full((3,), float(step)))
    assert tracer.results["lin.forward.input"].iterations == [1, 2, 3, 4]


class Chunked(nn.Module):
    """Splits a large batch and calls itself on each chunk (a memory-saving forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, chunk: int = 2) -> torch.Tensor:
        if x.shape[0] > chunk:
            return torch.cat([self(part, chunk) for part in x.split(chunk)])
        h = self.lin(x)
        return h


class Tree(nn.Module):
    """A recursive tree model: each node calls the root on its children."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(3, 3)

    def forward(self, node: tuple[torch.Tensor, list[Any]]) -> torch.Tensor:
        value, kids = node
        h = self.cell(value)
        for kid in kids:
            h = h + self(kid)
        return h


def _tree(step: int) -> tuple[torch.Tensor, list[Any]]:
    leaf = (torch.full((3,), float(step)), [])
    return (torch.ones(3), [(torch.zeros(3), [leaf]), leaf])


@pytest.mark.parametrize("model_class", [Chunked, Tree])
def test_a_model_calling_itself_runs_one_iteration_per_outermost_call(
    model_class: type[nn.Module],
) -> None:
    model = model_class()
    site = "cell.forward" if model_class is Tree else "forward.h"
    with ModelTracer(model, [site, "forward"], change_detection=False) as tracer:
        for step in range(3):
            model(_tree(step) if model_class is Tree else torch.randn(6, 3))
        assert tracer.iteration == 3
    calls = 4 if model_class is Tree else 3  # four nodes; three chunks
    assert tracer.results[site].iterations == [1] * calls + [2] * calls + [3] * calls
    # forward records every call, the nested ones and the outermost, which returns last
    assert tracer.results["forward"].iterations == [1] * 4 + [2] * 4 + [3] * 4


def _interrupt(module: nn.Module, args: Any) -> None:
    raise KeyboardInterrupt


def test_a_call_interrupted_inside_a_self_call_does_not_nest_later_calls() -> None:
    model = Chunked()
    with ModelTracer(model, ["forward.h"], change_detection=False) as tracer:
        model(torch.randn(4, 3))
        handle = model.lin.register_forward_pre_hook(_interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            model(torch.randn(4, 3))  # skips the always_call hooks of both open calls
        handle.remove()
        model(torch.randn(4, 3))
    assert tracer.results["forward.h"].iterations == [1, 1, 3, 3]


class Wrapper(nn.Module):
    """The shape of a PEFT model: the root holds the model it trains in ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch).logits


def test_an_inner_module_called_after_the_root_counts_its_own_iterations() -> None:
    wrapper = Wrapper()
    sites = ["model.layers.*.attn.forward.scores", "model.head.forward.input"]
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01)
    with ModelTracer(wrapper, sites, change_detection=False) as tracer:
        for step in range(3):
            optimizer.zero_grad()
            wrapper(tokens(step)).pow(2).mean().backward()
            optimizer.step()
        merged = wrapper.model  # what merge_and_unload() returns
        merged(tokens(3))  # both layers' attention in one call: one iteration
        assert tracer.iteration == 4
        merged(tokens(4))
        merged.eval()  # its own mode decides: mode="train" records nothing of this call
        merged(tokens(5))
    for site in ("model.layers.0.attn.forward.scores", "model.layers.1.attn.forward.scores"):
        assert tracer.results[site].iterations == [1, 2, 3, 4, 5]
    assert tracer.results["model.head.forward.input"].iterations == [1, 2, 3, 4, 5]
