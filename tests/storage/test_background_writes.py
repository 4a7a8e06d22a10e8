"""A saver with `background=True` writes on a thread of its own (issue 45 item 3): the
training thread hands each gather over, and a tracer that stops leaves every record in the
file.

The records here pickle (`Noted`), so the saver's write runs their `__reduce__`: it notes
the thread that wrote each one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from tests._noted import WRITERS, Noted, NotedNet
from vartrace import H5PYSaverCallback, ModelTracer


def _train(saver: H5PYSaverCallback, steps: int) -> None:
    model = NotedNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a Noted is stored pickled: said once
        with ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
            for step in range(1, steps + 1):
                model(torch.full((3,), float(step)), Noted(step))


def test_a_background_saver_writes_on_its_own_thread_and_the_tracer_waits_for_it(
    tmp_path: Path,
) -> None:
    WRITERS.clear()
    path = tmp_path / "run.h5"
    saver = H5PYSaverCallback(path, metadata=False, background=True)
    try:
        _train(saver, 6)
        # the tracer stopped: every gather is in the file while the saver is still open
        with vartrace.open(path, allow_pickle=True) as run:
            assert run["forward.0"].iterations.tolist() == [1, 2, 3, 4, 5, 6]
            notes = run["forward.1"]
            assert [notes.record(i).step for i in range(len(notes))] == [1, 2, 3, 4, 5, 6]
    finally:
        saver.close()
    # the tracer copies each Noted at capture (on this thread); the saver pickles them
    # on its writer thread, never here
    written = [name for name in WRITERS if name.startswith("vartrace-writer")]
    assert written and set(written) == {"vartrace-writer run.h5"}
    assert len(written) == 6


@pytest.mark.parametrize("background", [True, False])
def test_a_stopped_tracer_leaves_every_record_committed_either_way(
    tmp_path: Path, background: bool
) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False, background=background) as saver:
        model = nn.Linear(4, 4)
        with ModelTracer(model, ["forward.input"], post_gather_callbacks=[saver]):
            for step in range(20):
                model(torch.full((2, 4), float(step)))
        assert saver.failure is None  # waits for the writer thread
        with vartrace.open(path) as run:  # live: committed by the last gather
            assert run["forward.input"].iterations.tolist() == list(range(1, 21))
