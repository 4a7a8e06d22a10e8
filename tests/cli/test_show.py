"""`vartrace show`, run as a real subprocess: what it says of an iteration a live run has not
flushed yet or a finished run never reached, and how it shows statistics records."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import vartrace
from tests.cli.test_cli import vartrace as command
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace


def _records(saver: H5PYSaverCallback, name: str, steps: list[int]) -> None:
    values = [torch.full((3,), float(step)) for step in steps]
    saver(name, Trace(values, steps, [0] * len(steps), steps))


def test_show_says_not_flushed_yet_on_a_live_run_and_after_the_end_on_a_finished_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.h5"
    saver = H5PYSaverCallback(path, metadata=False)
    try:
        _records(saver, "loss", [1, 2, 3])
        _records(saver, "weights", [1])  # unchanged since: stored once
        saver.flush()
        with vartrace.open(path) as run:
            assert run.live
        ahead = command("show", path, "loss", "-i", "5")
        assert ahead.returncode == 0, ahead.stderr
        assert ahead.stdout.splitlines()[0] == (
            "loss @ iteration 5, rank 0: not flushed yet (live; last flush at 3); "
            "its last record: iteration 3 (capture order 3)"
        )
        held = command("show", path, "weights", "-i", "3")
        assert held.stdout.splitlines()[0] == (
            "weights @ iteration 3, rank 0: unchanged since iteration 1 (capture order 1)"
        )
        assert "unchanged" not in command("show", path, "weights", "-i", "4").stdout
    finally:
        saver.close()
    past = command("show", path, "loss", "weights", "-i", "2000")
    assert past.returncode == 0, past.stderr
    lines = past.stdout.splitlines()
    assert lines[0] == (
        "loss @ iteration 2000, rank 0: after the run's last iteration (3); "
        "its last record: iteration 3 (capture order 3)"
    )
    assert "weights @ iteration 2000, rank 0: after the run's last iteration (3)" in past.stdout


class _Spiky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        if x.abs().max() > 50:  # the planted spike: a NaN and a large value
            y = y.clone()
            y[0, 0] = float("nan")
            y[0, 1] = 1e4
        return y


def test_show_of_a_statistics_site_shows_every_field_the_dtype_and_the_shape(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stats.h5"
    model = _Spiky()
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        vartrace.ModelTracer(
            model,
            ["forward"],
            pre_save_callbacks=[vartrace.stats()],
            post_gather_callbacks=[saver],
        ),
    ):
        for iteration in (1, 2, 3):
            model(torch.ones(4, 8) * (100 if iteration == 2 else 1))
    shown = command("show", path, "forward")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "forward: 3 records, dtype statistics of float32, shape (4, 8)"
    header = lines[2].split()
    assert header[:3] == ["iteration", "rank", "shape"]
    assert {"absmax", "nan", "mean", "std", "min", "max", "count"} <= set(header)
    cells = [line.replace("(4, 8)", "(4,8)").split() for line in lines[4:]]
    rows = [dict(zip(header, row, strict=True)) for row in cells]
    assert [row["shape"] for row in rows] == ["(4,8)"] * 3, "not 'statistics'"
    assert [row["nan"] for row in rows] == ["0", "1", "0"]
    assert rows[1]["absmax"] == "10000" and rows[1]["count"] == "32"
    at = command("show", path, "forward", "-i", "2")
    assert "of shape (4, 8)  dtype float32" in at.stdout and "absmax 10000" in at.stdout
