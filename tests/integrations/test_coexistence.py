"""The step runs as it would untraced whatever else the program does: threads, forks, copies."""

from __future__ import annotations

import copy
import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import vartrace
from tests._env import child_env
from tests._models import TinyTransformer, tokens
from vartrace.storage import H5PYSaverCallback
from vartrace.tracing.tracer import ModelTracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.sum()


@pytest.fixture
def often_switching_threads() -> Iterator[None]:
    """Threads switch every microsecond: races show at once instead of now and then."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.mark.usefixtures("often_switching_threads")
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_threads_with_a_saver_lose_nothing(tmp_path: Path, background: bool) -> None:
    model = Net()
    path = tmp_path / "run.h5"
    errors: list[BaseException] = []
    threads, calls = 4, 50

    def work(thread: int) -> None:
        try:
            for call in range(calls):
                with torch.no_grad():
                    model(torch.full((1, 3), float(thread * 1000 + call)))
        except BaseException as error:
            errors.append(error)

    with (
        H5PYSaverCallback(path, metadata=False, background=background) as saver,
        ModelTracer(
            model, ["forward.x", "forward.h"], post_gather_callbacks=[saver], change_detection=False
        ) as tracer,
    ):
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert errors == []
    assert not any(len(trace) for trace in tracer.results.values()), "all went to the file"
    expected = sorted(float(t * 1000 + c) for t in range(threads) for c in range(calls))
    with vartrace.open(path) as run:
        inputs = np.asarray(run["forward.x"].values)[:, 0, 0]
        assert sorted(inputs.tolist()) == expected
        outputs = np.asarray(run["forward.h"].values)
        assert len(outputs) == threads * calls
        order = np.concatenate([np.asarray(run[name].order) for name in run.names])
        assert len(np.unique(order)) == 2 * threads * calls


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.parametrize(
    ("background", "exit_call"),
    [(False, "_exit"), (True, "exit")],
    ids=["inline-os._exit", "background-sys.exit"],  # sys.exit runs atexit and HDF5's clean-up
)
def test_forked_child_records_nothing_and_never_writes_the_parents_file(
    tmp_path: Path, background: bool, exit_call: str
) -> None:
    script = Path(__file__).parents[1] / "_fork_scenario.py"
    mode = "background" if background else "inline"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), mode, exit_call],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "vartrace" not in done.stderr, "the child warns nothing (the parent's tracer is not its)"
    parent = json.loads(done.stdout.split("PARENT ", 1)[1])
    assert parent["status"] == 0, "the child's model calls, own tracer and exit all succeed"
    assert parent["unchanged"], "the child left the parent's file byte for byte as it was"
    child = json.loads((tmp_path / "child.json").read_text())
    assert len(child["outputs"]) == 3
    assert "is a fork of it" in child["parent_saver"]
    with vartrace.open(tmp_path / "parent.h5") as run:
        assert run.names == ["forward.x"]
        assert np.asarray(run["forward.x"].iterations).tolist() == [1, 2]
        assert np.asarray(run["forward.x"].values)[:, 0, 0].tolist() == [0.0, 1.0]
    with vartrace.open(tmp_path / "child.h5") as run:
        assert np.asarray(run["forward.x"].iterations).tolist() == [1, 2]
        assert np.asarray(run["forward.x"].values)[:, 0, 0].tolist() == [200.0, 201.0]


def _trace_into(saver: H5PYSaverCallback) -> None:
    model = Net()
    with saver, torch.no_grad(), ModelTracer(model, ["forward.x"], post_gather_callbacks=[saver]):
        model(torch.ones(1, 3))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_saver_made_before_a_fork_writes_from_the_child(tmp_path: Path) -> None:
    """A saver belongs to the process that opens its file, not to the one that made it."""
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    child = multiprocessing.get_context("fork").Process(target=_trace_into, args=(saver,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    with vartrace.open(tmp_path / "run.h5") as run:
        assert np.asarray(run["forward.x"].values).tolist() == [[[1.0, 1.0, 1.0]]]


def _torch_save_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "torch.save": _torch_save_load,
    "AveragedModel": lambda model: AveragedModel(model).module,
}


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_copies_of_a_traced_model_are_clean_untraced_copies(make_copy: Any) -> None:
    model = TinyTransformer()
    attributes = {name: set(vars(module)) for name, module in model.named_modules()}
    paths = ["layers.*.attn._scores.scale", "forward", "head.forward.self.weight@grad"]
    with ModelTracer(model, paths) as tracer:
        model(tokens(0)).logits.sum().backward()
        twin = make_copy(model)
        recorded = {name: len(trace) for name, trace in tracer.results.items()}
        assert {name: set(vars(module)) for name, module in twin.named_modules()} == attributes
        twin(tokens(1)).logits.sum().backward()  # untraced: records nothing
        assert {name: len(trace) for name, trace in tracer.results.items()} == recorded
        model(tokens(2))
    assert {name: set(vars(module)) for name, module in model.named_modules()} == attributes
    assert torch.equal(twin(tokens(3)).logits, model(tokens(3)).logits)


def test_averaged_model_updates_while_tracing() -> None:
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ModelTracer(model, ["forward"]) as tracer:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        for step in range(3):
            model(tokens(step)).logits.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
        ema(tokens(0))
    assert tracer.results["forward.logits"].iterations == [1, 2, 3]
    assert not torch.equal(ema.module.head.weight, model.head.weight)


def test_lightning_stochastic_weight_averaging_while_tracing() -> None:
    """Lightning's SWA callback deep-copies the LightningModule when averaging starts."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return (self(x) - y).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    module = Regression()
    trainer = lightning.Trainer(
        max_epochs=3,
        accelerator="cpu",
        callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with ModelTracer(module, ["forward.h"]) as tracer:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert tracer.results["forward.h"].iterations == [1, 2, 3, 4, 5, 6]
    assert not {"forward", "__getstate__"} & set(vars(module)), "restored"


_COVERED_SCRIPT = """
import json
import torch
from torch import nn
from vartrace.tracing.tracer import ModelTracer

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        y = h * 2
        return y.sum()

model = Net()
with ModelTracer(model, ["forward.h", "forward.y@every"]) as tracer:
    for step in range(3):
        model(torch.full((1, 3), float(step)))
print("RECORDS", json.dumps({name: len(trace) for name, trace in tracer.results.items()}))
"""


@pytest.mark.parametrize("coverage_core", ["ctrace", "pytrace", "sysmon"])
def test_model_tracer_under_coverage_run(tmp_path: Path, coverage_core: str) -> None:
    """``coverage run`` (as pytest-cov runs tests): both record everything at once."""
    coverage = pytest.importorskip("coverage")
    if coverage_core == "sysmon" and not hasattr(sys, "monitoring"):
        pytest.skip("coverage's sysmon core needs sys.monitoring (Python >= 3.12)")
    script = tmp_path / "covered.py"
    script.write_text(_COVERED_SCRIPT)
    data_file = tmp_path / "coverage.data"
    done = subprocess.run(
        [sys.executable, "-m", "coverage", "run", f"--data-file={data_file}", str(script)],
        capture_output=True,
        text=True,
        env=child_env(COVERAGE_CORE=coverage_core),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    source = _COVERED_SCRIPT.splitlines()
    body = [i for i, row in enumerate(source, 1) if row.strip() in ("h = self.lin(x)", "y = h * 2")]
    assert len(body) == 2
    records = json.loads(done.stdout.split("RECORDS ", 1)[1])
    assert records == {"forward.h": 3, f"forward.y@every:L{body[1]}": 3}  # y's one binding
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    lines = data.lines(str(script))
    assert set(body) <= set(lines)
