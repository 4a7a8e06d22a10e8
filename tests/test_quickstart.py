"""The README's main example runs end to end and prints a summary read from its file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
