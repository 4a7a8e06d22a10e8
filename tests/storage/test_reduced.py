"""Statistics rows keep the dtype and shape of the tensors they summarise (issue 35 item 5).

A statistics record is a row of float64 numbers: without a description a bfloat16 run
and a float32 run, or a (8, 1024, 768) and a (8, 16, 768) activation, look alike.  The
tracer notes what each pre-save callback replaced (`vartrace.reduced`), the results
and the saver keep it, and `vartrace.open`, `ls`, `show` and `compare` say it.
"""

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
from vartrace.reduced import ReducedFrom, Reductions
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.layout import REDUCED_DTYPE, REDUCED_SHAPE
from vartrace.storage.reader import RunFileError


class _Block(nn.Module):
    """A block whose output has the dtype it is given, and a local `scores`."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ x.transpose(-1, -2)  # (batch, length, length)
        return (self.proj(x) + scores.mean()).to(self.dtype)


def _run(model: nn.Module, lengths: list[int], **tracer: object) -> vartrace.ModelTracer:
    torch.manual_seed(0)
    with vartrace.ModelTracer(
        model, ["forward", "forward.scores"], statistics=True, **tracer
    ) as tracer_:
        for length in lengths:
            model(torch.randn(2, length, 4))
    return tracer_


def test_a_description_widens_to_cover_every_value() -> None:
    reductions = Reductions()
    reductions.note("a", torch.zeros(2, 5, 4, dtype=torch.bfloat16))
    reductions.note("a", torch.zeros(2, 5, 4, dtype=torch.bfloat16))  # nothing new
    assert reductions.taken() == [("a", ReducedFrom("bfloat16", (2, 5, 4)))]
    assert reductions.taken() == []
    reductions.note("a", torch.zeros(2, 7, 4, dtype=torch.float32))
    reductions.note("b", np.zeros(3, np.float16))
    assert reductions.taken() == [
        ("a", ReducedFrom("bfloat16|float32", (2, -1, 4))),
        ("b", ReducedFrom("float16", (3,))),
    ]
    reductions.note("a", torch.zeros(2, dtype=torch.float32))
    assert reductions.taken() == [("a", ReducedFrom("bfloat16|float32", None))]
    assert str(ReducedFrom("bfloat16", (2, -1, 4))) == "bfloat16 (2, *, 4)"
    assert ReducedFrom("float16", (3,)).shape_text == "(3,)"


def test_the_results_of_statistics_mode_say_what_each_row_summarises() -> None:
    tracer = _run(_Block(torch.bfloat16), [5, 5, 9])
    reductions = tracer.results.reductions
    assert reductions["forward"] == ReducedFrom("bfloat16", (2, -1, 4))
    assert reductions["forward.scores"] == ReducedFrom("float32", (2, -1, -1))


def test_records_kept_whole_have_no_description() -> None:
    model = _Block()
    with vartrace.ModelTracer(model, ["forward", "forward.scores"]) as tracer:
        model(torch.randn(2, 3, 4))
    assert "forward" in tracer.results and tracer.results.reductions == {}


@pytest.mark.parametrize("background", [False, True])
def test_the_file_keeps_the_description_as_site_attributes(
    tmp_path: Path, background: bool
) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, background=background) as saver:
        _run(
            _Block(torch.bfloat16),
            [5, 5, 7, 16],
            post_gather_callbacks=[saver],
            gathering_interval=2,
        )
    with h5py.File(path, "r") as f:
        group = f["vars/forward"]
        assert group.attrs[REDUCED_DTYPE] == "bfloat16"
        assert group.attrs[REDUCED_SHAPE].tolist() == [2, -1, 4]
    with vartrace.open(path) as run:
        assert run["forward"].reduced_from == ReducedFrom("bfloat16", (2, -1, 4))
        assert run["forward.scores"].reduced_from == ReducedFrom("float32", (2, -1, -1))
        assert run["forward"].dtype == "statistics"


def test_a_site_recorded_whole_has_no_description_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model = _Block()
    with (
        H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(
            model,
            ["forward", "forward.scores"],
            post_gather_callbacks=[saver],
            pre_save_callbacks=[vartrace.stats(sites="forward.scores")],
        ),
    ):
        model(torch.randn(2, 3, 4))
    with vartrace.open(path) as run, h5py.File(path, "r") as f:
        assert run["forward"].reduced_from is None
        assert REDUCED_DTYPE not in f["vars/forward"].attrs
        assert run["forward.scores"].reduced_from == ReducedFrom("float32", (2, 3, 3))


def test_an_appended_session_widens_the_files_description(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        _run(_Block(torch.bfloat16), [5], post_gather_callbacks=[saver])
    with (
        H5PYSaverCallback(path, append=True) as saver,
        pytest.warns(UserWarning, match="already holds iterations up to 1"),
    ):
        _run(_Block(torch.float32), [5, 6], post_gather_callbacks=[saver])
    with vartrace.open(path) as run:
        assert run["forward"].reduced_from == ReducedFrom("bfloat16|float32", (2, -1, 4))


def test_a_changed_number_of_axes_drops_the_shape_in_the_file(tmp_path: Path) -> None:
    class Flat(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    path = tmp_path / "run.h5"
    model = Flat()
    with (
        H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(
            model, ["forward"], statistics=True, post_gather_callbacks=[saver], gathering_interval=1
        ),
    ):
        model(torch.randn(2, 3))  # written with the shape (2, 3) in the first gather
        model(torch.randn(6))
    with h5py.File(path, "r") as f:
        assert REDUCED_SHAPE not in f["vars/forward"].attrs
    with vartrace.open(path) as run:
        assert run["forward"].reduced_from == ReducedFrom("float32", None)


def test_a_damaged_description_is_a_run_file_error(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        _run(_Block(), [3], post_gather_callbacks=[saver])
    with h5py.File(path, "r+") as f:
        f["vars/forward"].attrs[REDUCED_SHAPE] = np.array([[1.5]])
    with vartrace.open(path) as run, pytest.raises(RunFileError, match=REDUCED_SHAPE):
        _ = run["forward"].reduced_from


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", *args], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_ls_and_show_say_what_statistics_rows_summarise(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        _run(_Block(torch.bfloat16), [5, 7], post_gather_callbacks=[saver])
    listing = _cli("ls", str(path))
    row = next(line for line in listing.splitlines() if line.startswith("forward "))
    assert "(2, *, 4)" in row and "statistics of bfloat16" in row
    shown = _cli("show", str(path), "forward").splitlines()[0]
    assert shown == "forward: 2 records, dtype statistics of bfloat16, shape (2, *, 4)"


def test_compare_flags_statistics_of_different_dtypes(tmp_path: Path) -> None:
    paths = []
    for dtype in (torch.float32, torch.bfloat16):
        path = tmp_path / f"{dtype}.h5"
        with H5PYSaverCallback(path) as saver:
            _run(_Block(dtype), [5, 5], post_gather_callbacks=[saver])
        paths.append(path)
    report = vartrace.compare(*paths)
    site = next(s for s in report.sites if s.site == "forward")
    assert not site.dtype_match
    assert site.dtypes == "statistics of float32 vs statistics of bfloat16"
    same = next(s for s in report.sites if s.site == "forward.scores")
    assert same.dtype_match and same.dtypes == "statistics of float32"
