"""`site@every` reads every binding of a variable as one series, in execution order.

A recurrence rebinds `h` on three lines (the first before a loop, one in it, one after,
changing its dtype and its axes); the line sites stay, and `forward.h@every` (or the
plain `forward.h`, since `h` was recorded only `@every`) reads every value `h` took, as
computed by hand: in `tracer.results`, in a real HDF5 file, through `in`, `names=`,
`get`, `to_frame`, `plot` and the real CLI's `show`, `plot` and `compare`.  The names
list each record once, under its line site.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    (found,) = [n for n, text in enumerate(_SOURCE, 1) if text.endswith(f"# {marker}")]
    return found


class Recurrence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x)  # start
        for _ in range(2):
            h = torch.tanh(self.cell(h))  # step
        h = (h * 100).round().long().reshape(3, 1)  # end
        return h.float()


SERIES = "forward.h@every"
LINES = [f"{SERIES}:L{_line(marker)}" for marker in ("start", "step", "end")]


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(3, generator=generator) for _ in range(3)]


def _by_hand(model: Recurrence) -> list[list[torch.Tensor]]:
    """Every value `h` took in each call, in the order it took them."""
    calls = []
    with torch.no_grad():
        for x in _inputs():
            h = model.cell(x)
            taken = [h]
            for _ in range(2):
                h = torch.tanh(model.cell(h))
                taken.append(h)
            taken.append((h * 100).round().long().reshape(3, 1))
            calls.append(taken)
    return calls


def _traced(path: Path | None = None, patterns: tuple[str, ...] = ("forward.h@every",)) -> tuple:
    torch.manual_seed(0)
    model = Recurrence()
    callbacks = [H5PYSaverCallback(path, metadata=False)] if path else []
    with ModelTracer(model, list(patterns), post_gather_callbacks=callbacks) as tracer:
        for x in _inputs():
            model(x)
    for callback in callbacks:
        callback.close()
    return model, tracer


def _assert_series(values: list, iterations: list[int], expected: list[list[torch.Tensor]]) -> None:
    flat = [value for call in expected for value in call]
    assert iterations == [i for i, call in enumerate(expected, 1) for _ in call]
    assert len(values) == len(flat)
    for got, want in zip(values, flat, strict=True):
        got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def test_results_read_every_binding_as_one_series_in_execution_order() -> None:
    model, tracer = _traced()
    results = tracer.results
    assert list(results) == LINES  # each record listed once: under its line site
    assert results.series == {SERIES: LINES}
    assert SERIES in results and "forward.h" in results and "forward.g" not in results
    series = results[SERIES]
    expected = _by_hand(model)
    _assert_series(series.records(), list(series.iterations), expected)
    assert list(series.order) == sorted(series.order)
    assert series.sites == [LINES[0], LINES[1], LINES[1], LINES[2]] * 3
    plain = results["forward.h"]
    assert plain.sites == series.sites and list(plain.order) == list(series.order)
    assert torch.equal(series.get(2), expected[1][-1])
    assert [torch.equal(a, b) for a, b in zip(series.calls(3), expected[2], strict=True)] == [
        True
    ] * 4
    with pytest.raises(KeyError, match="no record at or before iteration 0"):
        series.get(0)
    with pytest.raises(TypeError, match="read-only"):
        series.append(torch.zeros(3), 4, 0, 99)
    frame = series.to_frame("max")
    assert frame["site"].unique().tolist() == [SERIES] and len(frame) == 12
    everything = results.to_frame()  # one row per stored record: the line sites'
    assert sorted(everything["site"].unique()) == sorted(LINES) and len(everything) == 12


def test_a_run_file_reads_the_series_exactly_with_its_dtypes_and_axes(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    model, _ = _traced(path)
    expected = _by_hand(model)
    with vartrace.open(path) as run:
        assert run.names == LINES
        assert run.series == {SERIES: LINES}
        assert SERIES in run and "forward.h" in run and len(run) == 3
        site = run["forward.h"]
        assert site.name == SERIES and run[SERIES] is site and len(site) == 12
        records = [site.record(i) for i in range(len(site))]
        _assert_series(records, site.iterations.tolist(), expected)
        assert site.order.tolist() == sorted(site.order.tolist())
        assert site.in_values.tolist() == [True, True, True, False] * 3  # the int64 (3, 1)
        assert site.dtype == "float32" and site.values.shape == (12, 3)
        np.testing.assert_array_equal(site.values[1], expected[0][1].numpy())
        assert torch.equal(site.get(3), expected[2][-1])
        assert len(site.calls(1)) == 4
        frame = site.to_frame("max")
        assert frame["site"].unique().tolist() == [SERIES] and frame["dtype"].tolist()[3] == "int64"
        assert sorted(run.to_frame()["site"].unique()) == sorted(LINES)
        named = run.to_frame("max", names=[SERIES])
        assert named["order"].tolist() == site.order.tolist()


def test_a_plain_name_that_another_timing_stored_keeps_its_own_records(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _traced(path, ("forward.h", "forward.h@every"))
    with vartrace.open(path) as run:
        assert run.names == [*LINES, "forward.h"] and run.series == {SERIES: LINES}
        assert len(run["forward.h"]) == 3 and run["forward.h"].name == "forward.h"
        assert len(run[SERIES]) == 12
    _, tracer = _traced(None, ("forward.h", "forward.h@every"))
    assert len(tracer.results["forward.h"]) == 3 and len(tracer.results[SERIES]) == 12


def _cli(*args: object, code: int = 0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stdout + done.stderr
    return done.stdout


def test_the_command_line_lists_shows_plots_and_compares_the_series(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.h5"
    _traced(path)
    listed = _cli("ls", path)
    assert all(name in listed for name in LINES), listed
    assert f"  {SERIES} = {' + '.join(LINES)}" in listed, listed  # the series, named
    shown = _cli("show", path, "forward.h", "--iteration", "2")
    assert f"{SERIES} @ iteration 2" in shown, shown
    lines_shown = _cli("show", path, "forward.*", "--iteration", "2")
    assert f"{SERIES} @" not in lines_shown and f"{LINES[0]} @ iteration 2" in lines_shown
    out = tmp_path / "h.png"
    plotted = _cli("plot", path, "forward.h", "--stat", "mean", "-o", out)
    assert "1 line(s) per statistic" in plotted and out.stat().st_size
    compared = _cli("compare", path, path, "--names", SERIES)
    assert SERIES in compared and "12 record pairs" in compared, compared
