"""The one raw-bit codec: every dtype the writer stores as raw bits comes back exactly, as
its bits (`from_array`) and as numbers of either width (`decode_raw`)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from vartrace.storage.codec import Kind, decode_raw, encode, from_array, numeric_dtype


def _raw_dtypes() -> list[torch.dtype]:
    """Every floating or complex torch dtype the writer stores as raw bits (numpy lacks it)."""
    found = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{name}":
            continue
        if not (dtype.is_floating_point or dtype.is_complex):
            continue
        with warnings.catch_warnings():  # complex32 support is "experimental"
            warnings.simplefilter("ignore", UserWarning)
            leaf = encode(torch.zeros(1, dtype=dtype))
        if leaf.kind == Kind.TENSOR_RAW:
            found.append(dtype)
    return found


RAW_DTYPES = _raw_dtypes()
#: Those stored as numbers: all but the packed ones (float4_e2m1fn_x2, two values a byte),
#: which torch converts to no float and which are kept and read back as their bits only.
NUMERIC_DTYPES = [d for d in RAW_DTYPES if numeric_dtype(str(d).removeprefix("torch."))]
SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Tensors of `dtype` holding every bit pattern (a seeded sample of 4-byte ones)."""
    size = dtype.itemsize
    if size <= 2:
        info = np.iinfo(SIGNED[size])
        bits = np.arange(info.min, info.max + 1, dtype=SIGNED[size])
    else:
        bits = np.random.default_rng(0).integers(-(2**31), 2**31, 4096).astype(SIGNED[size])
    return torch.from_numpy(bits).view(dtype)


def test_the_raw_dtypes_are_those_numpy_lacks() -> None:
    names = {str(dtype).removeprefix("torch.") for dtype in RAW_DTYPES}
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "complex32"} <= names
    assert not names & {"float16", "float32", "float64", "complex64", "complex128"}
    numeric = {str(dtype).removeprefix("torch.") for dtype in NUMERIC_DTYPES}
    assert all(name.endswith("_x2") for name in names - numeric)


@pytest.mark.parametrize("dtype", RAW_DTYPES, ids=str)
def test_every_raw_dtype_comes_back_as_its_bits(dtype: torch.dtype) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = _every_pattern(dtype)
        leaf = encode(tensor)
        assert leaf.kind == Kind.TENSOR_RAW and leaf.data.dtype.kind == "u"
        back = from_array(Kind.TENSOR_RAW, leaf.data, leaf.torch_dtype)
    signed = SIGNED_TORCH[dtype.itemsize]
    assert back.dtype == dtype and torch.equal(back.view(signed), tensor.view(signed))


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=str)
@pytest.mark.parametrize("width", [32, 64])
def test_every_raw_dtype_decodes_to_numbers_at_both_widths(dtype: torch.dtype, width: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = _every_pattern(dtype)
        leaf = encode(tensor)
        # bfloat16 decodes to float32 at either width: exact, and without torch
        if dtype.is_complex:
            wanted = torch.complex64 if width == 32 else torch.complex128
        else:
            wanted = torch.float32 if width == 32 or dtype == torch.bfloat16 else torch.float64
        expected = tensor.to(wanted).numpy()
    numbers = decode_raw(leaf.data, leaf.torch_dtype, width=width, where="site 'x'")
    assert numbers.dtype == expected.dtype and numbers.shape == expected.shape
    np.testing.assert_array_equal(numbers, expected)  # NaNs in the same places


@pytest.mark.parametrize("width", [32, 64])
def test_blocks_without_raw_bits_come_back_as_they_are(width: int) -> None:
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert decode_raw(floats, "", width=width, where="x") is floats
    assert decode_raw(floats, "float32", width=width, where="x") is floats
    rows = np.zeros(2, dtype=[("mean", "f8"), ("std", "f8")])  # statistics records
    assert decode_raw(rows, "statistics", width=width, where="x") is rows


def test_bits_of_no_torch_dtype_of_their_size_are_a_damaged_file() -> None:
    with pytest.raises(ValueError, match="site 'x' is stored as the bits of 'float8_e4m3fn'"):
        decode_raw(np.zeros(2, np.uint16), "float8_e4m3fn", width=64, where="site 'x'")
    with pytest.raises(ValueError, match="no torch dtype"):
        decode_raw(np.zeros(2, np.uint8), "not a dtype", width=32, where="site 'x'")


@pytest.mark.parametrize(
    "dtype",
    [np.float32, ">f4", np.int64, ">i8", np.uint8, np.complex64, np.bool_],
)
def test_a_leafs_key_names_its_dtype_and_rank_however_often_it_is_asked(dtype: str) -> None:
    # the key's dtype is formatted once a dtype (numpy formats `dtype.str` at each call):
    # a byte-swapped dtype, equal in kind, keeps a key of its own
    for _ in range(2):
        for shape in ((), (3,), (2, 2)):
            array = np.zeros(shape, dtype)
            assert encode(array).key == f"{np.dtype(dtype).str}/{len(shape)}"
