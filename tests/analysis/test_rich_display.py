"""A run, a site and a comparison in a notebook (`_repr_html_`): what they hold, every
string from the file escaped (a site named like markup shows as text)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vartrace
from tests._models import TinyTransformer, tokens

NASTY = "<img src=x onerror=alert(1)>&"


def _write(path: Path, scale: float = 1.0) -> Path:
    model = TinyTransformer()
    with (
        vartrace.H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(model, ["head.forward.input"], post_gather_callbacks=[saver]),
    ):
        for step in range(3):
            model(tokens(step))
            vartrace.record(NASTY, torch.full((4,), float(step) * scale))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("display")
    return _write(folder / "a.h5"), _write(folder / "b.h5", scale=2.0)


def test_a_run_shows_its_state_and_a_row_per_site(runs: tuple[Path, Path]) -> None:
    with vartrace.open(runs[0]) as run:
        page = run._repr_html_()
    assert "<li>state: closed</li>" in page and "<li>sites: 2</li>" in page
    assert "<li>records: 6</li>" in page
    assert "<th>site</th><th>records</th><th>dtype</th><th>bytes</th>" in page
    assert "<td>head.forward.input</td><td>3</td><td>float32</td>" in page
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;&amp;" in page


def test_a_site_shows_records_dtype_bytes_and_iterations(runs: tuple[Path, Path]) -> None:
    with vartrace.open(runs[0]) as run:
        page = run[NASTY]._repr_html_()
    assert "<strong>Site &lt;img src=x onerror=alert(1)&gt;&amp;</strong>" in page
    assert "<li>records: 3</li>" in page and "<li>dtype: float32</li>" in page
    assert "<li>bytes: 48 bytes</li>" in page and "<li>iterations: 1-3</li>" in page


def test_a_comparison_shows_its_table(runs: tuple[Path, Path]) -> None:
    report = vartrace.compare(*runs)
    page = report._repr_html_()
    assert "<th>site</th><th>pairs</th><th>differing</th>" in page
    assert "<td>head.forward.input</td><td>3</td><td>3</td><td>0</td>" in page  # other weights
    assert "&lt;img src=x onerror=alert(1)&gt;&amp;</td><td>3</td><td>2</td>" in page
    assert "<li>first divergence: head.forward.input at iteration 1, rank 0</li>" in page
    assert "<img" not in page
    assert str(report).splitlines()[0] in page  # the title: the report's first line
