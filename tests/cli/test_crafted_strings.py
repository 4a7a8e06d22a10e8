"""Strings of a crafted run file print bounded: a statistics site whose `reduced_dtype` is a
multi-line string of 200,000 characters and whose `reduced_shape` has 100,000 axes prints, in
``ls``, ``show`` and ``compare``, as short lines of its own, never forged ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback
from vartrace.cli.output import LINE_CHARS


@pytest.fixture
def crafted(tmp_path: Path) -> Path:
    path = tmp_path / "run.h5"
    model = nn.Linear(4, 3)
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        vartrace.ModelTracer(
            model, ["forward"], statistics=True, post_gather_callbacks=[saver], gathering_interval=1
        ),
    ):
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    with h5py.File(path, "r+") as handle:
        attrs = handle["vars/forward"].attrs
        attrs["reduced_dtype"] = "float32\nFORGED LINE " + "x" * 200_000
        attrs["reduced_shape"] = np.arange(100_000, dtype=np.int64)
    return path


@pytest.mark.parametrize("command", [["ls"], ["show", "*"], ["compare", "{run}"]])
def test_a_crafted_files_long_strings_print_bounded(crafted: Path, command: list[str]) -> None:
    argv = [command[0], str(crafted), *(part.format(run=crafted) for part in command[1:])]
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "forward" in done.stdout
    assert max(len(line) for line in lines) <= LINE_CHARS + 30
    assert not any(line.startswith("FORGED") for line in lines)
