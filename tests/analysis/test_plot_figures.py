"""Figures for a paper from one command: sites ordered and coloured by name (a layer keeps
its colour from the forward figure to the gradient one), scalar sites labelled by what they
hold, and a title, y label and log scale of one's own.  Checked on the figure's artists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from vartrace.analysis.plot import plot_stat
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace

LAYERS = 12


def _run(kind: str, backwards: bool = False, scalar: bool = False) -> dict[str, Trace]:
    """Sites `layers.<k>.<kind>` over 4 iterations, recorded first to last layer (or last to
    first, as gradients are); a scalar per record, or a vector."""
    results: dict[str, Trace] = {}
    order = 0
    for iteration in range(1, 5):
        layers = range(LAYERS - 1, -1, -1) if backwards else range(LAYERS)
        for k in layers:
            value = np.float32(0.5 + k + iteration) if scalar else np.full(8, k, np.float32)
            results.setdefault(f"layers.{k}.{kind}", Trace()).append(
                np.asarray(value), iteration, 0, order
            )
            order += 1
    return results


def _colours(figure) -> dict[str, tuple[float, ...]]:
    return {line.get_label(): tuple(line.get_color()) for line in figure.axes[0].get_lines()}


def test_a_layer_has_the_same_colour_and_place_forward_and_backward() -> None:
    forward = plot_stat(_run("forward"), "layers.?.forward", "mean")
    backward = plot_stat(_run("grad", backwards=True), "layers.?.grad", "mean")
    ahead, behind = _colours(forward), _colours(backward)
    assert [name.split(".")[1] for name in ahead] == [str(k) for k in range(10)]
    assert [name.split(".")[1] for name in behind] == [str(k) for k in range(10)]
    for k in range(10):
        assert ahead[f"layers.{k}.forward"] == behind[f"layers.{k}.grad"], k
    legend = [text.get_text() for text in backward.legends[0].get_texts()]
    assert legend == [f"layers.{k}.grad" for k in range(10)]


def test_sites_are_in_name_order_with_numbers_as_numbers() -> None:
    figure = plot_stat(_run("grad", backwards=True), "layers.*", "mean")
    labels = [line.get_label() for line in figure.axes[0].get_lines()]
    assert labels == [f"layers.{k}.grad" for k in range(LAYERS)]  # 2 before 10, 0 first


def test_scalar_sites_are_labelled_by_what_they_hold() -> None:
    figure = plot_stat(_run("entropy", scalar=True), "layers.*.entropy")
    assert len(figure.axes) == 1, "a scalar has no std to plot"
    ax = figure.axes[0]
    assert ax.get_ylabel() == "entropy"
    assert ax.get_title().startswith("entropy over iterations")
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_ydata(), [1.5, 2.5, 3.5, 4.5])


def test_title_ylabel_and_log_scale_of_ones_own() -> None:
    run = _run("entropy", scalar=True)
    figure = plot_stat(run, "layers.*", title="Attention entropy", ylabel="nats", logy=True)
    ax = figure.axes[0]
    assert ax.get_title() == "Attention entropy"
    assert ax.get_ylabel() == "nats" and ax.get_yscale() == "log"
    two = plot_stat(run, "layers.*", "mean,min", ylabel="nats", logy=True)
    assert [a.get_ylabel() for a in two.axes[:2]] == ["nats (mean)", "nats (min)"]
    negative = {name: Trace() for name in ("x",)}
    for iteration, value in enumerate((-1.0, 0.0, 10.0), 1):
        negative["x"].append(np.asarray(value, np.float32), iteration, 0, iteration)
    assert plot_stat(negative, "x", logy=True).axes[0].get_yscale() == "symlog"


def test_the_command_takes_title_ylabel_and_logy(tmp_path: Path) -> None:
    path = tmp_path / "norms.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        for name, trace in _run("grad_norm", backwards=True, scalar=True).items():
            saver(name, trace)
    out = tmp_path / "norms.png"
    options = ["--title", "Gradient norm per layer", "--ylabel", "norm", "--logy"]
    done = subprocess.run(
        [sys.executable, "-m", "vartrace", "plot", str(path), "layers.*", "-o", str(out), *options],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip() == f"wrote {out} (norm over iterations, {LAYERS} line(s) per statistic)"
    )
    assert out.read_bytes().startswith(b"\x89PNG")


def test_plot_stat_is_at_the_top_level_too() -> None:
    import vartrace
    import vartrace.plot

    assert vartrace.plot_stat is vartrace.plot.plot_stat is plot_stat
