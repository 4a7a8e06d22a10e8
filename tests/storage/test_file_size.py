"""Run files stay close to the bytes recorded: compression never grows a file, chunks fit
small runs, and a site whose shape changes between steps never blows a file up."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vartrace
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace

BLOSC = pytest.param(
    "blosc",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("hdf5plugin") is None, reason="needs hdf5plugin"
    ),
)
COMPRESSIONS = [BLOSC, "gzip", "lzf"]
FIXED = 160 << 10  # a file's own bytes and a site's datasets, whatever it records


def _activation(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Float32 values at bfloat16 precision, as a bf16 model's activations: compressible."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)


def _write(
    path: Path, steps: list[dict[str, np.ndarray]], gather: int, compression: Any = None
) -> int:
    """Hand ``steps`` ({site: record} each) to a saver, flushing every ``gather`` steps, as
    a tracer does; returns the file's size."""
    names = list(dict.fromkeys(name for step in steps for name in step))
    with H5PYSaverCallback(path, overwrite=True, metadata=False, compression=compression) as saver:
        for start in range(0, len(steps), gather):
            for order, name in enumerate(names):
                trace = Trace()
                for index in range(start, min(start + gather, len(steps))):
                    if name in steps[index]:
                        trace.append(steps[index][name], index + 1, 0, index * len(names) + order)
                if len(trace):
                    saver(name, trace)
            saver.flush()
    return os.path.getsize(path)


def _recorded(steps: list[dict[str, np.ndarray]]) -> int:
    return sum(record.nbytes for step in steps for record in step.values())


def _check_records(path: Path, steps: list[dict[str, np.ndarray]]) -> None:
    with vartrace.open(path) as run:
        for name in steps[0]:
            site = run[name]
            for index, step in enumerate(steps):
                np.testing.assert_array_equal(site.get(index + 1), step[name])


# -- compression never grows a file -------------------------------------------------------


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compressed_4_kib_records_gathered_every_step_never_exceed_the_uncompressed_file(
    tmp_path: Path, compression: str
) -> None:
    # Each gather rewrote a half-filled 512 KiB compressed chunk elsewhere in the file (SWMR
    # mode reuses no space): blosc 5.4x, lzf 8.6x the recorded bytes, above uncompressed.
    steps = [
        {f"site{i}": _activation((1024,), 16 * i + step) for i in range(8)} for step in range(16)
    ]
    plain = _write(tmp_path / "plain.h5", steps, gather=1)
    packed = _write(tmp_path / "packed.h5", steps, gather=1, compression=compression)
    assert packed <= plain, (packed, plain)
    assert plain < 1.5 * _recorded(steps) + FIXED
    _check_records(tmp_path / "packed.h5", steps)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize(
    ("sites", "shape", "count"), [(4, (), 9), (100, (1024,), 16)], ids=["scalars", "100-sites"]
)
def test_a_compressed_file_is_not_larger_where_no_gather_fills_a_chunk(
    tmp_path: Path, compression: str, sites: int, shape: tuple[int, ...], count: int
) -> None:
    # Chunks filled over several gathers are stored unfiltered: a filter on them only added
    # its message to each site's header (blosc +770 B for 4 scalar sites, +2.7 KiB for 100).
    steps = [
        {f"site{i}": _activation(shape, sites * step + i) for i in range(sites)}
        for step in range(count)
    ]
    plain = _write(tmp_path / "plain.h5", steps, gather=1)
    packed = _write(tmp_path / "packed.h5", steps, gather=1, compression=compression)
    assert packed <= plain, (packed, plain)
    _check_records(tmp_path / "packed.h5", steps)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_a_compressed_long_run_is_smaller_than_the_uncompressed_one(
    tmp_path: Path, compression: str
) -> None:
    # 32 KiB records, gathers of 8: chunks of one gather are compressed once, never rewritten
    # (blosc and lzf were 1.1x the uncompressed file).
    steps = [{"scores": _activation((8, 1024), step)} for step in range(160)]
    plain = _write(tmp_path / "plain.h5", steps, gather=8)
    packed = _write(tmp_path / "packed.h5", steps, gather=8, compression=compression)
    assert packed < 0.9 * plain, (packed, plain)
    _check_records(tmp_path / "packed.h5", steps)


