"""The statistics row of one record in one read: a numpy kernel, a torch custom op.

`summarize_values` computes the 11 float64 fields of
`SUMMARY_FIELDS` (count, mean, std, min, max,
absmax, norm over the finite values; counts of NaN, +inf, -inf and exact zeros) of a
numpy array without a float64 copy of it, in blocks of `BLOCK` values.  A block's values
are upcast into a reused float64 buffer (float64 values are read where they lie); its
sum and sum of squares are float64 reductions (float32 squares are exact there): dots
with ones and with itself in numpy's BLAS, or for blocks of 8 Ki values and more torch's
cast, sum and dot (vectorised, on torch's threads); they also find NaN and infinities.
Min, max and the zeros are read from float32 or float64 values as they are.  The
centred sum of squares is the plain one less sum x mean while that cancels at most 4
bits (mean**2 <= 15x the variance: an error at most 16x the two-pass formula's); past
that the block, still in the cache, is centred on its mean and summed again (the
two-pass sum, corrected by the centred values' sum).  The blocks' `(count, mean, M2)`
are merged by Chan, Golub and LeVeque's formula, their means relative to a shift (the
first value, when finite), so a large mean with a tiny spread loses no digits.  A block
with NaN or infinities counts them (from its sum's sign when it holds one infinity only)
and sets them to zero before its sums.  A record of at most `_SMALL` values is read from
one sorted float64 copy instead: one search finds where its -inf, zeros, +inf and NaN
lie, and its finite values are the slice between (~6 numpy calls in all).

`summary` is the same row for a tensor, on the tensor's device, as ONE torch op,
`torch.ops.vartrace.summary` (a `torch.library` op, traceable by its fake kernel):
on the CPU `summarize_values` on a zero-copy view (bfloat16 widened to float32
bits, float8 decoded by a table of its 256 values), on CUDA two Triton kernels
(`vartrace.statistics.triton_kernel`), elsewhere the eager torch formulation
`eager_summary`.  Complex values are reduced by magnitude.

Example:
    ```python
    summarize_values(np.array([1.0, np.nan, 3.0]))[:3]   # count 3, mean 2, std 1
    summary(torch.randn(10, device="cuda"))              # 11 float64 on the device
    ```
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from vartrace._support.warnings import warn
from vartrace.statistics.compiled import row as compiled_row

__all__ = [
    "BLOCK",
    "Decoder",
    "bfloat16_decoder",
    "cpu_summary",
    "eager_summary",
    "summarize_values",
    "summary",
    "summary_op",
    "table_decoder",
]

#: Elements upcast and reduced at a time: their float64 buffer (1 MiB) stays in the cache
#: (64 Ki values: ~11% more instructions a value, ~15% more time, for the fixed costs).
BLOCK = 1 << 17

#: Blocks of at least this many values are upcast and summed by torch's vectorised kernels
#: (numpy's cast loop costs ~2.8 instructions a value, torch's ~1.3; numpy's BLAS would
#: start threads of its own past 10,000), smaller ones by numpy's (a smaller fixed cost:
#: torch's sums of 8 Ki values cost ~42 k instructions, two BLAS dots ~20 k).
_LARGE = 10_000

#: A block's centred sum of squares is its plain one less its sum times its mean while
#: that cancels at most 4 bits (the plain sum at most 16x the centred one: mean**2 at most
#: 15x the variance); past that the block, in the cache, is centred on its mean and summed
#: again (a large mean with a tiny spread loses no digits).
_CANCELLATION = 16.0

#: Writes the float64 values of some codes into a buffer of their length (dtypes numpy lacks).
Decoder = Callable[[np.ndarray, np.ndarray], None]

#: Records of at most this many values are summarised from a sorted float64 copy
#: (`_sorted_fields`): a few numpy calls in all, where blocks take ~15.
_SMALL = 256

#: The search keys of a sorted record: where its -inf end, its zeros start and end
#: (-0.0 among them), its +inf and its NaN start.
_BOUNDS = np.array([-np.finfo(np.float64).max, 0.0, 5e-324, math.inf, math.nan])
_SMALL_ONES = np.ones(_SMALL)
_SMALL_ONES.flags.writeable = False

_ones = np.ones(0)  # a small block's sum is a BLAS dot with ones (numpy's sum: 3x the cost)
_min, _max = np.minimum.reduce, np.maximum.reduce  # (ndarray.min: a Python wrapper more)
#: The dtypes whose large blocks torch upcasts (the others: numpy's cast).
_TORCH_CASTS = frozenset(
    np.dtype(name) for name in ("float16", "float32", "int8", "int16", "int32", "int64", "uint8")
)


def summarize_values(values: np.ndarray, decode: Decoder | None = None) -> np.ndarray:
    """The 11 float64 summary fields of a real or complex (by magnitude) numeric array.

    `decode`: `values` are the codes of a dtype numpy lacks (bfloat16, float8), turned
    into float64 by this function (`bfloat16_decoder`, `table_decoder`).
    Temporaries: one float64 buffer of at most `BLOCK` values, a bool and a code
    buffer of as many; the array is read once (copied only where it is not dense).

    Example:
        ```python
        summarize_values(np.array([[0.0, -np.inf], [2.0, 4.0]], np.float32))
        ```
    """
    return np.array(_fields(values, decode))


def _fields(values: np.ndarray, decode: Decoder | None, *head: float) -> list[float]:
    """`head`, then the 11 summary fields of `values` (`summarize_values`).

    Per block of `BLOCK` values: the sum and the sum of squares as float64 reductions of
    the float64 values (float32 squares are exact in float64), min, max and zeros of float32
    or float64 values as they are (others in float64); the blocks' `(count, mean, M2)`
    merged by Chan, Golub and LeVeque's formula, the means relative to a shift (the first
    value, when finite).  One block is reduced with ~12 numpy calls, and only the values'
    float64 copy (none for float64 values) as a temporary."""
    flat = values.ravel(order="K")
    size = flat.size
    if size <= _SMALL and size <= BLOCK:
        return _sorted_fields(flat, decode, head)
    # float64 values are reduced where they lie (torch reads only arrays it may write)
    in_place = decode is None and flat.dtype == np.float64 and flat.flags.writeable
    native = in_place or (decode is None and flat.dtype == np.float32)
    buffer = None if in_place else np.empty(min(size, BLOCK))
    upcast, ones = decode or _upcast, _ones_of(min(size, _LARGE))
    count = total = squares = offset = shift = 0.0
    low, high, counted = math.inf, -math.inf, [0, 0, 0, 0]
    with np.errstate(all="ignore"):  # NaN and infinities are counted, not warned of
        for start in range(0, size, BLOCK):
            source = flat if size <= BLOCK else flat[start : start + BLOCK]
            block = source if buffer is None else buffer[: source.size] if start else buffer
            if buffer is not None:
                upcast(source, block)
            if size > BLOCK and not start and math.isfinite(block[0]):
                shift = float(block[0])  # the block means are taken relative to it
            values = source if native else block
            n, s, q, m, lo, hi = _reduce(block, values, ones, counted, buffer is not None)
            if n:  # Chan, Golub and LeVeque's merge of (count, mean, M2)
                delta = (m - shift) - offset
                merged = count + n
                squares += q + delta * delta * (count * n / merged)
                offset += delta * (n / merged)
                count, total = merged, total + s
                low, high = min(low, lo), max(high, hi)
    if not count:
        return [*head, size, math.nan, math.nan, math.nan, math.nan, math.nan, 0.0, *counted]
    mean, var = total / count, squares / count
    norm = math.sqrt(count * (var + mean * mean))
    return [*head, size, mean, math.sqrt(var), low, high, max(-low, high), norm, *counted]


def _sorted_fields(
    flat: np.ndarray, decode: Decoder | None, head: tuple[float, ...]
) -> list[float]:
    """`head`, then the summary fields of a few values (at most `_SMALL`), from a sorted
    float64 copy: one search finds where its -inf, zeros, +inf and NaN lie, the finite
    ones are the slice between, their sums two BLAS dots (the fixed cost of a tiny record:
    ~6 numpy calls, whatever its values)."""
    if decode is None and flat.dtype.kind != "c":
        ordered = flat.astype(np.float64)  # a copy, float64 values too
    else:
        ordered = np.empty(flat.size)
        (decode or _upcast)(flat, ordered)
    ordered.sort()  # NaN last, after +inf
    neginf, zero, positive, posinf, nan = ordered.searchsorted(_BOUNDS).tolist()
    size, n = flat.size, posinf - neginf
    counted = [size - nan, nan - posinf, neginf, positive - zero]
    if not n:
        return [*head, size, math.nan, math.nan, math.nan, math.nan, math.nan, 0.0, *counted]
    finite = ordered[neginf:posinf]
    low, high = float(finite[0]), float(finite[-1])
    total, plain = float(finite.dot(_SMALL_ONES[:n])), float(finite.dot(finite))
    mean = total / n
    squares = plain - total * mean
    if not plain <= _CANCELLATION * squares:  # cancelled, or past float64: centred again
        with np.errstate(all="ignore"):
            centred = np.subtract(finite, mean, out=finite)
        correction, squares = float(centred.dot(_SMALL_ONES[:n])), float(centred.dot(centred))
        squares = max(0.0, squares - correction * correction / n)
        mean += correction / n
    var = squares / n
    norm = math.sqrt(n * (var + mean * mean))
    return [*head, size, mean, math.sqrt(var), low, high, max(-low, high), norm, *counted]


def _ones_of(width: int) -> np.ndarray:
    """`width` ones (float64, at least), shared and never written."""
    global _ones
    ones = _ones
    if ones.size < width:
        ones = _ones = np.ones(_LARGE)
        ones.flags.writeable = False
    return ones


def _sums(block: np.ndarray, ones: np.ndarray) -> tuple[float, float]:
    """The sum and the sum of squares of a float64 block: BLAS dots (float32 squares are
    exact in float64), torch's for a large block."""
    if block.size >= _LARGE:
        import torch

        values = torch.from_numpy(block)
        return float(values.sum()), float(torch.dot(values, values))
    return float(block.dot(ones[: block.size])), float(block.dot(block))  # (np.dot: 2x the call)


