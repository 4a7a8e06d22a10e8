"""Run files seen by generic HDF5 tools (h5netcdf / xarray) and ``Site.to_xarray``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, Trace

xr = pytest.importorskip("xarray", reason="needs the xarray extra")
pytest.importorskip("h5netcdf", reason="needs the xarray extra (h5netcdf)")


def _open_group(path: Path, group: str) -> xr.Dataset:
    with warnings.catch_warnings():  # h5netcdf's note on its phony_dims default
        warnings.simplefilter("ignore", UserWarning)
        return xr.open_dataset(path, engine="h5netcdf", group=group).load()


@pytest.mark.parametrize(("version", "axis"), [(1, "iterations"), (2, "records")])
def test_xarray_sees_every_axis_named(tmp_path: Path, version: int, axis: str) -> None:
    """The record axis is `records` (version 2) or the coordinate `iterations` (version 1)."""
    path = tmp_path / "run.h5"
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    saver = H5PYSaverCallback(path)
    saver._format = version
    with saver, ModelTracer(model, ["0", "forward.input"], post_gather_callbacks=[saver]):
        for _ in range(3):
            model(torch.randn(2, 3))
    dataset = _open_group(path, "vars/0.forward")
    assert not [dim for dim in dataset.dims if str(dim).startswith("phony_dim")]
    assert list(dataset["values"].dims) == [axis, "values_dim1", "values_dim2"]
    if version == 1:
        assert dataset["iterations"].values.tolist() == [1, 2, 3]
        assert dataset["ranks"].dims == ("iterations",)
    else:
        assert dataset["tags"].values[:, 0].tolist() == [1, 2, 3]
        assert dataset["tags"].dims == ("records", "tags_dim1")
    with vartrace.open(path) as run:
        np.testing.assert_array_equal(dataset["values"].values, run["0.forward"].values[()])
    assert _open_group(path, "vars/forward.input")["values"].dims[0] == axis


def test_ragged_records_grow_their_axis_labels(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("x", Trace([torch.ones(2, 3)], [1], [0], [0]))
        saver.flush()
        saver("x", Trace([torch.ones(4, 1)], [2], [0], [1]))
        saver("note", Trace(["a", "b"], [1, 2], [0, 0], [2, 3]))
    dataset = _open_group(path, "vars/x")
    named = {dim: size for dim, size in dataset.sizes.items() if not dim.startswith("phony_dim")}
    # `shapes`, made by the second gather, is unlabelled (see vartrace.storage.layout)
    assert named == {"records": 2, "values_dim1": 4, "values_dim2": 3, "tags_dim1": 4}
    assert dataset["shapes"].values.tolist() == [[2, 3], [4, 1]]
    assert _open_group(path, "vars/note")["values"].values.tolist() == ["a", "b"]


def test_to_xarray_is_indexed_by_iteration_and_rank(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    values = [torch.full((2, 2), float(n), dtype=torch.bfloat16) for n in range(4)]
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("scores", Trace(values, [1, 1, 2, 2], [0, 1, 0, 1], [0, 1, 2, 3]))
        saver("note", Trace(["a"], [1], [0], [4]))
    with vartrace.open(path) as run:
        site = run["scores"]
        array = site.to_xarray()
        assert array.name == "scores" and array.dims == ("record", "dim_1", "dim_2")
        assert array.dtype == np.float32  # bfloat16, exactly
        for iteration in (1, 2):
            for rank in (0, 1):
                picked = array.sel(iteration=iteration, rank=rank)
                want = site.get(iteration, rank=rank).float().numpy()
                np.testing.assert_array_equal(picked.values.reshape(want.shape), want)
        assert array.sel(rank=1)["order"].values.tolist() == [1, 3]
        with pytest.raises(TypeError, match="numeric records only"):
            run["note"].to_xarray()


def test_to_xarray_without_xarray_names_the_extra(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("x", Trace([1.0], [1], [0], [0]))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["xarray"] = None  # as if it were not installed
        import vartrace
        with vartrace.open({str(path)!r}) as run:
            try:
                run["x"].to_xarray()
            except ImportError as error:
                print("ERROR", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "needs xarray: pip install 'torch-vartrace[xarray]'" in result.stdout, result.stderr
