"""A tracer hands each gather to its saver's writer thread by default (issue 45 item 3).

With the default `background=None` the records a tracer gathers are written and committed
on the saver's `vartrace-writer` thread, in order, while the training goes on; a saver
called by hand writes on the caller's thread.  `saver.flush()`, the tracer's stop and
`close()` return with every record durable; a SIGKILL loses only the gathers handed to the
thread and not committed yet: the one being written and at most one queued.

The records here pickle, so the saver's write runs their `__reduce__` (the tracer's copy at
capture runs it too, on the training thread): it notes the thread that wrote each one.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

import vartrace
from tests._env import ROOT
from tests._noted import WRITERS, Noted, NotedNet
from vartrace import H5PYSaverCallback, ModelTracer, Trace


def _steps(path: Path) -> list[int]:
    with vartrace.open(path) as run:
        return run["forward.0"].iterations.tolist()


def test_a_tracer_hands_its_gathers_to_the_writer_thread_and_a_flush_waits_for_them(
    tmp_path: Path,
) -> None:
    WRITERS.clear()
    path = tmp_path / "run.h5"
    model = NotedNet()
    with H5PYSaverCallback(path, metadata=False) as saver:
        assert saver.background is None  # the default
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a Noted is stored pickled: said once
            with ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
                for step in range(1, 4):
                    model(torch.full((3,), float(step)), Noted(step))
                saver.flush()  # a user's flush: every gather so far is durable
                assert _steps(path) == [1, 2, 3]
                for step in range(4, 7):
                    model(torch.full((3,), float(step)), Noted(step))
        # the tracer stopped: every gather is in the file while the saver is still open
        assert _steps(path) == [1, 2, 3, 4, 5, 6]
    written = [name for name in WRITERS if name != threading.current_thread().name]
    assert written == ["vartrace-writer run.h5"] * 6  # none pickled on the training thread


def test_a_saver_called_by_hand_writes_on_the_callers_thread(tmp_path: Path) -> None:
    WRITERS.clear()
    path = tmp_path / "run.h5"
    saver = H5PYSaverCallback(path, metadata=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 4):
            trace = Trace([Noted(step)], [step], [0], [step])
            saver("note", trace)
            assert WRITERS[-1] == threading.current_thread().name  # written by the call
            assert not len(trace)  # taken from the chunk
    saver.flush()
    assert not any(t.name.startswith("vartrace-writer") for t in threading.enumerate())
    with vartrace.open(path) as run:  # durable once flush returned
        assert run["note"].iterations.tolist() == [1, 2, 3]
    saver.close()


_STUCK = 4  # the gather the writer thread never finishes
_KILLED = f"""
import os
import sys
import threading
import time

import torch
from torch import nn

from vartrace import H5PYSaverCallback, ModelTracer


def say(line):  # one write: lines of the two threads never interleave
    os.write(1, (line + "\\n").encode())


class Note:
    def __init__(self, step):
        self.step = step

    def __reduce__(self):  # the tracer's copy runs it too, on the training thread
        if self.step == {_STUCK} and threading.current_thread().name.startswith("vartrace-writer"):
            say(f"writing {{self.step}}")
            while True:  # the writer thread stays inside gather {_STUCK}'s write
                time.sleep(0.05)
        return (Note, (self.step,))


class Net(nn.Module):
    def forward(self, x, note):
        return x * 2, note


model = Net()
saver = H5PYSaverCallback(sys.argv[1], metadata=False)
with saver, ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
    for step in range(1, 13):
        model(torch.full((3,), float(step)), Note(step))
        say(f"stepped {{step}}")
"""


def test_a_sigkill_loses_only_the_gather_being_written_and_one_queued(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    script = tmp_path / "train.py"
    script.write_text(_KILLED)
    process = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(script), str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
    )
    out = b""
    try:
        assert process.stdout is not None
        descriptor = process.stdout.fileno()
        # the writer thread is stuck in gather 4, and the training thread ran on to step 5
        deadline = time.monotonic() + 120  # (start-up included, on a loaded machine)
        while not {f"writing {_STUCK}", f"stepped {_STUCK + 1}"} <= set(out.decode().split("\n")):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([descriptor], [], [], left)[0], f"no more: {out!r}"
            more = os.read(descriptor, 4096)
            assert more, f"the child ended: {out!r}"
            out += more
        # whatever it prints next within a second (the next gather waits for room in the
        # writer's queue: nothing)
        while select.select([descriptor], [], [], 1.0)[0]:
            more = os.read(descriptor, 4096)
            if not more:
                break
            out += more
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    lines = out.decode().splitlines()
    assert process.returncode == -signal.SIGKILL
    assert f"stepped {_STUCK + 2}" not in lines, lines
    # every gather committed before the stuck one is readable; 4 (being written) and
    # 5 (queued) are lost, and nothing half written shows
    assert _steps(path) == [1, 2, 3]
