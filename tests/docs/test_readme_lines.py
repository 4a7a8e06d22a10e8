"""Lines of the README that a newcomer copies work as written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace.trace import RunContext, Trace

_SCRIPT = """
import sys
from vartrace import H5PYSaverCallback
from vartrace.trace import Trace
with H5PYSaverCallback(sys.argv[1]) as saver:
    saver("forward.x", Trace([1.5], [1], [0], [0]))
"""


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_git_state_comes_from_the_scripts_repository_when_run_elsewhere(tmp_path: Path) -> None:
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    _git(repo, "init", "-q", "-b", "trunk")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "T")
    (repo / "train.py").write_text(_SCRIPT)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "start")
    path = tmp_path / "run.h5"
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    subprocess.run(
        [sys.executable, str(repo / "train.py"), str(path)],
        cwd=elsewhere,
        env=env,
        check=True,
        timeout=120,
    )
    with vartrace.open(path) as run:
        git = run.meta["git"]
        assert run.meta["cwd"] == str(elsewhere)
        assert git["available"] and git["commit"] == _git(repo, "rev-parse", "HEAD")
        assert git["repository"] == str(repo.resolve())
        assert git["branch"] == "trunk" and git["dirty"] is False
        assert isinstance(run.meta["env"], dict)


def test_a_shard_path_naming_the_rank_writes_that_rank_file(tmp_path: Path) -> None:
    for rank in (0, 1):
        for given in ("run.h5", f"run.rank{rank}.h5"):
            saver = H5PYSaverCallback(tmp_path / given, overwrite=True, metadata=False)
            saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
            assert saver.path == tmp_path / f"run.rank{rank}.h5"
            saver("w", Trace([float(rank)], [1], [rank], [0]))
            saver.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.rank0.h5",
        "run.rank0.h5.manifest.json",
        "run.rank1.h5",
        "run.rank1.h5.manifest.json",
    ]
    with vartrace.open(tmp_path / "run.rank*.h5") as run:
        assert run["w"].ranks.tolist() == [0, 1]


def test_the_report_prints_as_the_readme_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(3, 3)
    runs = []
    for name in ("ref.h5", "new.h5"):
        with (
            H5PYSaverCallback(tmp_path / name, metadata=False) as saver,
            ModelTracer(model, ["forward"], post_gather_callbacks=[saver]),
        ):
            model(torch.ones(1, 3))
        runs.append(tmp_path / name)
    report = vartrace.compare(*runs)
    print(report)
    assert "first divergence: none" in capsys.readouterr().out
    root = Path(__file__).parents[2]
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:  # the reference
        text = page.read_text()
        assert "report.print()" not in text and "a readable `print()`" not in text, page
        assert 'run.meta["git"]["commit"]' not in text, page
