"""Every kind of record written by H5PYSaverCallback comes back exactly from vartrace.open."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vartrace.storage import H5PYSaverCallback, PickleNotAllowedError, open_run
from vartrace.storage.layout import escape, unescape
from vartrace.trace import Trace
from vartrace.tracing.callbacks import stack_padded_tensors, stack_tensors

TORCH_DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _trace(values: list[Any], iterations: list[int] | None = None) -> Trace:
    trace = Trace()
    for index, value in enumerate(values):
        trace.append(value, index + 1 if iterations is None else iterations[index], 0, index)
    return trace


def _write(path: Path, sites: dict[str, list[Any]], **options: Any) -> None:
    with H5PYSaverCallback(path, **options) as saver:
        for name, values in sites.items():
            saver(name, _trace(values))
        saver.flush()


def _same(got: Any, want: Any) -> bool:
    """Equal in type, dtype, shape and bits (NaN equals NaN, -0.0 differs from 0.0)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        return _bits(got) == _bits(want)
    if isinstance(want, np.ndarray):
        return (
            type(got) is np.ndarray
            and got.dtype == want.dtype
            and got.shape == want.shape
            and got.tobytes() == want.tobytes()
        )
    if isinstance(want, np.generic):
        return type(got) is type(want) and got.tobytes() == want.tobytes()
    if isinstance(want, float):
        return type(got) is float and (
            math.copysign(1, got) == math.copysign(1, want)
            and (got == want or (math.isnan(got) and math.isnan(want)))
        )
    if isinstance(want, complex):
        return type(got) is complex and _same(got.real, want.real) and _same(got.imag, want.imag)
    return type(got) is type(want) and got == want


def _bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.numpy().tobytes()
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(signed[flat.element_size()]).numpy().tobytes()


