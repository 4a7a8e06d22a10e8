"""The compare report tells how a difference propagated: each site's first differing
iteration (printed table, summaries, frame), and a differing site never reads `1.000000`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vartrace
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace

STEPS = [1, 2, 3, 4, 5]
#: Per site, the iteration from which run b differs from run a (None: never).
DIVERGES = {"embed": None, "layers.0": 4, "layers.1": 2, "head": 5}


def _write(path: Path, perturbed: bool) -> None:
    torch.manual_seed(0)
    base = {name: [torch.randn(64) for _ in STEPS] for name in DIVERGES}
    with H5PYSaverCallback(path, metadata=False) as saver:
        for name, values in base.items():
            since = DIVERGES[name]
            if perturbed and since is not None:
                # a change far too small for a cosine to six decimals, yet beyond atol=1e-12
                values = [v + 1e-6 * (step >= since) for v, step in zip(values, STEPS, strict=True)]
            saver(name, Trace(values, STEPS, [0] * len(STEPS), STEPS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("propagation")
    _write(folder / "a.h5", perturbed=False)
    _write(folder / "b.h5", perturbed=True)
    return folder / "a.h5", folder / "b.h5"


def test_each_site_says_its_first_differing_iteration(runs: tuple[Path, Path]) -> None:
    report = vartrace.compare(*runs, atol=1e-12, rtol=0)
    firsts = {s.site: s.first_differing_iteration for s in report.sites}
    assert firsts == DIVERGES
    frame = report.to_frame()
    per_site = frame.groupby("site", sort=False)["first_differing_iteration"].first()
    assert per_site.to_dict() == {
        name: -1 if since is None else since for name, since in DIVERGES.items()
    }
    assert (frame.groupby("site")["first_differing_iteration"].nunique() == 1).all()


def test_the_printed_table_has_the_column_and_no_differing_cosine_of_one(
    runs: tuple[Path, Path],
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vartrace",
            "compare",
            *map(str, runs),
            "--atol",
            "1e-12",
            "--rtol",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    header = lines[1]
    assert "first differing" in header
    column = header.index("first differing") + len("first differing")  # right-aligned
    cosine = header.index("min cosine") + len("min cosine")
    rows = {line.split()[0]: line for line in lines[3 : 3 + len(DIVERGES)]}
    assert {name: row[:column].split()[-1] for name, row in rows.items()} == {
        name: "-" if since is None else str(since) for name, since in DIVERGES.items()
    }
    for name, row in rows.items():
        shown = row[:cosine].split()[-1]
        if DIVERGES[name] is None:
            assert shown == "1.000000" and row.rstrip().endswith("ok"), row
        else:
            assert row.rstrip().endswith("DIFFERS") and shown.startswith("1-"), row
            assert shown != "1.000000" and 0 < float(shown[2:]) < 1e-6, row
