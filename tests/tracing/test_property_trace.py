"""Property: any nested value a traced step returns comes back from the file bit-exact.

Hypothesis builds random nested values — dicts with odd keys (dots, slashes,
``%``, NUL, lone surrogates, ints next to their str form), lists and tuples —
whose leaves are tensors of every dtype (zero-size and non-contiguous ones,
arbitrary bit patterns: NaN payloads, ``-0.0``), sparse and meta tensors,
numpy arrays and scalars, Python ints of any size, floats with NaN payloads,
complex, bool, str, bytes and None.  Each value goes through a real traced
module -> ``H5PYSaverCallback`` -> ``vartrace.open``; the step must never
raise, and every leaf must come back bit-exact, a meta tensor (whose
declared record is its shape and dtype) as a meta tensor of that shape and
dtype.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import vartrace
from tests.storage.test_storage_roundtrip import TORCH_DTYPES
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace.engine.structures import leaves

NUMPY_DTYPES = ["?", "u1", "i1", "<i2", ">i4", "<u4", "<i8", "<u8", "<f2", "<f4", ">f8"]
NUMPY_DTYPES += ["<c8", "<c16", "<U3", "S4"]


class Echo(nn.Module):
    def forward(self, value: Any) -> Any:
        return value


@st.composite
def _shapes(draw: Any) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, 3), max_size=3)))


def _raw(draw: Any, count: int, itemsize: int, *, boolean: bool) -> bytearray:
    data = bytearray(draw(st.binary(min_size=count * itemsize, max_size=count * itemsize)))
    if boolean:  # a bool byte other than 0 or 1 is undefined behaviour for torch and numpy
        data = bytearray(byte & 1 for byte in data)
    return data


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(_shapes())
    transposed = len(shape) >= 2 and draw(st.booleans())
    strided = bool(shape) and draw(st.booleans())
    full = (*shape[:-1], shape[-1] * 2) if strided else shape
    count = int(np.prod(full)) if full else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = _raw(draw, count, itemsize, boolean=dtype == torch.bool)
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(full)
    if strided:
        tensor = tensor[..., ::2]  # every other element: not contiguous
    if transposed:
        tensor = tensor.transpose(0, 1)
    return tensor


@st.composite
def odd_tensors(draw: Any) -> torch.Tensor:
    dense = torch.tensor(draw(st.lists(st.floats(allow_nan=False), min_size=4, max_size=4)))
    kind = draw(st.sampled_from(["coo", "meta"]))
    if kind == "coo":
        return dense.reshape(2, 2).to_sparse()
    return torch.empty(draw(_shapes()), dtype=draw(st.sampled_from(TORCH_DTYPES)), device="meta")


@st.composite
def arrays(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(_shapes())
    count = int(np.prod(shape)) if shape else 1
    data = _raw(draw, count, dtype.itemsize, boolean=dtype.kind == "b")
    array = np.frombuffer(bytes(data), dtype=dtype).reshape(shape).copy()
    if array.ndim and draw(st.booleans()):
        array = array[..., ::2]  # not contiguous
    return array


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0]),
    st.integers(0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF).map(_float_of_bits),  # NaN payloads
)
INTS = st.one_of(
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.sampled_from([2**63, -(2**63) - 1]),  # just beyond int64
    st.sampled_from([1, -1]).map(lambda sign: sign * 7**6000),  # beyond 4300 decimal digits
)
TEXT = st.text(st.characters(blacklist_categories=()), max_size=6)  # lone surrogates included
KEYS = st.one_of(
    TEXT,
    st.sampled_from(["a.b", "a", "b", "1", "%41", "x/y", "\0", "", "..", "\\", "\\."]),
    st.integers(-3, 3),
)
LEAVES = st.one_of(
    tensors(),
    odd_tensors(),
    arrays(),
    arrays().map(lambda a: a.reshape(-1)[0] if a.size else np.float64(-0.0)),  # numpy scalars
    INTS,
    FLOATS,
    st.complex_numbers(allow_nan=True),
    st.booleans(),
    TEXT,
    st.binary(max_size=8),
    st.none(),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(KEYS, inner, max_size=3),
    ),
    max_leaves=6,
)


def _tensor_bits(tensor: torch.Tensor) -> bytes:
    if not tensor.numel():
        return b""
    tensor = tensor.resolve_conj().resolve_neg()
    dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)  # standard strides
    return bytes(dense.reshape(-1).view(torch.uint8))


def _assert_same(got: Any, want: Any, site: str) -> None:
    assert type(got) is type(want), f"{site}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.layout) == (want.dtype, want.shape, want.layout), site
        if want.is_meta:
            assert got.is_meta, site
        elif want.layout == torch.sparse_coo:
            assert _tensor_bits(got.to_dense()) == _tensor_bits(want.to_dense()), site
        else:
            assert _tensor_bits(got) == _tensor_bits(want), site
    elif isinstance(want, (np.ndarray, np.generic)):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), site
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), site
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), site
    elif isinstance(want, complex):
        assert struct.pack("<dd", got.real, got.imag) == struct.pack("<dd", want.real, want.imag)
    else:
        assert got == want, site


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES)
def test_any_nested_value_comes_back_from_the_file_bit_exact(value: Any) -> None:
    expected = list(leaves(value, "forward"))
    assume(expected)  # an empty container has no leaf to record
    names = [name for name, _ in expected]
    assert len(set(names)) == len(names), f"two leaves share a site name: {names}"
    model = Echo()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "run.h5"
        with (
            H5PYSaverCallback(path, metadata=False) as saver,
            ModelTracer(model, ["forward"], post_gather_callbacks=[saver]),
        ):
            assert model(value) is value
        with vartrace.open(path) as run:
            assert sorted(run.names) == sorted(names)
            for site, want in expected:
                _assert_same(run[site].get(iteration=1), want, site)
