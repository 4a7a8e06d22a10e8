"""A process forked while a tracer and its saver are active, as a script of its own.

``python tests/_fork_scenario.py DIR inline|background exit|_exit``: the
parent traces ``forward.x`` into ``DIR/parent.h5``, forks after its first
call, and (once the child is gone) calls the model once more.  The child
calls the model three times, tries to start a tracer with the parent's
saver, traces two calls into ``DIR/child.h5`` with a saver of its own, and
ends by ``sys.exit`` (atexit handlers and HDF5's own clean-up run) or
``os._exit`` (as multiprocessing and DataLoader workers do).  The child
writes what it saw to ``DIR/child.json``; the parent prints ``PARENT {...}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from vartrace.storage import H5PYSaverCallback
from vartrace.tracing.tracer import ModelTracer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _child(model: Net, parent_saver: H5PYSaverCallback, directory: Path) -> dict:
    seen: dict = {"outputs": [float(model(torch.full((1, 3), 100.0 + i))) for i in range(3)]}
    try:
        ModelTracer(model, ["forward.x"], post_gather_callbacks=[parent_saver]).start()
    except RuntimeError as error:
        seen["parent_saver"] = str(error)
    with (
        H5PYSaverCallback(directory / "child.h5", metadata=False) as saver,
        ModelTracer(model, ["forward.x"], post_gather_callbacks=[saver]),
    ):
        for value in (200.0, 201.0):
            model(torch.full((1, 3), value))
    return seen


def main(directory: Path, background: bool, exit_call: str) -> None:
    model = Net()
    path = directory / "parent.h5"
    with (
        torch.no_grad(),
        H5PYSaverCallback(path, metadata=False, background=background) as saver,
        ModelTracer(
            model, ["forward.x"], post_gather_callbacks=[saver], change_detection=False
        ) as tracer,
    ):
        model(torch.zeros(1, 3))
        saver.flush(wait=True)
        before = _digest(path)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                seen = _child(model, saver, directory)
                (directory / "child.json").write_text(json.dumps(seen))
                code = 0
            finally:
                if exit_call == "exit":
                    sys.exit(code)
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        after = _digest(path)
        model(torch.ones(1, 3))
    state = {"status": status, "unchanged": before == after, "results": len(tracer.results)}
    print("PARENT", json.dumps(state))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "background", sys.argv[3])
