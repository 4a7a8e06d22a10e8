"""The README's main example runs end to end and prints a summary read from its file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart(tmp_path: Path) -> None:
    out = tmp_path / "quick.h5"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            "--steps",
            "60",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert out.exists()
    lines = result.stdout.splitlines()
    assert lines[0] == f"{out} holds:"
    table = {line.split()[0]: line.split() for line in lines[2:] if line.startswith("  ")}
    assert table["forward.tokens"][1] == "60"
    assert table["layers.0.attn.forward.scores"][1] == "60"
    assert table["layers.1.mlp.forward.h"][-1] == "(3,)", "the pre-save callback reduced h"
    assert any(line.startswith("loss: ") for line in lines)


def test_quickstart_without_out_leaves_nothing_in_the_temporary_folder(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(str(temp)), "the run was written in the temporary folder"
    assert "pass --out run.h5 to keep it" in result.stdout
    # torch may leave its own empty cache folder (torchinductor_<user>) there: no file, though.
    assert [p.name for p in temp.iterdir() if p.name.startswith("vartrace-")] == []
    assert [p for p in temp.rglob("*") if p.is_file()] == []
