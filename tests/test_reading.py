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
        model = nn.Linear(4, 4)
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
