"""Turning record values into HDF5-storable data and back, exactly.

Every record is encoded as a `Leaf`: a *kind* code (what Python type
comes back on reading) and the data.  Numeric kinds (tensors, numpy arrays
and scalars, Python `int`/`float`/`bool`/`complex`) carry a numpy
array and can share a site's numeric `values` dataset; `str` carries
the string; everything else carries bytes.  `to_blob` /
`from_blob` give every kind a byte form, used when a record does not
fit its site's `values` dataset.

Tensors whose dtype numpy lacks (bfloat16, float8, complex32) are stored as
their raw bit pattern in an unsigned integer of the same width, with the
torch dtype name alongside, and are viewed back bit-exactly (`from_array`), or
decoded to numbers of the width a reader chooses (`decode_raw`): nothing outside
this module decodes raw bits.  Sparse, meta
(shape and dtype only), quantized and nested tensors are stored in their
`torch.save` form and read back with `torch.load(weights_only=True)`,
which rebuilds tensors only (no pickle is run).  Statistics records (made by
[`vartrace.stats`][vartrace.stats]) are stored as one row of a compound dtype, a field per
statistic.  Python ints outside int64
are stored in hexadecimal, exact at any size.  torch is imported only when a
tensor is met.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import sys
from typing import Any, Literal, NamedTuple

import numpy as np

from vartrace._support.warnings import warn
from vartrace.errors import PickleNotAllowedError
from vartrace.markers import Unstored

__all__ = [
    "IN_OTHER",
    "KIND_NAMES",
    "STATISTICS",
    "Kind",
    "Leaf",
    "PickleNotAllowedError",
    "decode_raw",
    "dtype_name",
    "encode",
    "from_array",
    "from_blob",
    "in_values",
    "numeric_dtype",
    "row_shapes",
    "to_blob",
    "unstored",
]


class Kind:
    """Record kind codes, stored per record in the `kinds` dataset (uint8)."""

    NONE = 0
    TENSOR = 1
    TENSOR_RAW = 2  # a tensor stored as raw bits (bfloat16, float8, ...)
    NDARRAY = 3
    NPSCALAR = 4
    INT = 5
    FLOAT = 6
    BOOL = 7
    COMPLEX = 8
    BIGINT = 9  # a Python int outside int64
    STR = 10
    BYTES = 11
    PICKLE = 12
    TENSOR_SAVED = 13  # a sparse, meta, quantized or nested tensor, in torch.save form
    UNSTORED = 14  # a value that could not be stored: the marker text says what and why
    STATISTICS = 15  # a record of vartrace.stats(): one compound row, a field per statistic


IN_OTHER = 0x80
"""Flag or-ed into a stored kind code: the record lives in the `other` dataset."""


def in_values(kinds: np.ndarray) -> np.ndarray:
    """Which records of stored kind codes `kinds` are rows of a site's `values` dataset:
    not None, not kept in `other`."""
    return ((kinds & IN_OTHER) == 0) & (kinds != Kind.NONE)


def row_shapes(kinds: np.ndarray, row_shape: tuple[int, ...]) -> np.ndarray:
    """The true shapes of records that all have `values`' `row_shape` (a version-2 site
    without `shapes`): that shape where a record is in `values`, -1 elsewhere."""
    return np.where(in_values(kinds)[:, np.newaxis], np.asarray(row_shape, np.int64), -1)


KIND_NAMES = (
    "none",
    "tensor",
    "tensor",
    "ndarray",
    "numpy scalar",
    "int",
    "float",
    "bool",
    "complex",
    "int",
    "str",
    "bytes",
    "pickle",
    "tensor",
    "unstored",
    "statistics",
)
_NUMERIC_KINDS = "biufc"
#: The ``torch_dtype`` attribute (and ``Site.dtype``) of a site storing statistics records.
STATISTICS = "statistics"
_PY_SCALARS = {int: Kind.INT, float: Kind.FLOAT, bool: Kind.BOOL, complex: Kind.COMPLEX}
_PY_TYPES = {Kind.INT: int, Kind.FLOAT: float, Kind.BOOL: bool, Kind.COMPLEX: complex}
_INT64 = np.iinfo(np.int64)


def unstored(value: Any, error: Exception) -> Leaf:
    """The marker leaf of a record that cannot be stored."""
    return Leaf(Kind.UNSTORED, f"{type(value).__qualname__}: {error}")


class Leaf(NamedTuple):
    """One encoded record.

    `data` is a numpy array for numeric kinds (`torch_dtype` names the
    tensor dtype when the array holds raw bits), a `str` for strings, and
    `bytes` otherwise.
    """

    kind: int
    data: Any
    torch_dtype: str = ""

    @property
    def key(self) -> str:
        """What a numeric dataset must hold to store this record: dtype and rank
        (for statistics, the field names)."""
        if self.kind == Kind.STATISTICS:
            return f"{STATISTICS}:{','.join(self.data.dtype.names)}/0"
        return f"{self.torch_dtype or _typestr(self.data.dtype)}/{self.data.ndim}"


_TYPESTRS: dict[np.dtype[Any], str] = {}  # dtype -> its `str`, which numpy formats at each call


def _typestr(dtype: np.dtype[Any]) -> str:
    """`dtype.str`, formatted once a dtype (numpy formats it anew at each call: 2 k
    instructions, a twentieth of a small record's write)."""
    typestr = _TYPESTRS.get(dtype)
    if typestr is None:
        typestr = dtype.str
        if len(_TYPESTRS) < 256:  # structured dtypes are many: the first ones only
            _TYPESTRS[dtype] = typestr
    return typestr


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def dtype_name(dtype: Any, kind: str) -> str | None:
    """Normalise a `float_dtype` / `int_dtype` option to a dtype name (`None` keeps).

    `kind` is `"f"` or `"i"`; `"bfloat16"` (or `torch.bfloat16`) is a
    valid float name.  Example: `dtype_name(torch.float16, "f") == "float16"`.
    """
    if dtype is None:
        return None
    if type(dtype).__module__ == "torch" or isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    name = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name
    wanted = "f" if kind == "f" else "iu"
    if (name == "bfloat16" and kind != "f") or (
        name != "bfloat16" and np.dtype(name).kind not in wanted
    ):
        what = "a floating" if kind == "f" else "an integer"
        raise ValueError(f"{dtype!r} is not {what} dtype")
    return name


def _cast(array: np.ndarray, float_dtype: str | None, int_dtype: str | None) -> np.ndarray:
    if float_dtype not in (None, "bfloat16") and array.dtype.kind == "f":
        return array.astype(float_dtype)
    if int_dtype is not None and array.dtype.kind in "iu":
        return array.astype(int_dtype)
    return array


def _pickled(value: Any) -> Leaf:
    try:
        return Leaf(Kind.PICKLE, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as error:
        raise TypeError(
            f"cannot store a {type(value).__name__} record: it is neither an array, a number, "
            f"str, bytes nor None, and pickling it failed ({error}); leave the site out of the "
            "paths or turn the value into something storable with a pre_save callback"
        ) from error


def _encode_tensor(value: Any, float_dtype: Any, int_dtype: Any) -> Leaf:
    import torch

    tensor = value.detach()
    if type(tensor) is not torch.Tensor and not tensor.is_nested:
        plain = _plain(tensor, torch)
        if plain is None:
            return _storage_less(tensor)
        tensor = plain
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
        buffer = io.BytesIO()
        torch.save(tensor if tensor.is_meta else tensor.cpu(), buffer)
        return Leaf(Kind.TENSOR_SAVED, buffer.getvalue())
    tensor = tensor.cpu().resolve_conj().resolve_neg()
    if float_dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(getattr(torch, float_dtype))
    elif int_dtype is not None and not (
        tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool
    ):
        tensor = tensor.to(getattr(torch, int_dtype))
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _NUMPY_OF_TORCH:
        return _statistics(tensor.numpy()) or Leaf(Kind.TENSOR, tensor.numpy())
    bits = 8 * tensor.element_size()
    signed = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    raw = tensor.view(signed).numpy().view(f"u{bits // 8}")
    return Leaf(Kind.TENSOR_RAW, raw, name)


def _plain(tensor: Any, torch: Any) -> Any:
    """A tensor subclass as a plain tensor of the same memory, or `None` when it has no
    memory of its own (a wrapper of other tensors, e.g. one a library's
    `__torch_dispatch__` makes) or refuses to be viewed so."""
    try:
        if tensor.numel() and not tensor.data_ptr():
            return None
        return tensor.as_subclass(torch.Tensor)
    except Exception:
        return None


_storage_less_warned: set[str] = set()  # the subclasses said unstorable, by name


def _storage_less(tensor: Any) -> Leaf:
    """The marker of a tensor subclass the file cannot hold, with a warning once a class."""
    kind = type(tensor).__qualname__
    text = f"a {kind} tensor: cannot store it (a tensor subclass with no memory of its own)"
    if kind not in _storage_less_warned:
        _storage_less_warned.add(kind)
        warn(f"vartrace: {text}; its records are stored as Unstored markers", RuntimeWarning)
    return Leaf(Kind.UNSTORED, text)


_NUMPY_OF_TORCH = frozenset(
    [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    ]
)


def encode(value: Any, float_dtype: str | None = None, int_dtype: str | None = None) -> Leaf:
    """Encode one record value.

    `float_dtype` / `int_dtype` (names from `dtype_name`;
    `"bfloat16"` converts tensors only) convert floating / integer tensors
    and numpy arrays; Python scalars are always kept exact.

    Example:
        ```python
        leaf = encode(torch.ones(2, dtype=torch.bfloat16))
        leaf.kind == Kind.TENSOR_RAW and leaf.torch_dtype == "bfloat16"
        ```
    """
    if value is None:
        return Leaf(Kind.NONE, b"")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _encode_tensor(value, float_dtype, int_dtype)
    kind = _PY_SCALARS.get(type(value))
    if kind is not None:
        if kind == Kind.INT and not _INT64.min <= value <= _INT64.max:
            # Hexadecimal: exact at any size (decimal conversion is capped at 4300 digits).
            return Leaf(Kind.BIGINT, hex(value).encode())
        return Leaf(kind, np.asarray(value))
    if type(value) is Unstored:
        return Leaf(Kind.UNSTORED, str(value))
    if type(value) is str:
        return Leaf(Kind.STR, value)
    if type(value) is bytes:
        return Leaf(Kind.BYTES, value)
    if type(value) is np.ndarray or isinstance(value, np.generic):
        kind = Kind.NDARRAY if type(value) is np.ndarray else Kind.NPSCALAR
        array = np.asarray(value)
        if array.dtype.hasobject:
            return _pickled(value)
        if array.dtype.kind not in _NUMERIC_KINDS:
            return Leaf(kind, _npy(array))  # exact without pickle, kept out of numeric datasets
        return _statistics(array) or Leaf(kind, _cast(array, float_dtype, int_dtype))
    return _pickled(value)


def _statistics(array: np.ndarray) -> Leaf | None:
    """The leaf of a statistics record (`vartrace.stats`): a compound row, else `None`."""
    if array.dtype != np.float64 or array.ndim != 1:
        return None
    from vartrace.statistics.records import to_compound

    row = to_compound(array)
    return None if row is None else Leaf(Kind.STATISTICS, row, STATISTICS)


def to_blob(leaf: Leaf) -> bytes:
    """The byte form of any record (for blob datasets)."""
    if isinstance(leaf.data, np.ndarray):
        payload = _npy(leaf.data)
        return f"{leaf.torch_dtype}\n".encode() + payload if leaf.torch_dtype else payload
    if isinstance(leaf.data, str):
        return leaf.data.encode("utf-8", "surrogatepass")
    return leaf.data


def from_blob(kind: int, blob: bytes, allow_pickle: bool, where: str) -> Any:
    """Decode the byte form written by `to_blob`; `where` names the record in errors."""
    if kind == Kind.NONE:
        return None
    if kind == Kind.STR:
        return blob.decode("utf-8", "surrogatepass")
    if kind == Kind.BYTES:
        return blob
    if kind == Kind.BIGINT:
        return int(blob, 0)  # hexadecimal; files of older versions hold decimal
    if kind == Kind.UNSTORED:
        return Unstored(blob.decode("utf-8", "surrogatepass"))
    if kind == Kind.TENSOR_SAVED:
        import torch

        with _tensor_globals(torch):  # loads tensors only: safe
            return torch.load(io.BytesIO(blob), weights_only=True)
    if kind == Kind.PICKLE:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{where} is a pickled object; unpickling runs code stored in the file, so "
                "it is refused by default. Open the run with allow_pickle=True only if you "
                "trust whoever wrote the file."
            )
        return pickle.loads(blob)
    torch_dtype = ""
    if kind in (Kind.TENSOR_RAW, Kind.STATISTICS):
        name, _, blob = blob.partition(b"\n")
        torch_dtype = name.decode()
    return from_array(kind, np.load(io.BytesIO(blob), allow_pickle=False), torch_dtype, where)


def from_array(kind: int, array: Any, torch_dtype: str = "", where: str = "a record") -> Any:
    """The record value of a numeric kind from its stored array (or numpy scalar).

    `ValueError` naming `where` for a scalar kind stored with axes (a damaged file).
    """
    array = np.asarray(array)
    if array.ndim and (kind == Kind.NPSCALAR or kind in _PY_TYPES):
        raise ValueError(
            f"{where} is a {KIND_NAMES[kind]} stored with shape {array.shape}: a damaged file"
        )
    if kind == Kind.NDARRAY:
        return array
    if kind == Kind.STATISTICS:
        from vartrace.statistics.records import Statistics

        return Statistics(array)
    if kind == Kind.NPSCALAR:
        return array[()]
    if kind in _PY_TYPES:
        return _PY_TYPES[kind](array[()])
    import torch

    if not array.flags.c_contiguous or not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="), order="C")
    if kind == Kind.TENSOR_RAW:
        signed = torch.from_numpy(array.view(f"i{array.dtype.itemsize}"))
        return signed.view(raw_dtype(torch_dtype, array.dtype.itemsize, where))
    return torch.from_numpy(array)


def decode_raw(
    block: np.ndarray, torch_dtype: str, *, width: Literal[32, 64], where: str
) -> np.ndarray:
    """Numbers of `block`, stored as the raw bits of the torch dtype `torch_dtype`
    (bfloat16, float8, complex32, bcomplex32...: see `encode`), as floats (complex numbers for a
    complex dtype) of `width` bits, exactly; `block` itself when it holds no raw bits
    (`torch_dtype` empty or its own dtype's name, or compound rows of statistics).

    Each reader chooses its `width` once: 64 where every value is widened anyway
    (`to_frame`, `to_xarray`), 32 where blocks are compared and plotted.  bfloat16
    decodes to float32 at either width: exactly, and without importing torch.
    `ValueError` naming `where` when `torch_dtype` is no torch dtype of the block's
    item size (a damaged file).

    Example:
        ```python
        leaf = encode(torch.ones(2, dtype=torch.float8_e4m3fn))
        decode_raw(leaf.data, leaf.torch_dtype, width=32, where="x")  # array([1., 1.], float32)
        ```
    """
    if not torch_dtype or block.dtype.names or torch_dtype == block.dtype.name:
        return block
    if torch_dtype == "bfloat16" and block.dtype.itemsize == 2:
        return (block.astype(np.uint32) << 16).view(np.float32)
    import torch

    raw = torch.from_numpy(np.ascontiguousarray(block).view(f"i{block.dtype.itemsize}"))
    converted = raw.view(raw_dtype(torch_dtype, block.dtype.itemsize, where))
    if converted.is_complex():
        return converted.to(torch.complex64 if width == 32 else torch.complex128).numpy()
    return converted.to(torch.float32 if width == 32 else torch.float64).numpy()


def numeric_dtype(name: str) -> bool:
    """Whether a site's dtype name (`Site.dtype`) names numbers: a numpy dtype of
    numbers, or a torch dtype stored as raw bits that `decode_raw` turns into numbers."""
    if name in ("bfloat16", "bool") or name.startswith(("float8", "complex32", "bcomplex32")):
        return True
    try:
        return np.dtype(name).kind in "biufc"
    except TypeError:
        return False


def raw_dtype(name: str, itemsize: int, where: str) -> Any:
    """The torch dtype `name` whose bits are stored as `itemsize`-byte integers;
    `ValueError` naming `where` if it is none (a damaged file)."""
    import torch

    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != itemsize:
        raise ValueError(
            f"{where} is stored as the bits of {name!r}, which is no torch dtype of "
            f"{itemsize} bytes: a damaged file"
        )
    return dtype


def _tensor_globals(torch: Any) -> Any:
    """Allow `torch.load(weights_only=True)` torch's own rebuilders of nested tensors (newer
    torch versions no longer allow them by default); a no-op where torch lacks the API."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        return contextlib.nullcontext()
    try:
        jagged: Any = importlib.import_module("torch.nested._internal.nested_tensor")
    except ImportError:  # a torch without jagged nested tensors
        jagged = None
    found = [
        getattr(torch._utils, "_rebuild_nested_tensor", None),
        getattr(jagged, "_rebuild_njt", None),
        getattr(jagged, "NestedTensor", None),
    ]
    return safe_globals([g for g in found if g is not None])
