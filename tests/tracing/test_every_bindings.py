"""`@every` records you can tell apart: each binding (source line) is a site of its own.

An attention computed as GPT-2's is (scores, masked in place at `finfo.min`, softmaxed)
read `scores@every` gives `forward.scores@every:L<line>` for each of those lines, so
`to_frame`, `show`, `plot` and `compare` key by binding with no step of their own.  Real
tracers, real HDF5 files and the real CLI; lines are found by the comments that end them.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    """The line of this file that ends in the comment `# <marker>`."""
    (found,) = [n for n, text in enumerate(_SOURCE, 1) if text.endswith(f"# {marker}")]
    return found


def eager_attention(query: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    attn_weights = query @ x.transpose(-2, -1)  # callee scores
    attn_weights = attn_weights + mask  # callee masked
    attn_weights = attn_weights.softmax(-1)  # callee softmax
    return attn_weights @ x


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, detour: bool = False) -> torch.Tensor:
        scores = self.proj(x) @ x.transpose(-2, -1)  # scores
        causal = torch.ones(4, 4, dtype=torch.bool).triu(1)  # no binding of scores
        scores.masked_fill_(causal, torch.finfo(scores.dtype).min)  # masked in place
        scores = scores.softmax(-1)  # softmax
        if detour:
            unused = scores * 2
            scores = unused
        mask = torch.zeros(4, 4).masked_fill(causal, float("-inf"))
        return scores @ x + eager_attention(self.proj(x), x, mask)


SCORES = f"forward.scores@every:L{_line('scores')}"
MASKED = f"forward.scores@every:L{_line('masked in place')}"
SOFTMAX = f"forward.scores@every:L{_line('softmax')}"


def _inputs(steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=generator) for _ in range(steps)]


def _traced(paths: list[str], path: Path | None = None) -> tuple[Attention, ModelTracer]:
    torch.manual_seed(0)
    model = Attention()
    with H5PYSaverCallback(path, metadata=False) if path else contextlib.nullcontext() as saver:
        callbacks = [saver] if saver is not None else []
        with ModelTracer(model, paths, post_gather_callbacks=callbacks) as tracer:
            for x in _inputs():
                model(x)
    return model, tracer


def test_each_binding_is_a_site_with_one_record_per_call() -> None:
    model, tracer = _traced(["forward.scores@every"])
    assert list(tracer.results) == [SCORES, MASKED, SOFTMAX]
    floor = torch.finfo(torch.float32).min
    with torch.no_grad():
        for i, x in enumerate(_inputs()):
            raw = model.proj(x) @ x.T
            causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
            torch.testing.assert_close(tracer.results[SCORES].values[i], raw)
            masked = tracer.results[MASKED].values[i]
            assert (masked[causal] == floor).all() and torch.equal(masked[~causal], raw[~causal])
            torch.testing.assert_close(
                tracer.results[SOFTMAX].values[i], raw.masked_fill(causal, floor).softmax(-1)
            )
    for name in (SCORES, MASKED, SOFTMAX):
        assert list(tracer.results[name].iterations) == [1, 2, 3], name


def test_a_called_function_s_bindings_are_keyed_by_its_own_lines() -> None:
    _, tracer = _traced(["forward>eager_attention.attn_weights@every", "forward>eager_attention"])
    segment = "forward>eager_attention.attn_weights@every:L"
    assert list(tracer.results) == [
        *(f"{segment}{_line(f'callee {step}')}" for step in ("scores", "masked", "softmax")),
        "forward>eager_attention",
    ]
    masked = tracer.results[f"{segment}{_line('callee masked')}"].values[0]
    assert masked.isneginf().sum() == 6  # the causal mask's -inf, above the diagonal


def test_a_star_star_pattern_keys_by_line_and_aliases_the_same_tensor() -> None:
    """`x` is the method's argument and the function's: one tensor, stored once, under the
    first name with its line; the other name with its own line reads as it."""
    _, tracer = _traced(["**.x@every"])
    method = f"forward.x@every:L{Attention.forward.__code__.co_firstlineno}"
    callee = f"forward>eager_attention.x@every:L{eager_attention.__code__.co_firstlineno}"
    assert tracer.results.stored == [method]
    assert tracer.results.aliases == {callee: method}
    for mine, read in zip(_inputs(), tracer.results[callee].values, strict=True):
        torch.testing.assert_close(read, mine)


def test_a_line_in_the_pattern_records_that_binding_only() -> None:
    _, tracer = _traced([f"forward.scores@every:L{_line('masked in place')}"])
    assert list(tracer.results) == [MASKED]
    assert len(tracer.results[MASKED].values) == 3


def test_a_line_that_runs_no_code_of_the_method_is_refused_naming_its_lines() -> None:
    first = Attention.forward.__code__.co_firstlineno
    with pytest.raises(ValueError, match=r"line 3 runs no code of forward \(lines") as caught:
        ModelTracer(Attention(), ["forward.scores@every:L3"])
    assert f"lines {first}-" in str(caught.value) and __file__ in str(caught.value)
    with pytest.raises(ValueError, match="a line follows @every only"):
        ModelTracer(Attention(), [f"forward.scores@return:L{_line('scores')}"])
    with pytest.raises(ValueError, match=r"forward is a return value, .* drop :L"):
        ModelTracer(Attention(), [f"forward@every:L{_line('scores')}"])


def test_patterns_that_recorded_nothing_are_still_told_and_the_others_are_not() -> None:
    never = f"forward.scores@every:L{_line('no binding of scores')}"  # runs, binds nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _traced(["forward.scores@every", "forward.unused@every", never])
    silent = sorted(str(w.message) for w in caught if "recorded nothing" in str(w.message))
    assert len(silent) == 2, silent
    line = _line("no binding of scores")
    assert silent[0].startswith(
        f"vartrace: pattern {never!r} recorded nothing: line {line} bound no value of it"
    )
    assert silent[1].startswith("vartrace: pattern 'forward.unused@every' recorded nothing")


def test_a_file_keys_by_binding_in_to_frame_plot_show_and_compare(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from vartrace.analysis.plot import plot_stat

    path = tmp_path / "run.h5"
    _traced(["forward.scores@every"], path)
    with vartrace.open(path) as run:
        assert run.names == [SCORES, MASKED, SOFTMAX]
        frame = run.to_frame(["mean", "min"])
        assert len(run["forward.scores@every"]) == 9  # the three bindings, as one series
        assert run.series == {"forward.scores@every": [SCORES, MASKED, SOFTMAX]}
    assert frame.groupby("site", sort=False).size().to_dict() == {
        SCORES: 3,
        MASKED: 3,
        SOFTMAX: 3,
    }
    pre = frame[frame["site"] == SCORES]
    figure = plot_stat(path, SCORES, "mean,min", tmp_path / "pre-softmax.png")
    for ax, stat in zip(figure.axes, ("mean", "min"), strict=True):
        (curve,) = ax.get_lines()  # one series: the pre-softmax scores, no mask in its scale
        np.testing.assert_allclose(np.asarray(curve.get_ydata()), pre[stat], rtol=1e-6)
        assert abs(np.asarray(curve.get_ydata())).max() < 1e3

    shown = _cli("show", path, "forward.scores@every:L*", "--iteration", "2")
    assert [line.split(" @ ")[0] for line in shown.splitlines() if " @ iteration " in line] == [
        SCORES,
        MASKED,
        SOFTMAX,
    ]
    assert "call 1 of" not in shown
    compared = _cli("compare", path, path)
    assert all(name in compared for name in (SCORES, MASKED, SOFTMAX)), compared


def _cli(*args: object) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "vartrace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_list_sites_and_patterns_without_a_line_are_unchanged() -> None:
    model = Attention()
    assert vartrace.list_sites(model, "forward.scores@every") == ["forward.scores"]
    assert vartrace.list_sites(model, f"forward.scores@every:L{_line('scores')}") == [
        "forward.scores"
    ]
    with pytest.raises(ValueError, match=r"closest existing sites: forward\.scores"):
        ModelTracer(model, ["forward.scroes@every"])