def _special(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Values with edge cases: extremes, NaN, infinities, signed zeros where the dtype has them."""
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
        flat = base.reshape(-1)
        for index, special in enumerate([math.nan, math.inf, -math.inf, -0.0, 0.0]):
            if index < flat.numel():
                flat[index] = special
        if dtype.is_complex:
            return torch.complex(base, base.flip(-1) if base.dim() else base).to(dtype)
        return base.to(dtype)
    kind = np.dtype(str(dtype).removeprefix("torch."))
    flat = np.random.default_rng(0).integers(0, 100, math.prod(shape)).astype(kind)
    if flat.size >= 2:
        flat[0], flat[1] = np.iinfo(kind).min, np.iinfo(kind).max
    return torch.from_numpy(flat.reshape(shape))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_round_trips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    records = [_special(dtype, (3, 4)), _special(dtype, ()), _special(dtype, (2, 5))]
    path = tmp_path / "run.h5"
    _write(path, {"forward.x": records})
    with open_run(path) as run:
        site = run["forward.x"]
        assert site.dtype == str(dtype).removeprefix("torch.")
        for index, want in enumerate(records):
            got = site.get(index + 1)
            assert _same(got, want), (index, got, want)
        assert site.shapes.tolist() == [[3, 4], [-1, -1], [2, 5]]
        assert list(site.kinds) == ["tensor"] * 3


def test_bfloat16_is_stored_as_its_bit_pattern_with_the_dtype_named(tmp_path: Path) -> None:
    tensor = torch.tensor([1.0, -2.5, math.nan, 3.0e38], dtype=torch.bfloat16)
    path = tmp_path / "run.h5"
    _write(path, {"x": [tensor]})
    with h5py.File(path, "r", swmr=True) as handle:
        values = handle["vars/x/values"]
        assert values.dtype == np.uint16
        assert values.attrs["torch_dtype"] == "bfloat16"
        assert values[0].tobytes() == tensor.view(torch.int16).numpy().tobytes()


PYTHON_VALUES = [
    0,
    -(2**63),
    2**63 - 1,
    2**64,
    -(10**40),
    1.5,
    -0.0,
    math.inf,
    math.nan,
    True,
    False,
    1 + 2j,
    complex(math.nan, -0.0),
    "",
    "text with ünïcödé and \n newlines",
    "nul \0 inside",
    "lone surrogate \ud800",
    b"",
    b"\0binary\xff\0",
    None,
]


def test_python_scalars_str_bytes_and_none_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {f"forward.v{index}": [value] for index, value in enumerate(PYTHON_VALUES)})
    with open_run(path) as run:
        for index, value in enumerate(PYTHON_VALUES):
            got = run[f"forward.v{index}"].get(1)
            assert _same(got, value), (value, got)


def test_a_site_of_python_values_keeps_each_record(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"mixed": PYTHON_VALUES, "strings": ["a", "bb", "", "ü"], "bytes": [b"1", b""]})
    with open_run(path) as run:
        site = run["mixed"]
        for index, value in enumerate(PYTHON_VALUES):
            assert _same(site.record(index), value), (value, site.record(index))
        assert run["strings"].dtype == "str"
        assert list(run["strings"].values.asstr()[:]) == ["a", "bb", "", "ü"]
        assert [run["bytes"].record(i) for i in range(2)] == [b"1", b""]


NUMPY_VALUES = [
    np.arange(6, dtype=np.int32).reshape(2, 3),
    np.array([1.5, np.nan], dtype=">f8"),
    np.array([True, False]),
    np.array(["ab", "c"]),
    np.array([b"x", b"yz"]),
    np.array(["2024-01-02"], dtype="datetime64[D]"),
    np.zeros((0, 3), np.float32),
    np.float32(2.5),
    np.int8(-3),
    np.bool_(True),
    np.complex64(1 - 1j),
    np.str_("numpy str"),
]


@pytest.mark.parametrize("value", NUMPY_VALUES, ids=lambda v: f"{type(v).__name__}-{v.dtype}")
def test_numpy_arrays_and_scalars_round_trip(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"x": [value, value]})
    with open_run(path) as run:
        assert _same(run["x"].get(1), value)
        assert _same(run["x"].get(2), value)


class Opaque:
    def __init__(self, payload: list[int]) -> None:
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.payload == self.payload


def test_opaque_objects_are_pickled_and_read_only_with_allow_pickle(tmp_path: Path) -> None:
    values = [{"lr": 0.1, "betas": (0.9, 0.99)}, Opaque([1, 2]), np.array([object()], dtype=object)]
    path = tmp_path / "run.h5"
    _write(path, {"opt.state": values[:2]})
    with open_run(path) as run:
        site = run["opt.state"]
        assert list(site.kinds) == ["pickle", "pickle"]
        with pytest.raises(PickleNotAllowedError, match="allow_pickle=True") as caught:
            site.get(1)
        assert "runs code" in str(caught.value)
    with open_run(path, allow_pickle=True) as run:
        assert run["opt.state"].get(1) == values[0]
        assert run["opt.state"].get(2) == values[1]


def test_an_unpicklable_record_becomes_a_marker_with_a_clear_warning(tmp_path: Path) -> None:
    with (
        H5PYSaverCallback(tmp_path / "run.h5") as saver,
        pytest.warns(RuntimeWarning, match="site 'forward.fn': .*pre_save callback"),
    ):
        saver("forward.fn", _trace([lambda: 1, 2.5]))
    with open_run(tmp_path / "run.h5") as run:
        marker, number = run["forward.fn"].get(iteration=1), run["forward.fn"].get(iteration=2)
    assert type(marker).__name__ == "Unstored" and marker.startswith("function: cannot store")
    assert number == 2.5


def test_a_site_whose_kind_or_dtype_changes_keeps_every_record(tmp_path: Path) -> None:
    """The first non-None record fixes ``values``; the others go to ``other``, exactly."""
    records = [
        None,
        torch.ones(2, 3),
        None,
        torch.ones(2, 3, dtype=torch.float64),
        torch.ones(4),
        7,
        "text",
        torch.full((3, 5), 2.0),
    ]
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("forward.mask", _trace(records[:1]))  # a chunk of only None comes first
        saver("forward.mask", _trace(records[1:], iterations=list(range(2, 9))))
    with open_run(path) as run:
        site = run["forward.mask"]
        for index, want in enumerate(records):
            assert _same(site.get(index + 1), want), index
        assert site.in_values.tolist() == [False, True, False, False, False, False, False, True]
        assert site.values.shape == (8, 3, 5)
        assert site.shapes[7].tolist() == [3, 5]
        assert list(site.kinds) == [
            "none",
            "tensor",
            "none",
            "tensor",
            "tensor",
            "int",
            "str",
            "tensor",
        ]


def test_a_site_of_only_none_has_no_values(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"forward.cache": [None, None]})
    with open_run(path) as run:
        site = run["forward.cache"]
        assert site.values is None and site.dtype == "none"
        assert site.get(2) is None and len(site) == 2


def test_ragged_records_come_back_with_their_true_shapes(tmp_path: Path) -> None:
    batches = [torch.randn(8, 5), torch.randn(8, 5), torch.randn(3, 5)]  # smaller last batch
    sequences = [torch.randn(2, n, 4) for n in (7, 12, 3, 12)]  # variable sequence length
    path = tmp_path / "run.h5"
    _write(path, {"batch": batches, "seq": sequences})
    with open_run(path) as run:
        for name, records in (("batch", batches), ("seq", sequences)):
            site = run[name]
            for index, want in enumerate(records):
                assert _same(site.get(index + 1), want)
            assert [tuple(s) for s in site.shapes] == [tuple(r.shape) for r in records]
        assert run["seq"].values.shape == (4, 2, 12, 4)


def test_a_later_larger_record_grows_the_dataset_across_chunks(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("x", _trace([torch.ones(2, 3)]))
        saver.flush()
        saver("x", _trace([torch.ones(5, 1) * 2, torch.ones(1, 9) * 3], iterations=[2, 3]))
    with open_run(path) as run:
        site = run["x"]
        assert site.values.shape == (3, 5, 9)
        assert _same(site.get(1), torch.ones(2, 3))
        assert _same(site.get(2), torch.ones(5, 1) * 2)
        assert _same(site.get(3), torch.ones(1, 9) * 3)


def test_stacked_and_padded_traces_round_trip(tmp_path: Path) -> None:
    equal = [torch.randn(2, 3) for _ in range(4)]
    ragged = [torch.randn(3, n).bfloat16() for n in (1, 4, 2)]
    stacked, padded = _trace(equal), _trace(ragged)
    stack_tensors("equal", stacked)
    stack_padded_tensors("ragged", padded)
    assert isinstance(padded.values, torch.Tensor) and padded.shapes is not None
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("equal", stacked)
        saver("ragged", padded)
        assert len(stacked) == 0 and len(padded) == 0  # the saver empties the chunk
        later = _trace([torch.randn(3, 6).bfloat16()], iterations=[4])
        saver("ragged", later)  # a list-valued chunk after stacked ones
    with open_run(path) as run:
        for index, want in enumerate(equal):
            assert _same(run["equal"].get(index + 1), want)
        for index, want in enumerate([*ragged, later_value(path)]):
            assert _same(run["ragged"].get(index + 1), want)
        assert run["ragged"].shapes.tolist() == [[3, 1], [3, 4], [3, 2], [3, 6]]


def later_value(path: Path) -> torch.Tensor:
    with open_run(path) as run:
        return run["ragged"].record(3)


def test_float_and_int_dtype_options_convert_tensors_and_arrays_only(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    records = [torch.randn(3), torch.arange(3), np.linspace(0, 1, 3), 0.1, 2**40, torch.ones(2) > 0]
    _write(path, {"x": records}, float_dtype="float16", int_dtype=torch.int32)
    with open_run(path) as run:
        site = run["x"]
        assert _same(site.get(1), records[0].half())
        assert _same(site.get(2), records[1].int())
        assert _same(site.get(3), records[2].astype(np.float16))
        assert _same(site.get(4), 0.1) and _same(site.get(5), 2**40)
        assert _same(site.get(6), records[5])
    _write(tmp_path / "bf.h5", {"x": [torch.randn(4)]}, float_dtype=torch.bfloat16)
    with open_run(tmp_path / "bf.h5") as run:
        assert run["x"].get(1).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not an integer dtype"):
        H5PYSaverCallback(tmp_path / "bad.h5", int_dtype="float32")


ODD_NAMES = [
    "forward.x",
    "layers.0.attn.forward.scores@grad",
    "forward.batch.a/b",
    "forward.batch./",
    "forward.batch.%2F",
    "forward.batch.100%",
    ".",
    "..",
    "",
    "forward.nul\0key",
    "forward.ünï cödé",
    "/leading",
]


def test_odd_site_names_are_escaped_reversibly(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {name: [index] for index, name in enumerate(ODD_NAMES)})
    with open_run(path) as run:
        assert sorted(run.names) == sorted(ODD_NAMES)
        for index, name in enumerate(ODD_NAMES):
            assert run[name].get(1) == index
    with h5py.File(path, "r", swmr=True) as handle:
        stored = {group.attrs.get("name") for group in handle["vars"].values()}
    assert stored == {name for name in ODD_NAMES if "\0" not in name} | {None}


@given(st.text())
def test_escape_is_reversible_and_yields_valid_link_names(name: str) -> None:
    link = escape(name)
    assert unescape(link) == name
    assert link and "/" not in link and "\0" not in link and set(link) != {"."}


_DTYPES = st.sampled_from(TORCH_DTYPES)
_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(records=st.lists(st.tuples(_DTYPES, _SHAPES), min_size=1, max_size=6), stack=st.booleans())
def test_property_any_sequence_of_tensors_round_trips(
    tmp_path: Path, records: list[tuple[torch.dtype, tuple[int, ...]]], stack: bool
) -> None:
    """Any sequence of dtypes and shapes (ranks, dtypes and sizes changing) round-trips."""
    values = [_special(dtype, shape) for dtype, shape in records]
    trace = _trace(values)
    same_rank = len({v.dim() for v in values}) == 1 and len({v.dtype for v in values}) == 1
    if stack and same_rank:
        stack_padded_tensors("x", trace)
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False, overwrite=True) as saver:
        saver("x", trace)
    with open_run(path) as run:
        for index, want in enumerate(values):
            assert _same(run["x"].record(index), want), (index, records)


def test_importing_the_storage_layer_does_not_import_torch() -> None:
    code = "import sys, vartrace.storage; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pickle_payload_is_not_run_when_reading_without_allow_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    assert pickle.loads(pickle.dumps(Boom())) is None and marker.exists()
    marker.unlink()
    path = tmp_path / "run.h5"
    _write(path, {"x": [Boom()]})
    assert not marker.exists()
    with open_run(path) as run, pytest.raises(PickleNotAllowedError):
        run["x"].get(1)
    assert not marker.exists()
    with open_run(path, allow_pickle=True) as run:
        run["x"].get(1)
    assert marker.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_large_records_fill_whole_chunks_and_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    """Records of >= 512 KiB get a chunk each, written straight to the file; ragged ones too."""
    rows = (512 << 10) // (1024 * (torch.finfo(dtype).bits if dtype.is_floating_point else 8) // 8)
    shapes = [(rows, 1024), (rows, 1024), (rows // 3, 1024), (rows + 7, 1024), (rows, 1024)]
    records = [_special(dtype, shape) for shape in shapes]
    path = tmp_path / "run.h5"
    _write(path, {"big": records[:3]})
    with H5PYSaverCallback(path, append=True) as saver:
        saver("big", _trace(records[3:], iterations=[4, 5]))
    with open_run(path) as run:
        site = run["big"]
        assert site.values.chunks == (1, rows, 1024)
        assert site.values.shape == (5, rows + 7, 1024)
        for index, want in enumerate(records):
            assert _same(site.get(index + 1), want), index
