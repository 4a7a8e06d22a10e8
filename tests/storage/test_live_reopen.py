"""A live run reopened while an earlier handle of it is still open (a notebook's `run`):
HDF5 shares one open file between the handles, and the later one must still see the
writer's newer records, not call the file damaged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import vartrace
from tests._live import live_writer


def test_a_live_run_reopens_beside_an_earlier_open_handle(tmp_path: Path) -> None:
    with live_writer(tmp_path / "live.h5") as path:
        with vartrace.open(path) as earlier:
            first = len(earlier["x"])
            counts = []
            for _ in range(40):
                with vartrace.open(path) as run:
                    assert run.live
                    counts.append(len(run["x"]))
                    assert run["x"].record(counts[-1] - 1).shape == (64, 256)
                    assert run["x"].iterations[-1] == counts[-1]  # iterations 1, 2, ...
            assert len(earlier["x"]) == first  # the earlier handle reads as of its opening
            assert earlier["x"].iterations[-1] == first
            compared = subprocess.run(
                [sys.executable, "-m", "vartrace", "compare", str(path), str(path)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        assert counts == sorted(counts) and counts[-1] > first
        assert compared.returncode in (0, 1), compared.stderr  # (1: the later open holds more)
        assert "damaged" not in compared.stderr, compared.stderr
