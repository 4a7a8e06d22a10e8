"""The ``vartrace`` command, run as a real subprocess (``python -m vartrace``) on real files."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest
import torch
from torch import nn

from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import RunContext
from vartrace.tracing.callbacks import stack_padded_tensors
from vartrace.tracing.tracer import ModelTracer


def vartrace(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vartrace", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def assert_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit 2, one line on stderr containing every fragment, no traceback."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        note = f"batch of {x.shape[0]}"
        assert note
        return self.head(x).pow(2).mean()


def train(path: Path, *, scale: float = 1.0, iterations: int = 6, metadata: bool = False) -> None:
    """A short training run traced into ``path``; ``scale`` perturbs the inputs from iteration 4."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    paths = ["forward", "forward.x", "forward.note", "layers.*", "head"]
    with (
        H5PYSaverCallback(path, metadata=metadata) as saver,
        ModelTracer(model, paths, post_gather_callbacks=[saver], gathering_interval=2),
    ):
        for i in range(iterations):
            x = torch.randn(4 + i % 2, 6) * (scale if i >= 3 else 1.0)
            loss = model(x)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    train(root / "a.h5", metadata=True)
    train(root / "same.h5")
    train(root / "b.h5", scale=1.001)
    (root / "notes.txt").write_text("not hdf5\n")
    with h5py.File(root / "plain.h5", "w") as f:
        f["x"] = [1, 2, 3]
    for rank in (0, 1):  # the two shards of a sharded run
        saver = H5PYSaverCallback(root / "shard.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
        from vartrace.trace import Trace

        trace = Trace(torch.full((3, 2), float(rank)), [1, 2, 3], [rank] * 3, [0, 1, 2])
        stack_padded_tensors("w", trace)
        saver("w", trace)
        saver.close()
    (root / "models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def build():
                return nn.Sequential(nn.Linear(2, 3), nn.ReLU())

            def broken():
                raise RuntimeError("cannot build\\nsecond line")

            def number():
                return 42
            """
        )
    )
    return root


def test_python_m_and_console_script(runs: Path) -> None:
    result = vartrace("--help")
    assert result.returncode == 0
    for command in ("ls", "show", "meta", "sites", "compare", "plot"):
        assert command in result.stdout
    script = Path(sys.executable).with_name("vartrace")
    if not script.exists():
        script = Path(shutil.which("vartrace") or "")
    if not script.is_file():
        pytest.skip("the vartrace console script is not installed next to this interpreter")
    listed = subprocess.run([str(script), "ls", str(runs / "a.h5")], capture_output=True, text=True)
    assert listed.returncode == 0 and "layers.0.forward" in listed.stdout


def test_ls(runs: Path) -> None:
    result = vartrace("ls", runs / "a.h5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{runs / 'a.h5'}: 7 sites, 42 records")
    header = lines[1].split()
    assert header == ["site", "records", "shape", "dtype", "iterations", "ranks", "bytes"]
    rows = {line.split()[0]: line for line in lines[3:]}
    assert set(rows) == {
        "forward",
        "forward.x",
        "forward.note",
        "head.forward",
        "layers.0.forward",
        "layers.1.forward",
        "layers.2.forward",
    }
    assert "ragged <= (5, 6)" in rows["forward.x"] and "float32" in rows["forward.x"]
    assert "1..6" in rows["forward.x"]
    assert " str " in rows["forward.note"]
    assert "()" in rows["forward"]
    # columns are aligned: every row starts its "records" column at the same offset
    offset = lines[1].index("records") + len("records")
    assert all(line[offset - 1].isdigit() for line in lines[3:])


def test_ls_shards_by_glob(runs: Path) -> None:
    result = vartrace("ls", runs / "shard.rank*.h5")
    assert result.returncode == 0, result.stderr
    assert "1 sites, 6 records" in result.stdout
    row = result.stdout.splitlines()[-1].split()
    assert row[:3] == ["w", "6", "(2,)"] and row[4:6] == ["1..3", "0..1"]


def test_ls_errors(runs: Path) -> None:
    assert_error(vartrace("ls", runs / "missing.h5"), "no such file", "missing.h5")
    assert_error(vartrace("ls", runs / "nothing*.h5"), "no file matches")
    assert_error(vartrace("ls", runs / "notes.txt"), "notes.txt is not a vartrace file")
    assert_error(vartrace("ls", runs / "plain.h5"), "plain.h5 is not a vartrace file")
    assert_error(vartrace("ls"), "required: RUN")


def test_show(runs: Path) -> None:
    result = vartrace("show", runs / "a.h5", "layers.0.forward")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "layers.0.forward: 6 records, dtype float32"
    assert "mean" in result.stdout.splitlines()[1] and len(result.stdout.splitlines()) == 9

    result = vartrace("show", runs / "a.h5", "layers.0.forward", "--iteration", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("layers.0.forward @ iteration 2, rank 0")
    assert "shape (5, 6)  dtype float32" in lines[1]
    assert lines[2].strip().startswith("mean ")
    assert len(lines) == 3 + 5  # five printed rows of the (5, 6) value

    scalars = vartrace("show", runs / "a.h5", "forward")
    assert scalars.returncode == 0 and scalars.stdout.splitlines()[1].split()[-1] == "value"
    notes = vartrace("show", runs / "a.h5", "forward.note", "-i", "1", "--rank", "0")
    assert notes.returncode == 0 and "str: 'batch of 4'" in notes.stdout


def test_show_errors(runs: Path) -> None:
    assert_error(
        vartrace("show", runs / "a.h5", "layers.9.forward"),
        "has no site 'layers.9.forward'",
        "did you mean layers.",
    )
    assert_error(
        vartrace("show", runs / "a.h5", "forward", "--iteration", "0"),
        "no record at or before iteration 0",
        "iterations 1..6",
    )
    assert_error(vartrace("show", runs / "a.h5", "forward", "--iteration", "x"), "invalid int")
    assert_error(vartrace("show", runs / "missing.h5", "forward"), "no such file")


def test_meta(runs: Path) -> None:
    result = vartrace("meta", runs / "a.h5")
    assert result.returncode == 0, result.stderr
    keys = [line.split()[0] for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert "command" in keys and "versions.torch" in keys and "packages" in keys
    one = vartrace("meta", runs / "a.h5", "versions.torch")
    assert one.returncode == 0
    assert one.stdout.split() == ["versions.torch", torch.__version__]
    assert_error(vartrace("meta", runs / "a.h5", "nope"), "no metadata 'nope'", "keys: ")
    without = vartrace("meta", runs / "same.h5")
    assert without.returncode == 0 and "no metadata" in without.stdout


def test_sites(runs: Path) -> None:
    result = vartrace("sites", "models:build", cwd=runs)
    assert result.returncode == 0, result.stderr
    sites = result.stdout.split()
    assert "0.forward.input" in sites and "1.forward" in sites and "forward" in sites
    result = vartrace("sites", "models:build", "0.forward.*", cwd=runs)
    assert result.stdout.split() == ["0.forward.input"]
    by_file = vartrace("sites", runs / "models.py:build", "1")
    assert by_file.returncode == 0 and by_file.stdout.split() == ["1"]


def test_sites_errors(runs: Path) -> None:
    assert_error(vartrace("sites", "models", cwd=runs), "expected MODULE:FACTORY")
    assert_error(vartrace("sites", "no_such_module:f", cwd=runs), "cannot import module")
    assert_error(vartrace("sites", "models:missing", cwd=runs), "has no attribute 'missing'")
    assert_error(vartrace("sites", "models:number", cwd=runs), "returned int, not a torch.nn")
    assert_error(
        vartrace("sites", "models:broken", cwd=runs), "models:broken() failed: cannot build"
    )
    assert_error(vartrace("sites", "models:build", "zz*", cwd=runs), "no site of Sequential")


def test_compare_equal_runs_exit_0(runs: Path) -> None:
    result = vartrace("compare", runs / "a.h5", runs / "same.h5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first divergence: none" in result.stdout
    assert "7 sites compared, 0 differ, 42 record pairs" in result.stdout


def test_compare_differing_runs_exit_1(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "diff.csv"
    result = vartrace("compare", runs / "a.h5", runs / "b.h5", "--csv", out)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "first divergence: forward.x at iteration 4, rank 0" in lines
    header = lines[1].split("  ")
    assert header[0].strip() == "site"
    table = {line.split()[0]: line.split()[-1] for line in lines[3:10]}
    assert table["forward.note"] == "ok" and table["layers.0.forward"] == "DIFFERS"
    assert f"wrote {out} (42 rows)" in lines
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 42
    bad = {(r["site"], r["iteration"]) for r in rows if r["status"] != "ok"}
    assert ("forward.x", "4") in bad and ("forward.x", "3") not in bad

    loose = vartrace("compare", runs / "a.h5", runs / "b.h5", "--atol", "1e-2")
    assert loose.returncode == 0, loose.stdout
    only = vartrace("compare", runs / "a.h5", runs / "b.h5", "--names", "forward.note")
    assert only.returncode == 0 and "1 site compared" in only.stdout


def test_compare_errors(runs: Path) -> None:
    assert_error(vartrace("compare", runs / "a.h5"), "required: B")
    assert_error(vartrace("compare", runs / "a.h5", runs / "missing.h5"), "no such file")
    assert_error(vartrace("compare", runs / "a.h5", runs / "b.h5", "--rtol", "x"), "invalid float")
    assert_error(
        vartrace("compare", runs / "a.h5", runs / "b.h5", "--names", "zzz"), "no site matches"
    )
    assert_error(
        vartrace("compare", runs / "a.h5", runs / "b.h5", "--atol", "-1"), "tolerances must be"
    )


def test_plot(runs: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    stats = tmp_path / "stats.png"
    result = vartrace("plot", runs / "a.h5", "layers.*", "--stat", "mean,std,absmax", "-o", stats)
    assert result.returncode == 0, result.stderr
    assert stats.read_bytes().startswith(b"\x89PNG") and "wrote" in result.stdout
    similarity = tmp_path / "similarity.png"
    result = vartrace("plot", runs / "a.h5", runs / "b.h5", "-o", similarity)
    assert result.returncode == 0, result.stderr
    assert similarity.stat().st_size > 5000 and "similarity of 7 sites" in result.stdout


def test_plot_errors(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    assert_error(vartrace("plot", runs / "a.h5", "-o", out), "needs SITE names")
    assert_error(vartrace("plot", runs / "a.h5", "nosite", "-o", out), "has no site 'nosite'")
    assert_error(vartrace("plot", runs / "a.h5", "forward"), "required: -o/--output")
    assert_error(
        vartrace("plot", runs / "a.h5", "forward", "--stat", "median", "-o", out),
        "unknown statistic 'median'",
    )
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def _odd_run(path: Path, iterations: int = 4) -> None:
    """A run a newcomer meets: a big weight stored once, mixed dtypes, a pickled object."""
    from fractions import Fraction

    from vartrace.trace import Trace

    def trace(values: list[object], its: list[int]) -> Trace:
        out = Trace()
        for order, (value, iteration) in enumerate(zip(values, its, strict=True)):
            out.append(value, iteration, 0, order)
        return out

    big = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)
    mixed = [torch.ones(3) if i % 2 else torch.ones(3, dtype=torch.bfloat16) for i in range(4)]
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("big", trace([big, big * 2][: 1 + (iterations > 3)], [1, 4][: 1 + (iterations > 3)]))
        saver("mixed", trace(mixed[:iterations], list(range(1, iterations + 1))))
        saver("object", trace([Fraction(1, 3)], [1]))


def test_version_and_help_for_every_argument() -> None:
    import argparse

    from vartrace import __version__
    from vartrace.cli import _parser

    result = vartrace("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"vartrace {__version__}"
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"vartrace {name}: {action.dest} has no help text"
        shown = vartrace(name, "--help")
        assert shown.returncode == 0 and "usage: vartrace" in shown.stdout


def test_show_prints_the_value_held_at_an_iteration_as_a_bounded_preview(tmp_path: Path) -> None:
    path = tmp_path / "odd.h5"
    _odd_run(path)
    result = vartrace("show", path, "big", "-i", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "big @ iteration 3, rank 0: unchanged since iteration 1 (capture order 0)"
    assert "shape (32, 32)  dtype float32" in lines[1] and "mean 511.5" in lines[2]
    assert len(lines) <= 30, f"{len(lines)} lines"
    assert "..." in result.stdout
    changed = vartrace("show", path, "big", "-i", "4")
    assert (
        changed.returncode == 0 and "big @ iteration 4, rank 0 (capture order 1)" in changed.stdout
    )


def test_show_accepts_globs_like_plot(runs: Path) -> None:
    result = vartrace("show", runs / "a.h5", "layers.*.forward", "-i", "2")
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if " @ iteration 2" in line]
    assert [h.split()[0] for h in headers] == [f"layers.{i}.forward" for i in range(3)]
    assert_error(vartrace("show", runs / "a.h5", "nothing.*"), "has no site 'nothing.*'")


def test_allow_pickle_reads_pickled_records(tmp_path: Path) -> None:
    path = tmp_path / "odd.h5"
    _odd_run(path)
    refused = vartrace("show", path, "object", "-i", "1")
    assert refused.returncode == 0 and "pass --allow-pickle" in refused.stdout
    assert "Fraction(1, 3)" not in refused.stdout
    allowed = vartrace("show", path, "object", "-i", "1", "--allow-pickle")
    assert allowed.returncode == 0 and "Fraction(1, 3)" in allowed.stdout
    for command in ("compare", "plot"):
        assert "--allow-pickle" in vartrace(command, "--help").stdout


def test_ls_shows_every_dtype_of_a_site(tmp_path: Path) -> None:
    path = tmp_path / "odd.h5"
    _odd_run(path)
    result = vartrace("ls", path)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[3:]}
    assert rows["mixed"][3] == "bfloat16,float32"
    assert [line.split()[0] for line in result.stdout.splitlines()[3:]] == [
        "big",
        "mixed",
        "object",
    ]


def test_compare_counts_pairs_differing_pairs_and_unpaired_records_apart(tmp_path: Path) -> None:
    long, short = tmp_path / "long.h5", tmp_path / "short.h5"
    _odd_run(long, iterations=4)
    _odd_run(short, iterations=2)
    result = vartrace("compare", long, short)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["site", "pairs", "differing", "unpaired"]
    row = next(line.split() for line in lines if line.startswith("mixed "))
    assert row[1:4] == ["2", "0", "2"], row


def test_meta_summarizes_a_long_diff_and_lists_unless_asked(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@e.com"], ["config", "user.name", "T"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    (repo / "train.py").write_text("lr = 0.1\n")
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-q", "-m", "start"], cwd=repo, check=True)
    (repo / "train.py").write_text("".join(f"step_{i} = {i}\n" for i in range(1000)))
    write = "import sys; from vartrace.storage import H5PYSaverCallback as S\n"
    write += "from vartrace.trace import Trace\n"
    write += "with S(sys.argv[1]) as s: s('x', Trace([1], [1], [0], [0]))"
    subprocess.run([sys.executable, "-c", write, str(tmp_path / "run.h5")], cwd=repo, check=True)
    summary = vartrace("meta", "run.h5", cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    assert len(summary.stdout.splitlines()) < 60
    diff_line = next(line for line in summary.stdout.splitlines() if line.startswith("git.diff"))
    assert "lines" in diff_line and "vartrace meta run.h5 git.diff prints it" in diff_line
    assert any(
        "entries: vartrace meta run.h5 packages lists them" in line
        for line in summary.stdout.splitlines()
    )
    whole = vartrace("meta", "run.h5", "git.diff", cwd=tmp_path)
    assert "    +step_999 = 999" in whole.stdout.splitlines()


def test_existing_paths_and_site_globs_are_not_taken_for_other_things(
    runs: Path, tmp_path: Path
) -> None:
    shutil.copy(runs / "a.h5", tmp_path / "run[1].h5")  # a glob character in a real name
    listed = vartrace("ls", "run[1].h5", cwd=tmp_path)
    assert listed.returncode == 0 and "layers.0.forward" in listed.stdout, listed.stderr
    (tmp_path / "layers.py").write_text("# a file that the site glob 'layers.*' matches\n")
    plotted = vartrace("plot", "run[1].h5", "layers.*", "-o", "out.png", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert "over iterations" in plotted.stdout and (tmp_path / "out.png").is_file()


def test_ls_counts_the_bytes_of_shards_in_several_directories(runs: Path, tmp_path: Path) -> None:
    """The shards of one run, listed by a glob across directories or in one, or named one
    by one: their records' bytes (6 float32 records of 2), never "0 bytes" and "-"."""
    for rank in (0, 1):
        folder = tmp_path / f"node{rank}"
        folder.mkdir()
        shutil.copy(runs / f"shard.rank{rank}.h5", folder)
    nodes = [tmp_path / f"node{rank}" / f"shard.rank{rank}.h5" for rank in (0, 1)]
    for patterns in ([runs / "shard.rank*.h5"], [tmp_path / "node*" / "shard.rank*.h5"], nodes):
        result = vartrace("ls", *patterns)
        assert result.returncode == 0, result.stderr
        assert "1 sites, 6 records, 48 bytes" in result.stdout
        assert result.stdout.splitlines()[-1].split()[-2:] == ["48", "bytes"]
