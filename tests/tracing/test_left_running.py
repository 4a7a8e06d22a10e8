"""A tracer started and never stopped: interpreter exit hands its records on, in time.

A notebook, a script that leaves its loop by ``sys.exit`` or an exception path that
skips ``stop()`` leave a tracer running.  Each case runs in a real subprocess (on the
stand-in accelerator, so the asynchronous path with its staging thread is the one
exercised, and on the CPU): the process must exit on its own, promptly, with a file
that opens and holds every step's records.
"""

from __future__ import annotations

import signal
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


THREAD_SCRIPT = """
import atexit
import sys
import threading
import torch
from torch import nn
import vartrace

staging, background, ending = sys.argv[2], sys.argv[3] == "background", sys.argv[4]
after_stop, stepped = threading.Event(), threading.Event()
if ending == "daemon":  # registered before the tracer starts: run after vartrace's exit work
    atexit.register(lambda: (after_stop.set(), stepped.wait(60)))
model = nn.Sequential(nn.Linear(8, 8))
saver = vartrace.H5PYSaverCallback(sys.argv[1], metadata=False, background=background)
tracer = vartrace.ModelTracer(
    model, ["0"], post_gather_callbacks=[saver], gathering_interval=3, staging=staging
)
tracer.start()


def train():
    threading.main_thread().join()  # every step after the main thread ended
    for step in range(1, 21):
        tracer.set_iteration(step)
        model(torch.randn(2, 8)).sum().backward()


def train_after_stop():
    after_stop.wait()  # the tracer left running was stopped at exit
    model(torch.randn(2, 8))
    stepped.set()


if ending == "thread":
    threading.Thread(target=train).start()
else:
    for step in range(1, 4):
        tracer.set_iteration(step)
        model(torch.randn(2, 8)).sum().backward()
    threading.Thread(target=train_after_stop, daemon=True).start()
"""


def _run_thread_script(
    tmp_path: Path, *args: str, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(THREAD_SCRIPT))
    return subprocess.run(
        [sys.executable, *options, str(script), str(tmp_path / "run.h5"), *args],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("staging", "writer"), [("sync", "inline"), ("sync", "background"), ("async", "background")]
)
def test_a_thread_training_after_the_main_thread_ended_writes_every_step(
    tmp_path: Path, staging: str, writer: str
) -> None:
    """A script whose main thread starts the tracer and a (non-daemon) training thread, then
    returns: the tracer is stopped once Python joined that thread, not before.  On Python
    3.12+ no thread starts at shutdown: the saver's writer writes on the caller's thread."""
    process = _run_thread_script(tmp_path, staging, writer, "thread")
    assert process.returncode == 0, process.stderr
    assert "Traceback" not in process.stderr, process.stderr
    with vartrace.open(tmp_path / "run.h5") as run:
        assert list(run["0.forward"].iterations) == list(range(1, 21))


@pytest.mark.slow
def test_a_call_after_the_stop_at_exit_is_said_once(tmp_path: Path) -> None:
    """A daemon thread still calling the model after the tracer left running was stopped at
    exit: those calls are recorded nowhere, and one warning says so (under `-W error` too:
    the step goes on, the warning is printed at exit)."""
    process = _run_thread_script(tmp_path, "sync", "inline", "daemon", options=("-W", "error"))
    assert process.returncode == 0, process.stderr
    assert process.stderr.count("was called after the tracer left running was stopped") == 1
    assert "Traceback" not in process.stderr, process.stderr
    with vartrace.open(tmp_path / "run.h5") as run:
        assert list(run["0.forward"].iterations) == [1, 2, 3]


INTERRUPT_SCRIPT = """
import sys
import time
import torch
from torch import nn
import vartrace

model = nn.Sequential(nn.Linear(8, 8))
saver = vartrace.H5PYSaverCallback(sys.argv[1], metadata=False)


def slow(name, trace):
    if 7 in trace.iterations:  # the exit's final hand-over: wait for the test's Ctrl-C
        saver.flush()  # the gathers before are durable (the writer thread may hold them)
        print("draining", flush=True)
        for _ in range(1200):  # short sleeps: one long one can miss a signal on the main thread
            time.sleep(0.1)


tracer = vartrace.ModelTracer(
    model, ["0"], post_gather_callbacks=[slow, saver], gathering_interval=3,
    staging=sys.argv[2],
)
tracer.start()
for step in range(1, 8):
    tracer.set_iteration(step)
    model(torch.randn(2, 8)).sum().backward()
"""


@pytest.mark.slow
@pytest.mark.parametrize("staging", ["sync", "async"])
def test_ctrl_c_during_the_exit_drain_ends_the_process_as_interrupted(
    tmp_path: Path, staging: str
) -> None:
    """Ctrl-C while the exit waits for a tracer's last records: one line says so, no
    traceback, the exit status of an interrupt; the file keeps its completed writes."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(INTERRUPT_SCRIPT))
    path = tmp_path / "run.h5"
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), staging],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "draining\n"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGINT, stderr
    assert stderr.count("vartrace: interrupted at exit") == 1, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    with vartrace.open(path) as run:
        assert list(run["0.forward"].iterations) == list(range(1, 7))
