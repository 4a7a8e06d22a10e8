"""ModelTracer streaming into H5PYSaverCallback, read back with vartrace.open."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import vartrace
from tests._models import TinyTransformer, tokens
from vartrace.storage import H5PYSaverCallback
from vartrace.tracing.callbacks import stack_padded_tensors
from vartrace.tracing.tracer import ModelTracer

PATHS = [
    "forward.tokens",
    "layers.*.attn.forward.scores",
    "shared.forward.input",
    "forward",
    "layers.0.forward.self.step_count",
]


def _train(callbacks: dict[str, Any], steps: int = 7, **options: Any) -> ModelTracer:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with ModelTracer(model, PATHS, gathering_interval=3, **callbacks, **options) as tracer:
        for step in range(steps):
            batch = tokens(step, batch=2 if step < steps - 1 else 1, length=4 + step % 3)
            model(batch).logits.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return tracer


def _equal(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(), want.nan_to_num())
        )
    return type(got) is type(want) and got == want


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_the_file_holds_exactly_what_the_tracer_recorded(tmp_path: Path, background: bool) -> None:
    reference = _train({}).results
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, background=background) as saver:
        tracer = _train({"post_gather_callbacks": [saver]})
        assert set(saver.datasets) <= set(reference)
    assert sum(len(trace) for trace in tracer.results.values()) == 0, "saved records are dropped"
    with vartrace.open(path) as run:
        assert run.names == list(reference), "both in execution order"
        for name in reference:
            want, site = reference[name], run[name]
            assert site.iterations.tolist() == list(want.iterations), name
            assert site.ranks.tolist() == list(want.ranks), name
            assert site.order.tolist() == list(want.order), name
            for index, value in enumerate(want.values):
                assert _equal(site.record(index), value), (name, index)
        assert run.meta["world_size"] == 1


def test_a_layer_called_twice_per_step_gives_two_calls_per_iteration(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        _train({"post_gather_callbacks": [saver]}, steps=3)
    with vartrace.open(path) as run:
        pair = run["shared.forward.input"].calls(2)
        assert isinstance(pair, list) and len(pair) == 2
        assert pair[0].shape == pair[1].shape
        assert not torch.equal(pair[0], pair[1])
        assert torch.equal(run["shared.forward.input"].get(2), pair[1])
        assert type(run["layers.0.forward.self.step_count"].get(3)) is int


@pytest.mark.warnings_as_errors
def test_ragged_batches_and_padded_stacking_come_back_with_true_shapes(tmp_path: Path) -> None:
    reference = _train({}).results["layers.0.attn.forward.scores"]
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        _train({"post_gather_callbacks": [stack_padded_tensors, saver]})
    with vartrace.open(path) as run:
        site = run["layers.0.attn.forward.scores"]
        assert [tuple(shape) for shape in site.shapes] == [tuple(v.shape) for v in reference.values]
        assert site.values.shape[0] == len(reference.values)
        assert site.values.shape[1:] == tuple(site.shapes.max(axis=0))
        for index, value in enumerate(reference.values):
            assert _equal(site.record(index), value)


def test_compressed_and_float16_runs_read_back(tmp_path: Path) -> None:
    pytest.importorskip("hdf5plugin")
    reference = _train({}).results["layers.1.attn.forward.scores"]
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, compression="blosc", float_dtype="float16") as saver:
        _train({"post_gather_callbacks": [saver]})
    with vartrace.open(path) as run:
        site = run["layers.1.attn.forward.scores"]
        assert site.dtype == "float16"
        for index, value in enumerate(reference.values):
            assert _equal(site.record(index), value.half())
    # A fresh process reads it without importing hdf5plugin itself.
    code = (
        "import sys, vartrace; run = vartrace.open(sys.argv[1]); "
        "print(run['layers.1.attn.forward.scores'].values[0].sum())"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True)


class _Undetachable(torch.Tensor):
    """A tensor whose encoding fails: what a writer error looks like to the saver.

    (An unpicklable record no longer fails the writer: it is stored as a marker.)
    """

    @staticmethod
    def __new__(cls) -> _Undetachable:
        return torch.ones(3).as_subclass(cls)

    def detach(self) -> torch.Tensor:
        raise RuntimeError("this tensor cannot be detached")


@pytest.mark.warnings_as_errors
def test_a_background_writer_error_is_raised_and_earlier_gathers_stay(tmp_path: Path) -> None:
    from vartrace.storage import WorkerError
    from vartrace.trace import Trace

    path = tmp_path / "run.h5"
    saver = H5PYSaverCallback(path, background=True, metadata=False)
    saver("x", Trace([torch.ones(3)], [1], [0], [0]))
    saver.flush(wait=True)
    with vartrace.open(path) as run:  # written and committed while the writer runs
        assert run["x"].iterations.tolist() == [1]
    saver("x", Trace([_Undetachable()], [2], [0], [1]))  # fails on the thread
    saver.flush()
    with pytest.raises(WorkerError, match="background job failed") as raised:
        saver.close()
    assert "cannot be detached" in repr(raised.value.__cause__)
    with pytest.raises(RuntimeError, match="closed"):
        saver("x", Trace([torch.ones(3)], [3], [0], [2]))
    with vartrace.open(path) as run:  # closed cleanly, the first gather intact
        assert run["x"].iterations.tolist() == [1]
        assert torch.equal(run["x"].get(1), torch.ones(3))


def test_a_background_saver_closed_without_a_flush_writes_what_it_took(tmp_path: Path) -> None:
    from vartrace.trace import Trace

    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, background=True, metadata=False) as saver:
        saver("x", Trace([torch.arange(3), torch.arange(5)], [1, 2], [0, 0], [0, 1]))
    with vartrace.open(path) as run:
        assert run["x"].iterations.tolist() == [1, 2]
        assert torch.equal(run["x"].get(2), torch.arange(5))
