"""`compare` across an edit that moves lines: the `@every` line sites of one variable are
paired by their rank in its binding order, never by line number.

Each version of the model is a real source file written to tmp and imported, so the
lines really move: inserted comments and a statement binding another variable leave the
runs equal (exit 0 from the real CLI, with a note that lines moved); a real op change is
still found at its binding and its step; a version binding the variable once more is
not paired against other statements.  Each file gets a constant of its own
(`self.source`): code objects of equal contents compare equal whatever their file, and
the tracer must not take one test's model for another's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

_MODEL = """
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.source = "{unique}"
{inserted}        scores = self.proj(x) @ x.T
        causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
{extra}        scores = {softmax}
        return scores @ x
"""
_SOFTMAX = "scores.softmax(-1)"
_COMMENTS = "        # a comment\n        # and another one\n        hs = 6 // 2\n"
_CHANGED = "scores.softmax(-1) if self.calls < 3 else (scores * 1.5).softmax(-1)"
_STEPS = 4


def _module(
    folder: Path, name: str, inserted: str = "", extra: str = "", softmax: str = _SOFTMAX
) -> ModuleType:
    path = folder / f"{name}.py"
    unique = f"{folder.name}/{name}"
    path.write_text(_MODEL.format(inserted=inserted, extra=extra, softmax=softmax, unique=unique))
    spec = importlib.util.spec_from_file_location(f"vartrace_moved_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(module: ModuleType, path: Path | None = None) -> ModelTracer:
    torch.manual_seed(0)
    model = module.Attention()
    callbacks = [H5PYSaverCallback(path, metadata=False)] if path else []
    with ModelTracer(model, ["forward.scores@every"], post_gather_callbacks=callbacks) as tracer:
        generator = torch.Generator().manual_seed(1)
        for _ in range(_STEPS):
            model(torch.randn(4, 6, generator=generator))
    for callback in callbacks:
        callback.close()
    return tracer


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vartrace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inserted_lines_and_comments_compare_equal_with_a_note(tmp_path: Path) -> None:
    before, after = tmp_path / "before.h5", tmp_path / "after.h5"
    _record(_module(tmp_path, "before"), before)
    _record(_module(tmp_path, "after", inserted=_COMMENTS), after)
    with vartrace.open(before) as run_a, vartrace.open(after) as run_b:
        lines_a = run_a.series["forward.scores@every"]
        lines_b = run_b.series["forward.scores@every"]
    assert len(lines_a) == len(lines_b) == 3
    assert lines_a[-1] == lines_b[0]  # a's softmax line is b's first: by line, a divergence

    report = vartrace.compare(before, after)
    assert report.ok and report.first_divergence is None
    assert report.only_in_a == [] and report.only_in_b == []
    assert report.moved_lines == dict(zip(lines_a, lines_b, strict=True))
    assert [s.site for s in report.sites] == lines_a
    assert all(s.status == "ok" and s.records == _STEPS for s in report.sites)
    assert all(s.max_abs_diff == 0 for s in report.sites)
    (note,) = report.notes
    assert note.startswith("lines moved: forward.scores@every binds at L")
    assert report.to_frame().attrs["notes"] == [note]
    assert f"note: {note}" in str(report)

    done = _cli("compare", before, after)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: lines moved: forward.scores@every" in done.stdout
    assert "DIFFERS" not in done.stdout and "SHAPE MISMATCH" not in done.stdout
    assert "only in" not in done.stdout and "first divergence: none" in done.stdout


def test_in_memory_runs_pair_moved_lines_too(tmp_path: Path) -> None:
    before = _record(_module(tmp_path, "before"))
    after = _record(_module(tmp_path, "after", inserted=_COMMENTS))
    report = vartrace.compare(before, after)
    assert report.ok and len(report.moved_lines) == 3, str(report)
    assert report.notes and report.notes[0].startswith("lines moved")


def test_a_real_op_change_is_found_at_its_binding_and_step(tmp_path: Path) -> None:
    before, after = tmp_path / "before.h5", tmp_path / "after.h5"
    _record(_module(tmp_path, "before"), before)
    _record(_module(tmp_path, "after", inserted=_COMMENTS, softmax=_CHANGED), after)
    report = vartrace.compare(before, after)
    with vartrace.open(before) as run_a:
        softmax_line = run_a.series["forward.scores@every"][-1]
    assert not report.ok
    assert report.first_divergence == (softmax_line, 3, 0)
    by_site = {s.site: s for s in report.sites}
    assert by_site[softmax_line].differing == _STEPS - 2
    assert all(s.status == "ok" for name, s in by_site.items() if name != softmax_line)
    done = _cli("compare", before, after)
    assert done.returncode == 1
    assert f"first divergence: {softmax_line} at iteration 3, rank 0" in done.stdout


def test_another_binding_is_never_compared_against_a_different_statement(
    tmp_path: Path,
) -> None:
    before, after = tmp_path / "before.h5", tmp_path / "after.h5"
    _record(_module(tmp_path, "before"), before)
    extra = "        scores = scores.clamp(min=-1e30)\n"
    _record(_module(tmp_path, "after", inserted=_COMMENTS, extra=extra), after)
    report = vartrace.compare(before, after)
    with vartrace.open(before) as run_a, vartrace.open(after) as run_b:
        lines_a, lines_b = (
            run_a.series["forward.scores@every"],
            run_b.series["forward.scores@every"],
        )
    assert (len(lines_a), len(lines_b)) == (3, 4)
    assert report.only_in_a == lines_a and report.only_in_b == lines_b
    assert not any(s.site.startswith("forward.scores") for s in report.sites)
    (note,) = report.notes
    assert note.startswith("not paired: forward.scores@every binds at 3 line(s) in a")
    assert report.first_divergence is None


def test_the_series_is_compared_when_named(tmp_path: Path) -> None:
    before, after = tmp_path / "before.h5", tmp_path / "after.h5"
    _record(_module(tmp_path, "before"), before)
    _record(_module(tmp_path, "after", inserted=_COMMENTS), after)
    report = vartrace.compare(before, after, names="forward.scores@every")
    assert [s.site for s in report.sites] == ["forward.scores@every"]
    assert report.ok and report.sites[0].records == 3 * _STEPS
    plain = vartrace.compare(before, after, names="forward.scores")
    assert [s.site for s in plain.sites] == ["forward.scores@every"] and plain.ok


@pytest.mark.parametrize("pattern", ["forward.*", "*"])
def test_a_glob_compares_the_line_sites_not_the_series_again(tmp_path: Path, pattern: str) -> None:
    before = tmp_path / "before.h5"
    _record(_module(tmp_path, "before"), before)
    report = vartrace.compare(before, before, names=pattern)
    assert len(report.sites) == 3 and all("@every:L" in s.site for s in report.sites)


def test_a_scheduler_pairs_moved_lines_as_in_process(tmp_path: Path) -> None:
    pytest.importorskip("dask")
    before, after = tmp_path / "before.h5", tmp_path / "after.h5"
    _record(_module(tmp_path, "before"), before)
    _record(_module(tmp_path, "after", inserted=_COMMENTS, softmax=_CHANGED), after)
    in_process = vartrace.compare(before, after)
    on_dask = vartrace.compare(before, after, scheduler="threads")
    assert on_dask.notes == in_process.notes and on_dask.moved_lines == in_process.moved_lines
    assert on_dask.first_divergence == in_process.first_divergence
    assert list(on_dask.rows()) == list(in_process.rows())
