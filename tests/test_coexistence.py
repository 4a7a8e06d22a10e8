"""The step runs as it would untraced whatever else the program does: threads, forks, copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace.storage import H5PYSaverCallback
from vartrace.tracer import ModelTracer


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
    script = Path(__file__).with_name("_fork_scenario.py")
    mode = "background" if background else "inline"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), mode, exit_call],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(script.parents[1])},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
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
