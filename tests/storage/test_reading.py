"""Reading a run offline: "the value at step k", sites in execution order, missing plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import vartrace
from tests._live import live_writer
from vartrace import H5PYSaverCallback, ModelTracer


class Blocks(nn.Module):
    """Twelve blocks: ``blocks.10`` runs after ``blocks.2``, but sorts before it by name."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(12)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).sum()


def _frozen_weight_run(path: Path, steps: int = 6) -> None:
    """Train only the blocks: ``head.forward.self.weight`` never changes, so it is stored once."""
    torch.manual_seed(0)
    model = Blocks()
    model.head.weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(
            model,
            ["head.forward.self.weight", "blocks.*", "forward"],
            post_gather_callbacks=[saver],
        ),
    ):
        for _ in range(steps):
            model(torch.randn(3, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_get_answers_the_value_a_site_held_at_any_later_iteration(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _frozen_weight_run(path)
    with vartrace.open(path) as run:
        weight = run["head.forward.self.weight"]
        assert weight.iterations.tolist() == [1], "change detection stored it once"
        for k in range(1, 7):
            assert torch.equal(weight.get(iteration=k), weight.get(1)), k
        assert weight.calls(5) == [], "iteration 5 recorded nothing: it did not change"
        assert len(weight.calls(1)) == 1
        with pytest.raises(KeyError, match="no record at or before iteration 0 on rank 0"):
            weight.get(iteration=0)
        with pytest.raises(KeyError, match="no record on rank 3"):
            weight.get(iteration=2, rank=3)
        output = run["forward"]
        assert output.iterations.tolist() == [1, 2, 3, 4, 5, 6]
        assert all(not isinstance(output.get(k), list) for k in range(1, 7))


def test_sites_are_listed_in_execution_order_in_files_and_results(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _frozen_weight_run(path, steps=2)
    executed = [*(f"blocks.{i}.forward" for i in range(12)), "forward"]
    with vartrace.open(path) as run:
        names = run.names
        assert [n for n in names if n != "head.forward.self.weight"] == executed
        assert names.index("blocks.2.forward") < names.index("blocks.10.forward")
        frame_sites = list(dict.fromkeys(run.to_frame()["site"]))
        assert frame_sites == names
    torch.manual_seed(0)
    model = Blocks()
    with ModelTracer(model, ["blocks.*"]) as tracer:
        model(torch.randn(3, 4))
    assert list(tracer.results) == executed[:-1]


def test_to_frame_offers_var_like_plot(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _frozen_weight_run(path, steps=2)
    with vartrace.open(path) as run:
        frame = run.to_frame(stat="var")
        value = run["forward"].get(1)
    row = frame[(frame["site"] == "forward") & (frame["iteration"] == 1)]
    assert row["var"].iloc[0] == pytest.approx(float(value.double().var(unbiased=False)))


def test_reading_a_blosc_file_without_hdf5plugin_names_the_plugin(tmp_path: Path) -> None:
    pytest.importorskip("hdf5plugin")
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, compression="blosc", metadata=False) as saver:
        model = nn.Linear(4, 4096)  # a 32 KiB record fills its chunk: it is compressed
        with ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
            model(torch.randn(2, 4))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hdf5plugin"] = None  # as if it were not installed
        import vartrace
        with vartrace.open({str(path)!r}) as run:
            print(run.names)
            try:
                run["forward"].get(1)
            except OSError as error:
                print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "['forward']" in result.stdout
    error = result.stdout.split("ERROR", 1)[1]
    assert "blosc" in error and "HDF5 filter 32001" in error
    assert "pip install 'torch-vartrace[compress]'" in error
    assert "can't open directory" not in error


_KILLED_BETWEEN_WRITE_AND_COMMIT = """
import os, sys
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace
saver = H5PYSaverCallback(sys.argv[1], metadata=False)
saver("x", Trace([torch.full((2,), float(i)) for i in range(3)], [1, 2, 3], [0] * 3, [0, 1, 2]))
saver.flush()  # committed: 3 records
saver("x", Trace([torch.full((2,), 9.0)] * 2, [4, 5], [0] * 2, [3, 4]))  # written, never committed
saver.datasets["x"].file.flush()
os._exit(0)  # killed before the next flush commits them
"""


def test_every_reader_path_reads_only_committed_records_of_a_killed_writer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "killed.h5"
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_BETWEEN_WRITE_AND_COMMIT)
    subprocess.run([sys.executable, str(script), str(path)], check=True, timeout=120)
    with vartrace.open(path) as run:
        assert run["x"].values.shape[0] == 3
        frame = run.to_frame()
        assert frame["iteration"].tolist() == [1, 2, 3]
        assert frame["mean"].tolist() == [0.0, 1.0, 2.0]
    report = vartrace.compare(path, path)
    assert report.ok and report.sites[0].records == 3


def test_an_int_beyond_4300_digits_reads_and_shows(tmp_path: Path) -> None:
    huge = 7**20000  # 16,902 decimal digits: Python refuses to print it in decimal
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("big", vartrace.Trace([huge, 3], [1, 2], [0, 0], [0, 2]))
        saver("after", vartrace.Trace([1.5], [1], [0], [1]))
    with vartrace.open(path) as run:
        assert run["big"].get(1) == huge
        frame = run.to_frame()
    assert frame["mean"].isna().tolist() == [True, False, False]
    shown = subprocess.run(
        [sys.executable, "-m", "vartrace", "show", str(path), "*"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        f"{hex(huge)[:34]}...{hex(huge)[-8:]} (an int of {huge.bit_length()} bits)" in shown.stdout
    )
    assert "after: 1 records" in shown.stdout  # show '*' goes on past the site


def test_a_live_gzip_run_opens_every_time_and_says_it_is_live(tmp_path: Path) -> None:
    options = ', compression="gzip", compression_opts=9'
    with live_writer(tmp_path / "live.h5", options) as path:
        counts = []
        for _ in range(150):
            with vartrace.open(path) as run:
                assert run.live
                counts.append(len(run["x"]))
                run["x"].record(len(run["x"]) - 1)
        assert counts == sorted(counts) and counts[-1] > counts[0]
    with vartrace.open(path) as run:
        assert not run.live  # its writer is gone