def _upcast(source: np.ndarray, out: np.ndarray) -> None:
    """`source` as float64 in `out` (complex values: their magnitudes)."""
    if source.dtype.kind == "c":
        np.abs(source, out=out)
    elif out.size >= _LARGE and source.dtype in _TORCH_CASTS and source.flags.writeable:
        import torch

        torch.from_numpy(out).copy_(torch.from_numpy(source))
    else:
        np.copyto(out, source, casting="unsafe")


def bfloat16_decoder(codes: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 bit patterns (uint16) as float64: the float32 of the same top 16 bits."""
    wide = np.left_shift(codes, 16, dtype=np.uint32)
    _upcast(wide.view(np.float32), out)


def table_decoder(table: np.ndarray) -> Decoder:
    """A decoder of uint8 codes by the float64 `table` of their 256 values (float8)."""

    def decode(codes: np.ndarray, out: np.ndarray) -> None:
        step = 1 << 13  # numpy turns the codes into 8-byte indices: a few at a time
        for start in range(0, codes.size, step):
            np.take(table, codes[start : start + step], out=out[start : start + step])

    return decode


def _reduce(
    block: np.ndarray, values: np.ndarray, ones: np.ndarray, counted: list[int], own: bool
) -> tuple[float, ...]:
    """One float64 block (`values`: the same values, maybe narrower, for min, max and
    zeros; `ones`: as many ones at least; `own`: a buffer the block may be centred in):
    finite count, sum, centred sum of squares, mean, min, max; adds its NaN, +inf, -inf
    and zero counts to `counted`.

    Non-finite values are counted, then set to zero in the block (a copy of it when it is
    not `own`): its sums are then the finite values', its extremes theirs unless one is
    zero (then read past a mask), its zeros theirs and the non-finite ones."""
    # total: NaN with a NaN or both infinities, +-inf with one; plain: +inf with a square
    # past float64 too
    total, plain = _sums(block, ones)
    size = n = block.size
    kept = None  # where the finite values are, when some are not
    if not (math.isfinite(total) and math.isfinite(plain)):
        finite = np.isfinite(block)
        n = int(np.count_nonzero(finite))
        if n < size:
            _count_nonfinite(block, total, size - n, counted)
            if not n:
                return 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf
            kept = finite
            block = values = _zero_filled(block, own)
            own = True
            total, plain = _sums(block, ones)
    low, high = _extremes(values)
    if low <= 0 <= high:  # else no value is zero: no pass to count them
        zeros = _zeros(values) - (size - n)
        counted[3] += zeros
        if kept is not None and not zeros and (low == 0 or high == 0):  # a stand-in's zero
            low = float(_min(block, where=kept, initial=math.inf))
            high = float(_max(block, where=kept, initial=-math.inf))
    mean = total / n
    squares = plain - total * mean
    if math.isfinite(plain) and plain <= _CANCELLATION * squares:
        return n, total, squares, mean, low, high
    centred = np.subtract(block, mean, out=block if own else None)
    if kept is not None:
        np.putmask(centred, ~kept, 0.0)
    correction, squares = _sums(centred, ones)
    squares = max(0.0, squares - correction * correction / n)
    return n, total, squares, mean + correction / n, low, high


def _zero_filled(block: np.ndarray, own: bool) -> np.ndarray:
    """`block` with its NaN and infinities set to zero, in place when it is `own`: torch's
    vectorised `nan_to_num` (numpy's `putmask` takes ~7 instructions a value)."""
    import torch

    values = torch.from_numpy(block)
    if own:
        return values.nan_to_num_(0.0, 0.0, 0.0).numpy()
    return values.nan_to_num(0.0, 0.0, 0.0).numpy()


def _count_nonfinite(block: np.ndarray, total: float, count: int, counted: list[int]) -> None:
    """Add the NaN, +inf and -inf counts of `block` (`count` values in all, `total` its
    sum) to `counted`: a sum of +-inf has only that infinity (a NaN or the other infinity
    would have made it NaN), a NaN sum needs two passes."""
    if total == math.inf:
        counted[1] += count
    elif total == -math.inf:
        counted[2] += count
    else:
        nan = int(np.count_nonzero(np.isnan(block)))
        posinf = int(np.count_nonzero(np.equal(block, math.inf)))
        counted[0] += nan
        counted[1] += posinf
        counted[2] += count - nan - posinf


def _extremes(values: np.ndarray) -> tuple[float, float]:
    """The min and the max of finite `values`: the ends of a sorted copy for a few hundred
    (one call, not two)."""
    if values.size < 512:
        ordered = np.sort(values)
        return float(ordered[0]), float(ordered[-1])
    return float(_min(values)), float(_max(values))


def _zeros(values: np.ndarray) -> int:
    """How many of `values` equal zero: compared into a bool buffer past a few hundred
    (numpy counts the non-zeros of numbers one at a time)."""
    if values.size < 512:
        return values.size - int(np.count_nonzero(values))
    return int(np.count_nonzero(np.equal(values, 0)))


def eager_summary(x: Any, header: float | None = None) -> Any:
    """The summary fields of a tensor in eager torch ops on its device (devices without a
    kernel of `summary`, CUDA without triton): a float64 copy, ~40 ops; `header`
    first, when given."""
    import torch

    if x.is_complex():
        x = x.abs()
    x = x.reshape(-1).to(torch.float64)
    device = x.device
    if not x.numel():  # known from the shape: a constant row
        row = _headed(summarize_values(np.empty(0)), header)
        return torch.from_numpy(row).to(device, non_blocking=True)
    finite = torch.isfinite(x)
    count = finite.sum(dtype=torch.float64)
    zeroed = torch.where(finite, x, 0.0)
    mean = zeroed.sum() / count
    centred = torch.where(finite, x - mean, 0.0)
    has = count > 0
    nan = torch.full((), math.nan, dtype=torch.float64, device=device)
    flags = torch.stack([torch.isnan(x), x == math.inf, x == -math.inf, x == 0])
    summary = [
        torch.full((), float(x.numel()), dtype=torch.float64, device=device),
        mean,
        torch.sqrt((centred * centred).sum() / count),
        torch.where(has, torch.where(finite, x, math.inf).amin(), nan),
        torch.where(has, torch.where(finite, x, -math.inf).amax(), nan),
        torch.where(has, zeroed.abs().amax(), nan),
        torch.sqrt((zeroed * zeroed).sum()),
    ]
    parts = [torch.stack(summary), flags.sum(dim=1, dtype=torch.float64)]
    if header is not None:
        parts.insert(0, torch.full((1,), header, dtype=torch.float64, device=device))
    return torch.cat(parts)


def _headed(row: np.ndarray, header: float | None) -> np.ndarray:
    """`row` with `header` before it, when given."""
    if header is None:
        return row
    out = np.empty(len(row) + 1)
    out[0], out[1:] = header, row
    return out


_NUMPY_DTYPES = (
    "float16", "float32", "float64", "complex64", "complex128", "bool",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
)  # fmt: skip
_numpy_dtypes: frozenset[Any] = frozenset()  # those torch dtypes, once torch is imported
_decoders: dict[Any, Decoder] = {}


def _as_torch_dtypes(torch: Any) -> frozenset[Any]:
    """The torch dtypes of `_NUMPY_DTYPES` (kept in `_numpy_dtypes`)."""
    global _numpy_dtypes
    _numpy_dtypes = frozenset(getattr(torch, name) for name in _NUMPY_DTYPES)
    return _numpy_dtypes


def cpu_summary(x: Any, header: float | None = None) -> Any:
    """The op's CPU kernel: `summarize_values` on a view of the tensor's memory.

    Called directly on a CPU tensor it is the op without the dispatcher's round trip
    (what a statistics record of a CPU tensor uses).  A dense float32, float64 or
    bfloat16 tensor is read by the compiled kernel (`vartrace.statistics.compiled`)
    where it is built.
    """
    row = compiled_row(x, header, BLOCK)
    if row is not None:
        return row
    import torch

    head = () if header is None else (header,)
    return torch.from_numpy(np.array(_cpu_fields(x, head)))


def _cpu_fields(x: Any, head: tuple[float, ...]) -> Any:
    """`head`, then the summary fields of CPU tensor `x` (a list, or an array)."""
    import torch

    if x.requires_grad or type(x) is not torch.Tensor:  # a subclass detached, as copies are
        x = x.detach()
    if x.is_complex():
        x = x.resolve_conj().resolve_neg()
    if x.dtype in (_numpy_dtypes or _as_torch_dtypes(torch)):
        return _fields(x.numpy(), None, *head)
    if x.dtype == torch.bfloat16:
        codes = x.view(torch.int16).numpy().view(np.uint16)
        return _fields(codes, bfloat16_decoder, *head)
    if not x.is_floating_point() or x.element_size() != 1:
        return eager_summary(x, *head).numpy()
    decode = _decoders.get(x.dtype)
    if decode is None:  # float8: its 256 bit patterns decoded once
        patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(x.dtype)
        decode = _decoders[x.dtype] = table_decoder(patterns.to(torch.float64).numpy())
    return _fields(x.view(torch.uint8).numpy(), decode, *head)


_triton: Any = None  # vartrace.statistics.triton_kernel once imported; False without triton


def _cuda_summary(x: Any, header: float | None = None) -> Any:
    """The op's CUDA kernel: two Triton launches (eager torch without triton, or for a
    dtype the kernels do not load)."""
    global _triton
    if _triton is None:
        try:
            _triton = importlib.import_module("vartrace.statistics.triton_kernel")
        except ImportError:  # a CUDA build of torch without triton
            _triton = False
    if x.is_complex():
        x = x.abs()
    if _triton and (x.dtype in _triton.DTYPES or (x.is_floating_point() and x.element_size() == 1)):
        import torch

        try:
            return _triton.summary(x, header)
        except torch.OutOfMemoryError:
            pass  # the device is short of memory, not Triton broken: eager ops, this time
        except Exception as error:  # a Triton that cannot compile or launch here
            _triton = False
            warn(
                f"vartrace: statistics on {x.device}: Triton's kernels failed "
                f"({type(error).__name__}: {error}); from now on statistics are computed in "
                "eager torch ops (the same fields, about 40 small kernels a record)",
                RuntimeWarning,
            )
    return eager_summary(x, header)


_library: Any = None  # the torch.library.Library holding the op (its kernels live with it)
_op: Any = None  # torch.ops.vartrace.summary.default once registered
_registering = threading.Lock()


def summary_op() -> Any:
    """`torch.ops.vartrace.summary.default`, registered on first use.

    Registered with `torch.library.Library` (a kernel per dispatch key), not
    `torch.library.custom_op`, whose Python wrappers cost ~40 us a call against ~1.5 us:
    a CPU kernel, a CUDA kernel, the eager formulation for every other device
    (CompositeExplicitAutograd) and a fake kernel (so `torch.compile` and FakeTensor
    trace it).  No autograd formula: records are reduced under `no_grad`.
    """
    global _library, _op
    if _op is None:
        import torch

        with _registering:  # the first records may come from the autograd threads too
            if not hasattr(torch.ops.vartrace, "summary"):  # (or another copy of this module)
                _library = _define(torch)
            _op = torch.ops.vartrace.summary.default
    return _op


def _define(torch: Any) -> Any:
    library = torch.library.Library("vartrace", "DEF")
    library.define("summary(Tensor x, float? header=None) -> Tensor")
    library.impl("summary", cpu_summary, "CPU")
    library.impl("summary", _cuda_summary, "CUDA")
    library.impl("summary", eager_summary, "CompositeExplicitAutograd")
    register_fake = getattr(torch.library, "register_fake", None)  # torch 2.4
    if register_fake is None:
        library.impl("summary", _fake, "Meta")
    else:
        register_fake("vartrace::summary", _fake, lib=library)
    return library


def _fake(x: Any, header: float | None = None) -> Any:
    import torch

    return x.new_empty(11 if header is None else 12, dtype=torch.float64)


def summary(x: Any, header: float | None = None) -> Any:
    """The 11 float64 `SUMMARY_FIELDS` of tensor `x`
    on its device, by ONE dispatched op (`summary_op`); `header` (a statistics
    record's first element) before them, when given.

    Example:
        ```python
        summary(torch.tensor([1.0, float("nan"), 3.0]))[1]   # mean 2.0
        ```
    """
    return summary_op()(x, header)
