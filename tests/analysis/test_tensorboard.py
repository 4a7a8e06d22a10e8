"""TensorBoard output, read back with TensorBoard's own event reader."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, TensorBoardCallback, Trace
from vartrace.statistics.named import STATS, reduce_block

pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

STATS_WRITTEN = ("mean", "std", "min", "max", "absmax", "nan", "posinf", "neginf")


class Masked(nn.Module):
    """Attention-like scores with a causal -inf mask, changing every step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x) @ x.transpose(-2, -1)
        mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        return scores.softmax(-1).sum()


def _events(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def _scalars(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


def _expected(value: Any, stat: str) -> float:
    flat = np.asarray(value, dtype=np.float64).reshape(1, -1)
    return float(np.float32(reduce_block(STATS[stat], flat)[0]))


def _train(logdir: Path, path: Path, steps: int = 5) -> None:
    torch.manual_seed(0)
    model = Masked()
    with (
        TensorBoardCallback(logdir) as board,
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward.scores"], post_gather_callbacks=[board, saver]),
    ):
        for _ in range(steps):
            model(torch.randn(4, 4)).backward()


def test_the_callback_writes_each_records_statistics_and_histogram(tmp_path: Path) -> None:
    _train(tmp_path / "board", tmp_path / "run.h5")
    events = _events(tmp_path / "board")
    with vartrace.open(tmp_path / "run.h5") as run:
        site = run["forward.scores"]
        records = {int(i): site.record(n).numpy() for n, i in enumerate(site.iterations)}
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert set(events.Tags()["scalars"]) == {f"forward.scores/{s}" for s in STATS_WRITTEN}
    for stat in STATS_WRITTEN:
        written = _scalars(events, f"forward.scores/{stat}")
        assert written == {i: _expected(v, stat) for i, v in records.items()}, stat
    # The mask: six -inf values a record, left out of the finite statistics.
    assert set(_scalars(events, "forward.scores/neginf").values()) == {6.0}
    assert all(np.isfinite(v) for v in _scalars(events, "forward.scores/min").values())
    histograms = events.Histograms("forward.scores")
    assert [h.step for h in histograms] == [1, 2, 3, 4, 5]
    first = histograms[0].histogram_value
    assert first.num == 10  # the finite values only
    assert first.min == pytest.approx(float(records[1][np.isfinite(records[1])].min()))


def test_the_command_exports_a_finished_run_with_the_same_scalars(tmp_path: Path) -> None:
    _train(tmp_path / "live", tmp_path / "run.h5")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vartrace",
            "tensorboard",
            str(tmp_path / "run.h5"),
            "--logdir",
            str(tmp_path / "exported"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 5 record(s) of 1 site(s)" in result.stdout
    live, exported = _events(tmp_path / "live"), _events(tmp_path / "exported")
    for stat in STATS_WRITTEN:
        tag = f"forward.scores/{stat}"
        assert _scalars(exported, tag) == _scalars(live, tag), stat
    assert len(exported.Histograms("forward.scores")) == 5


def test_the_command_takes_sites_and_statistics(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("a.out", Trace([np.array([1.0, -2.0]), np.array([3.0, 0.5])], [1, 2], [0, 0], [0, 1]))
        saver("b.out", Trace([np.array([5.0])], [1], [0], [2]))
    logdir = tmp_path / "board"
    command = [sys.executable, "-m", "vartrace", "tensorboard", str(path), "--logdir", str(logdir)]
    result = subprocess.run(
        [*command, "--sites", "a.*", "--stat", "max,absmax", "--no-histograms"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    events = _events(logdir)
    assert set(events.Tags()["scalars"]) == {"a.out/max", "a.out/absmax"}
    assert _scalars(events, "a.out/max") == {1: 1.0, 2: 3.0}
    assert _scalars(events, "a.out/absmax") == {1: 2.0, 2: 3.0}
    assert events.Tags()["histograms"] == []
    wrong = subprocess.run(
        [*command, "--stat", "median"], capture_output=True, text=True, timeout=300, check=False
    )
    assert wrong.returncode == 2 and "unknown statistic(s) ['median']" in wrong.stderr


def test_ranks_get_their_own_tags_and_odd_records_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("loss", Trace([1.5, 2.5, 0.5], [1, 1, 2], [0, 1, 0], [0, 1, 2]))
        saver("out", Trace([np.array([1.0, 2.0]), np.array([4.0])], [1, 1], [0, 1], [3, 4]))
        saver("note", Trace(["warm-up"], [1], [0], [5]))
    logdir = tmp_path / "board"
    written = vartrace.analysis.tensorboard.export_run(
        path, logdir, stats=["mean"], histograms=False
    )
    assert written == 5
    events = _events(logdir)
    assert set(events.Tags()["scalars"]) == {
        "loss/rank0",
        "loss/rank1",
        "out/mean/rank0",
        "out/mean/rank1",
    }
    assert _scalars(events, "loss/rank0") == {1: 1.5, 2: 0.5}
    assert _scalars(events, "loss/rank1") == {1: 2.5}
    assert _scalars(events, "out/mean/rank0") == {1: 1.5}
    assert events.Tags()["histograms"] == []


class Loss(nn.Module):
    """A model returning a 0-d loss, and a Python number computed from it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.proj(x).square().mean()
        number = float(loss.detach()) * 2
        return loss + number


def test_a_scalar_record_is_one_chart_of_its_value(tmp_path: Path) -> None:
    """A 0-d loss (or a number) is one series, ``<site>``, not eight statistics of one
    value (four identical, four flat zeros) and no histogram; live and exported alike."""
    torch.manual_seed(0)
    model = Loss()
    path, logdir = tmp_path / "run.h5", tmp_path / "live"
    with (
        TensorBoardCallback(logdir) as board,
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(
            model, ["forward.loss", "forward.number"], post_gather_callbacks=[board, saver]
        ),
    ):
        for _ in range(3):
            model(torch.randn(2, 4)).backward()
    with vartrace.open(path) as run:
        site = run["forward.loss"]
        losses = {int(i): float(site.record(n)) for n, i in enumerate(site.iterations)}
    assert sorted(losses) == [1, 2, 3]
    assert vartrace.analysis.tensorboard.export_run(path, tmp_path / "exported") == 6
    for events in (_events(logdir), _events(tmp_path / "exported")):
        assert set(events.Tags()["scalars"]) == {"forward.loss", "forward.number"}
        assert events.Tags()["histograms"] == []
        assert _scalars(events, "forward.loss") == pytest.approx(losses)
        assert _scalars(events, "forward.number") == pytest.approx(
            {i: 2 * loss for i, loss in losses.items()}
        )


def test_statistics_mode_records_are_written_as_the_statistics_they_hold(tmp_path: Path) -> None:
    model = nn.Linear(8, 8)
    logdir = tmp_path / "board"
    value = torch.tensor([1.0, -3.0, float("nan"), 4.0])
    with TensorBoardCallback(logdir, stats=["absmax", "nan", "mean"]) as board:
        with ModelTracer(
            model,
            ["forward"],
            pre_save_callbacks=[vartrace.stats()],
            post_gather_callbacks=[board],
        ):
            model(torch.ones(1, 8))
        board.write("by.hand", vartrace.stats()("by.hand", value, 7), iteration=7)
    events = _events(logdir)
    assert _scalars(events, "by.hand/absmax") == {7: 4.0}
    assert _scalars(events, "by.hand/nan") == {7: 1.0}
    assert _scalars(events, "by.hand/mean") == {7: pytest.approx(2.0 / 3.0)}
    assert set(_scalars(events, "forward/absmax")) == {1}
    assert "by.hand" not in events.Tags()["histograms"]


def test_an_unknown_statistic_is_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown statistic\(s\) \['median'\]"):
        TensorBoardCallback(tmp_path, stats=["mean", "median"])
    assert list(tmp_path.iterdir()) == []


def test_without_tensorboard_the_error_names_the_extra(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["tensorboard"] = None  # as if it were not installed
        sys.modules["torch.utils.tensorboard"] = None
        import vartrace
        try:
            vartrace.TensorBoardCallback({str(tmp_path)!r})
        except ImportError as error:
            print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "pip install 'torch-vartrace[tensorboard]'" in result.stdout, result.stderr
