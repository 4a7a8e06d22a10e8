"""vartrace.plot: statistic curves and similarity heat maps written as real PNG files."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from vartrace.plot import plot_similarity, plot_stat
from vartrace.trace import Trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(n_sites: int = 5, iterations: int = 6, ranks: int = 1, drift: float = 0.0) -> dict:
    results: dict[str, Trace] = {}
    order = 0
    rng = np.random.default_rng(0)
    for iteration in range(1, iterations + 1):
        for k in range(n_sites):
            name = f"layers.{k}.attn.forward.scores"
            base = np.sin(np.arange(32, dtype=np.float32) * (k + 1) + iteration)
            for rank in range(ranks):
                value = base + rank
                if drift and k >= n_sites // 2:
                    value = value + rng.standard_normal(32).astype(np.float32) * drift * iteration
                results.setdefault(name, Trace()).append(value, iteration, rank, order)
                order += 1
    return results


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def test_plot_stat_one_subplot_per_stat_one_line_per_rank(tmp_path) -> None:
    run = make_run(ranks=2)
    path = tmp_path / "stats.png"
    fig = plot_stat(
        run, ["layers.0.attn.forward.scores", "layers.1.*"], ("mean", "std", "max"), path
    )
    assert_png(path)
    assert len(fig.axes) == 3
    for ax, stat in zip(fig.axes, ("mean", "std", "max"), strict=True):
        assert ax.get_ylabel() == stat
        assert len(ax.get_lines()) == 4  # 2 sites x 2 ranks
    assert fig.axes[-1].get_xlabel() == "iteration"
    line = fig.axes[0].get_lines()[0]
    expected = [np.sin(np.arange(32) * 1.0 + it).mean() for it in range(1, 7)]
    np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(line.get_xdata(), np.arange(1, 7))
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert "layers.0.attn.forward.scores [rank 1]" in labels


def test_plot_stat_accepts_comma_separated_stats_and_rejects_unknown() -> None:
    run = make_run()
    fig = plot_stat(run, "layers.2.attn.forward.scores", "mean,absmax")
    assert [ax.get_ylabel() for ax in fig.axes] == ["mean", "absmax"]
    with pytest.raises(ValueError, match="unknown statistic 'median'"):
        plot_stat(run, "layers.2.attn.forward.scores", "median")
    with pytest.raises(KeyError, match="no site 'nope'"):
        plot_stat(run, "nope")
    run["text"] = Trace(["a", "b"], [1, 2], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="no numeric values"):
        plot_stat(run, "text")


def test_plot_similarity_fifty_sites(tmp_path) -> None:
    a = make_run(n_sites=50, iterations=40)
    b = make_run(n_sites=50, iterations=40, drift=1e-3)
    path = tmp_path / "similarity.png"
    fig = plot_similarity(a, b, path)
    assert_png(path)
    heat = fig.axes[0]
    image = heat.get_images()[0]
    data = image.get_array()
    assert data.shape == (50, 40)
    assert np.all(data[:25] == 1.0) and np.all(data[25:] < 1.0)
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert labels[0] == "layers.0.attn.forward.scores" and len(labels) == 50
    _, height = fig.get_size_inches()
    assert height >= 8  # grows with the number of sites
    # Tick labels must not overlap: consecutive site labels are laid out apart.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in heat.get_yticklabels()]
    assert all(not b1.overlaps(b2) for b1, b2 in itertools.pairwise(boxes))
    assert len(heat.collections) == 1  # the beyond-tolerance markers


def test_plot_similarity_needs_common_sites() -> None:
    with pytest.raises(ValueError, match="no site in common"):
        plot_similarity({"x": Trace([np.ones(2)], [1], [0], [0])}, {"y": Trace()})


def test_plot_stat_of_forty_sites_names_them_on_a_colour_bar_in_execution_order(tmp_path) -> None:
    run = make_run(n_sites=40, iterations=3)
    path = tmp_path / "many.png"
    fig = plot_stat(run, "layers.*", "mean", path)
    assert_png(path)
    assert not fig.legends, "a 40-entry legend would be cut off"
    bar = fig.axes[-1]
    assert bar.get_ylabel() == "40 sites, in execution order"
    labels = [tick.get_text() for tick in bar.get_yticklabels()]
    assert labels[0] == "layers.0.attn.forward.scores"
    assert labels[-1] == "layers.39.attn.forward.scores"
    numbers = [int(label.split(".")[1]) for label in labels]
    assert numbers == sorted(numbers), "blocks.2 before blocks.10: execution order"
    lines = fig.axes[0].get_lines()
    assert len(lines) == 40 and lines[0].get_color() != lines[-1].get_color()
