"""vartrace.analysis.plot: statistic curves and similarity heat maps written as real PNG files."""

from __future__ import annotations

import inspect
import itertools
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from vartrace.analysis.plot import plot_similarity, plot_stat
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
    assert bar.get_ylabel() == "40 sites, in name order"
    labels = [tick.get_text() for tick in bar.get_yticklabels()]
    assert labels[0] == "layers.0.attn.forward.scores"
    assert labels[-1] == "layers.39.attn.forward.scores"
    numbers = [int(label.split(".")[1]) for label in labels]
    assert numbers == sorted(numbers), "blocks.2 before blocks.10: execution order"
    lines = fig.axes[0].get_lines()
    assert len(lines) == 40 and lines[0].get_color() != lines[-1].get_color()


# -- masked attention (-inf): finite axes, no numpy warning, one definition everywhere ----------


def _masked_attention_run(path, seed: int = 0, steps: int = 4) -> None:
    """A real run of a tiny causal-attention model whose logits use masked_fill(-inf)."""
    import torch
    from torch import nn

    import vartrace

    class SelfAttention(nn.Module):
        def __init__(self, d: int = 8) -> None:
            super().__init__()
            self.qk = nn.Linear(d, 2 * d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = self.qk(x).chunk(2, -1)
            logits = q @ k.transpose(-2, -1)
            causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            logits = logits.masked_fill(causal, -math.inf)
            return logits.softmax(-1) @ x

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = SelfAttention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.self_attn(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(seed)
    model = Model()
    with (
        vartrace.H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(
            model, ["blocks.*.self_attn.forward.logits"], post_gather_callbacks=[saver]
        ),
    ):
        for _ in range(steps):
            model(torch.randn(2, 5, 8)).sum().backward()


LOGITS = "blocks.*.self_attn.forward.logits"


@pytest.fixture
def masked(tmp_path):
    _masked_attention_run(tmp_path / "a.h5")
    _masked_attention_run(tmp_path / "b.h5", seed=1)
    return tmp_path


def test_masked_attention_plots_finite_axes_and_drawn_lines(masked) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_stat(masked / "a.h5", LOGITS, "mean,std,min,max,neginf", masked / "out.png")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert_png(masked / "out.png")
    for ax in fig.axes:
        assert all(math.isfinite(limit) for limit in (*ax.get_xlim(), *ax.get_ylim()))
        assert ax.get_xlim()[1] - ax.get_xlim()[0] > 1  # iterations 1..4, not -0.04..0.04
        lines = ax.get_lines()
        assert len(lines) == 3
        for line in lines:
            assert np.isfinite(line.get_ydata()).all() and len(line.get_ydata()) == 4
    neginf = fig.axes[-1].get_lines()[0].get_ydata()
    assert list(neginf) == [20.0] * 4  # 2 x (5 x 5 causal mask: 10 above the diagonal)


def test_masked_attention_compares_with_itself_without_a_warning(masked) -> None:
    import vartrace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = vartrace.compare(masked / "a.h5", masked / "a.h5")
        frame = report.to_frame()
        differing = vartrace.compare(masked / "a.h5", masked / "b.h5")
        fig = plot_similarity(None, None, comparison=differing)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], caught
    assert report.ok and report.first_divergence is None
    assert np.isfinite(frame[["mean_a", "std_a", "mean_diff", "cosine"]].to_numpy()).all()
    assert (frame["cosine"] == 1.0).all()
    assert not differing.ok
    cells = fig.axes[0].get_images()[0].get_array()
    assert not np.ma.getmaskarray(cells).any(), "a differing record painted as 'no record'"


def test_masked_attention_one_definition_in_every_view(masked, capsys) -> None:
    import vartrace
    from vartrace.cli import main

    path = masked / "a.h5"
    with vartrace.open(path) as run:
        site = run["blocks.1.self_attn.forward.logits"]
        value = site.get(2).double().numpy()
        frame = run.to_frame(["mean", "std", "max", "neginf"], names=[site.name])
    finite = value[np.isfinite(value)]
    row = frame.set_index("iteration").loc[2]
    assert row["mean"] == pytest.approx(finite.mean()) and row["max"] == finite.max()
    assert row["std"] == pytest.approx(finite.std()) and row["neginf"] == 20
    report = vartrace.compare(path, path, names=site.name).to_frame().set_index("iteration")
    assert report.loc[2, "mean_a"] == pytest.approx(finite.mean())
    assert report.loc[2, "std_a"] == pytest.approx(finite.std())
    assert main(["show", str(path), site.name, "-i", "2"]) == 0
    summary = capsys.readouterr().out.splitlines()[2].split()
    assert summary[:4] == ["mean", f"{finite.mean():.6g}", "std", f"{finite.std():.6g}"]
    assert summary[-2:] == ["-inf", "20"] and "(over finite values)" in " ".join(summary)


def test_masked_attention_cli_prints_no_runtime_warning(masked) -> None:
    for args in (
        ["compare", masked / "a.h5", masked / "a.h5"],
        ["plot", masked / "a.h5", masked / "b.h5", "-o", masked / "heat.png"],
        ["plot", masked / "a.h5", LOGITS, "-o", masked / "lines.png"],
        ["show", masked / "a.h5", "blocks.0.self_attn.forward.logits"],
    ):
        result = subprocess.run(
            [sys.executable, "-W", "always", "-m", "vartrace", *map(str, args)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        assert "Warning" not in result.stderr, result.stderr
    assert "(statistics over finite values; NaN and infinities counted)" in result.stdout
    assert "-inf" in result.stdout.splitlines()[2]


# -- the pages that show `vartrace plot` install matplotlib first ------------------------------


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_a_page_that_plots_installs_the_plot_extra_first(page) -> None:
    """A newcomer copying the page's commands in order has matplotlib when they plot: the
    first command installing vartrace, before `vartrace plot`, names the plot extra."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / page).read_text()
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL))
    before = commands[: commands.index("vartrace plot ")].splitlines()
    installs = [line for line in before if re.search(r"pip install (-e |\S*torch-vartrace)", line)]
    assert installs, f"{page} plots before any command installs vartrace"
    assert "[plot]" in installs[0], installs[0]


# -- values at the dtype's finfo.min (an attention mask) do not scale the plot to 3.4e38 -----


def _finfo_masked_run(path, dtype, statistics: bool = False, steps: int = 3) -> None:
    """A real run of `scores@every` on attention masked with ``torch.finfo(dtype).min`` (as
    transformers does): per call the scores, the masked scores, the probabilities."""
    import torch
    from torch import nn

    import vartrace

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.proj(x) @ x.transpose(-2, -1)
            causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
            scores = scores.softmax(-1)
            return scores @ x

    torch.manual_seed(0)
    model = Attention().to(dtype)
    with (
        vartrace.H5PYSaverCallback(path, metadata=False) as saver,
        vartrace.ModelTracer(
            model, ["forward.scores@every"], post_gather_callbacks=[saver], statistics=statistics
        ),
    ):
        for _ in range(steps):
            model(torch.randn(4, 6).to(dtype))


@pytest.mark.parametrize(
    ("dtype_name", "statistics"),
    [("float32", False), ("bfloat16", False), ("float32", True)],
)
def test_finfo_min_mask_values_are_left_out_of_the_scale_with_a_note(
    tmp_path, dtype_name, statistics
) -> None:
    import torch

    import vartrace

    path = tmp_path / "run.h5"
    _finfo_masked_run(path, getattr(torch, dtype_name), statistics)
    source, first = inspect.getsourcelines(_finfo_masked_run)
    computed, masking, softmax = (
        f"forward.scores@every:L{first + n}"
        for statement in (
            "scores = self.proj(",
            "scores = scores.masked_fill(",
            "scores = scores.softmax(",
        )
        for n, text in enumerate(source)
        if text.strip().startswith(statement)
    )
    with vartrace.open(path) as run:
        assert {name: len(run[name]) for name in run} == {computed: 3, masking: 3, softmax: 3}
    pattern = "forward.scores@every:L*"  # the 3 bindings, 3 steps each
    fig = plot_stat(path, pattern, "mean,min,absmax,zeros", tmp_path / "out.png")
    assert_png(tmp_path / "out.png")
    with vartrace.open(path) as run:
        frame = run.to_frame(["mean", "min", "absmax", "zeros"])
    floor = float(torch.finfo(getattr(torch, dtype_name)).min)
    masked = (frame["min"] == floor).to_numpy()
    assert masked.sum() == 3  # the masked scores of each step: the records left out
    assert set(frame["site"][masked]) == {masking}  # those of the masking line
    for ax, stat in zip(fig.axes[:3], ("mean", "min", "absmax"), strict=True):
        drawn = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
        assert list(drawn) == [computed, masking, softmax]  # a curve per binding
        assert np.isnan(drawn[masking]).all(), (stat, drawn)  # not drawn as points of it
        y = np.concatenate(list(drawn.values()))
        assert np.isnan(y).sum() == 3, (stat, y)
        np.testing.assert_allclose(y[~np.isnan(y)], frame[stat].to_numpy()[~masked], rtol=1e-6)
        low, high = ax.get_ylim()
        assert -100 < low < high < 100, (stat, low, high)  # scaled to scores, probabilities
        edge = np.concatenate([c.get_offsets() for c in ax.collections])
        assert len(edge) == 3 and set(edge[:, 1]) == ({0.0} if stat != "absmax" else {1.0})
        assert [t.get_text() for t in ax.texts] == [
            "\u25bc\u25b2 3 record(s) holding values at their dtype's finfo.min/max "
            "(a mask): off this scale"
        ]
    zeros = fig.axes[3]  # a count: every record drawn, no note
    y = np.concatenate([line.get_ydata() for line in zeros.get_lines()])
    assert np.isfinite(y).all() and len(y) == 9 and len(zeros.texts) == 0