def _statistics_file(path: Path, compression: Any, steps: int) -> int:
    """Trace ``steps`` calls of 4 blocks as statistics into ``path``; return the records."""

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x * 1.5)
            return h

    model = torch.nn.Sequential(*(Block() for _ in range(4)))
    generator = torch.Generator().manual_seed(0)
    with (
        H5PYSaverCallback(path, overwrite=True, metadata=False, compression=compression) as saver,
        vartrace.ModelTracer(
            model,
            ["*.forward.h"],
            pre_save_callbacks=[vartrace.stats()],
            post_gather_callbacks=[saver],
            gathering_interval=8,
        ),
    ):
        for _ in range(steps):
            model(torch.randn(4, 16, generator=generator))
    with vartrace.open(path) as run:
        assert {run[name].dtype for name in run.names} == {"statistics"}
        return sum(len(run[name]) for name in run.names)


@pytest.mark.parametrize("compression", [None, *COMPRESSIONS])
def test_statistics_records_take_at_most_130_bytes_each_compressed_or_not(
    tmp_path: Path, compression: str | None
) -> None:
    # With blosc a record took 455 B (each gather rewrote a compressed chunk), 126 B without.
    sizes, counts = [], []
    for steps in (40, 360):
        path = tmp_path / f"stats{steps}.h5"
        counts.append(_statistics_file(path, compression, steps))
        sizes.append(os.path.getsize(path))
    added = (sizes[1] - sizes[0]) / (counts[1] - counts[0])
    assert added <= 130, added


# -- chunks sized to what is recorded ---------------------------------------------------------


def test_a_20_step_run_gathered_once_is_within_1_2x_of_its_records(tmp_path: Path) -> None:
    # The quickstart's sites for 20 steps, one gather at the end: 16-record chunks of the
    # 32 KiB scores took 32 rows for 20 records (2.2 MB for 1.3 MB recorded).
    shapes = {"tokens": (32, 8), "scores0": (32, 4, 8, 8), "scores1": (32, 4, 8, 8)}
    shapes |= {"h0": (3,), "h1": (3,), "loss": ()}
    steps = [
        {name: _activation(shape, 7 * step + i) for i, (name, shape) in enumerate(shapes.items())}
        for step in range(20)
    ]
    size = _write(tmp_path / "run.h5", steps, gather=25)
    assert size < 1.2 * _recorded(steps), (size, _recorded(steps))
    _check_records(tmp_path / "run.h5", steps)


# -- a site whose shape changes between steps ---------------------------------------------


def _traced_shapes(path: Path, shapes: Sequence[tuple[int, ...]]) -> int:
    """A real tracer records ``out`` of a module returning a tensor of each shape in turn
    (one step each, a gather each step); returns the bytes recorded."""

    class Reshaper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x.reshape(shapes[self.step]) * 2
            self.step += 1
            return out

    model = Reshaper()
    generator = torch.Generator().manual_seed(0)
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        vartrace.ModelTracer(model, ["forward.out"], post_gather_callbacks=[saver]),
    ):
        inputs = [torch.randn(int(np.prod(shape)), generator=generator) for shape in shapes]
        for x in inputs:
            model(x)
    with vartrace.open(path) as run:
        site = run["forward.out"]
        for index, (x, shape) in enumerate(zip(inputs, shapes, strict=True)):
            assert torch.equal(site.get(index + 1), x.reshape(shape) * 2)
    return sum(4 * int(np.prod(shape)) for shape in shapes)


@pytest.mark.parametrize(
    ("shapes", "before"),
    [
        ([(256, 1), (1, 256)], "2 KiB into 67 MB"),
        ([(4096, 1), (1, 4096)], "32 KiB into 2.0 GiB in 20 s"),
        ([(1, 4, 128, 128), *((1, 4, 1, 129 + step) for step in range(32))], "336 KB into 17.9 MB"),
        ([(256, 1), (1, 256)] * 8, "16 records: 2 KiB each way"),
    ],
    ids=["transposed-256", "transposed-4096", "prefill-decode", "alternating"],
)
def test_a_site_whose_shape_changes_stays_within_a_small_multiple_of_its_records(
    tmp_path: Path, shapes: list[tuple[int, ...]], before: str
) -> None:
    path = tmp_path / "run.h5"
    recorded = _traced_shapes(path, shapes)
    assert os.path.getsize(path) < 2 * recorded + FIXED, (os.path.getsize(path), before)


def test_ragged_records_that_fit_the_chunks_stay_in_values_padded(tmp_path: Path) -> None:
    # Sequence lengths around the first record's fill its chunks: they stay in ``values``
    # (padded, read as a block); only records that would spread over many chunks go elsewhere.
    shapes = [(64, 128), (96, 128), (40, 128), (128, 128)]
    path = tmp_path / "run.h5"
    recorded = _traced_shapes(path, shapes)
    assert os.path.getsize(path) < 3 * recorded + FIXED
    with vartrace.open(path) as run:
        site = run["forward.out"]
        assert site.in_values.all()
        assert site.values is not None and site.values.shape == (4, 128, 128)
