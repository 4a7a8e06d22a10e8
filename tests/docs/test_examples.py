"""Every example runs on CPU as a real subprocess and prints its key result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def test_tensortracer_port(tmp_path: Path) -> None:
    out = run_example("tensortracer_port.py", "--out", str(tmp_path), cwd=tmp_path)
    assert "forward.x values: tensor (16, 8, 10)" in out
    assert "true shapes of the last two records: [(8, 10), (4, 10)]" in out
    assert "last record (exact shape): (4, 10) torch.float32" in out
    assert "3. one mean per gather: forward.x (4, 10) for 16 iterations" in out
    assert (tmp_path / "tensortracer_usage2.h5").is_file()


def test_tensorcapture_port(tmp_path: Path) -> None:
    out = run_example("tensorcapture_port.py", cwd=tmp_path)
    assert "inputs/locals of forward:  blocks.0.forward.x, blocks.0.forward.hidden" in out
    assert "registered by hand: manual.blocks.0.gelu_absmax" in out
    assert "bit-exact? False" in out
    assert "comparing float64 reference with float32 model" in out
    assert "23 sites compared, 0 differ" in out
    assert "first divergence at blocks.2.norm.forward" in out


def test_tensor_dumper_port(tmp_path: Path) -> None:
    # run from the repository, so the metadata holds a git state
    out = run_example("tensor_dumper_port.py", "--out", str(tmp_path), cwd=ROOT)
    assert "command:  " in out and "tensor_dumper_port.py" in out
    assert "packages: " in out
    if (ROOT / ".git").exists():
        assert " on " in out.split("git:", 1)[1].splitlines()[0]
    assert "rerun with the same settings: ok=True" in out
    assert "learning rate 0.05 -> 0.0501: ok=False" in out
    assert "exit status 0: the loss stays within 1e-2" in out
    assert {p.name for p in tmp_path.iterdir()} == {"run_a.h5", "run_a_again.h5", "run_lr.h5"}


def test_paddle_checker_port(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    out = run_example("paddle_checker_port.py", "--out", str(tmp_path), cwd=tmp_path)
    assert "wrote layer_check.csv (10 layers)" in out
    assert "first record beyond atol=rtol=1e-3: layers.0.1.forward" in out
    header = (tmp_path / "layer_check.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["layer", "type", "records", "min_cosine"]
    assert {"mean_diff", "std_diff", "var_diff"} <= set(header)


def test_tensor_tracker_port(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    out = run_example("tensor_tracker_port.py", cwd=tmp_path)
    assert "18 records: 9 gradients, 9 outputs" in out
    lines = out.splitlines()
    assert lines[0].split() == ["iteration", "name", "type", "grad", "shape", "std"]
    assert any(line.split()[1:4] == ["embed", "Embedding", "True"] for line in lines[1:19])
