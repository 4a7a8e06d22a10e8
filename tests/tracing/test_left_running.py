"""A tracer started and never stopped: interpreter exit hands its records on, in time.

A notebook, a script that leaves its loop by ``sys.exit`` or an exception path that
skips ``stop()`` leave a tracer running.  Each case runs in a real subprocess (on the
stand-in accelerator, so the asynchronous path with its staging thread is the one
exercised, and on the CPU): the process must exit on its own, promptly, with a file
that opens and holds every step's records.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vartrace

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
from torch import nn
from tests import simgpu
import vartrace

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x)

torch.manual_seed(0)
on_device = sys.argv[2] == "async"
model = simgpu.to_device_module(Net()) if on_device else Net()
saver = vartrace.H5PYSaverCallback(sys.argv[1], metadata=False)
tracer = vartrace.ModelTracer(
    model, ["lin", "lin.weight"], post_gather_callbacks=[saver],
    gathering_interval=3, staging=sys.argv[2],
)
tracer.start()
for step in range(7):
    x = torch.randn(16, 64)
    with simgpu.LOG.paused():
        x = simgpu.to_device(x) if on_device else x
    model(x).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
if sys.argv[3] == "exit":
    sys.exit(0)
if sys.argv[3] == "raise":
    raise SystemExit("left the loop with an error")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["end", "exit", "raise"])
@pytest.mark.parametrize("staging", ["async", "sync"])
def test_a_tracer_left_running_writes_every_step_at_exit(
    tmp_path: Path, staging: str, ending: str
) -> None:
    path = tmp_path / "run.h5"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    process = subprocess.run(
        [sys.executable, str(script), str(path), staging, ending],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected_code = 1 if ending == "raise" else 0
    assert process.returncode == expected_code, process.stderr
    assert "Traceback" not in process.stderr.replace("SystemExit", ""), process.stderr
    with vartrace.open(path) as run:
        assert list(run["lin.forward"].iterations) == list(range(1, 8))
        assert list(run["lin.weight"].iterations) == list(range(1, 8))
