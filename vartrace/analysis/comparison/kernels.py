"""Per-record statistics of two equally shaped stacks of records.

For each record (row) of two stacks `a` and `b`: the sums of a, b, a*a,
b*b and a*b in float64 from exact products of the inputs (giving mean, std,
var and cosine similarity), the largest absolute and relative difference,
and whether `|a - b| <= atol + rtol * |b|` holds elementwise, NaN equal to
NaN at the same place.  Rows are reduced in groups, and long records in
column slices, through per-thread scratch buffers; a group whose bits are
equal on both sides (a run against its own copy, every record before two
runs diverge) is compared by one `memcmp` and summed on one side.

Entry points for the engine: `numeric_stats` (two stacks -> the
report's statistics columns), and for blocks cut in pieces
`block_partial` per piece, `concatenate` to join them and
`finish` to turn the sums into columns.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from vartrace._support.memory import memcmp

#: Elements reduced per group of rows: enough rows to amortise the per-call
#: cost of numpy on small records, few enough that the group and its float64
#: copy stay in a core's L2 cache (float32: 256 KiB a side, 512 KiB a side in float64).
_STEP_ELEMENTS = 1 << 16


def _work_dtype(a: np.dtype, b: np.dtype) -> np.dtype:
    kinds = {a.kind, b.kind}
    if "c" in kinds:
        return np.dtype(np.complex128)
    if a == b and a in (np.float32, np.float64):
        return a
    if kinds <= {"f"} and max(a.itemsize, b.itemsize) <= 4:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


#: Dot products are taken in pieces of at most this many elements: OpenBLAS runs
#: shorter dots on the calling thread, and a dot spread over threads stalls badly
#: when the cores are busy (an assumption about BLAS, so only a speed matter).
_DOT_PIECE = 8192
#: Records longer than this many elements are reduced in column slices, so the
#: scratch memory stays bounded whatever the record size.
_COLUMNS = 1 << 20


class _Scratch:
    """Buffers reused across the row groups of one block (no allocation per record).

    `wide` holds the float64 copies of `a` and `b` padded with zeros to
    a whole number of dot pieces.
    """

    def __init__(self, rows: int, m: int, dtype: np.dtype) -> None:
        self.rows = rows
        self.piece = min(m, _DOT_PIECE)
        padded = -(-m // self.piece) * self.piece
        self.wide = np.zeros((2, rows, padded))
        self.ones = np.ones(self.piece)
        self.diff = np.empty((rows, m), dtype)
        self.other = np.empty((rows, m), dtype)
        self.rel = np.empty((rows, m), dtype)
        self.equal = np.empty((rows, m), bool)
        self.aligned: np.ndarray | None = None  # copies of unaligned inputs, made when needed

    def align(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`a` and `b`, copied here if unaligned (a memory-mapped record at an odd offset):
        one copy, where numpy would copy them through its buffer in every pass."""
        if a.flags.aligned and b.flags.aligned:
            return a, b
        rows, m = a.shape
        if self.aligned is None:
            self.aligned = np.empty((2, self.rows, self.diff.shape[1]), self.diff.dtype)
        x, y = self.aligned[0, :rows, :m], self.aligned[1, :rows, :m]
        x[...], y[...] = a, b
        return x, y


_THREAD_SCRATCH = threading.local()


def _scratch(rows: int, m: int, dtype: np.dtype) -> _Scratch:
    """This thread's scratch buffers for `rows` rows of (m, dtype), kept from its last block."""
    cached = getattr(_THREAD_SCRATCH, "value", None)
    if cached is None or cached[0] != (m, dtype) or cached[1].rows < rows:
        cached = ((m, dtype), _Scratch(rows, m, dtype))
        _THREAD_SCRATCH.value = cached
    return cached[1]


def _piecewise_dot(x: np.ndarray, y: np.ndarray, piece: int) -> np.ndarray:
    """Row-wise dot products of (k, padded) float64 arrays, summed over pieces."""
    k = x.shape[0]
    xs = x.reshape(k, -1, 1, piece)
    ys = y.reshape(k, -1, piece, 1)
    return np.matmul(xs, ys).reshape(k, -1).sum(axis=1)


def _power_sums(
    a: np.ndarray, b: np.ndarray, scratch: _Scratch, same: bool = False
) -> tuple[np.ndarray, ...]:
    """Per row, in float64 (exact products of the inputs): sums of a, b, a*a, b*b, a*b.

    `same` says every row of `a` equals that of `b`: b's sums are then a's.
    """
    rows, m = a.shape
    if m < 512:
        a64 = a.astype(np.float64, copy=False)
        sa, saa = a64.sum(axis=1), np.einsum("ij,ij->i", a64, a64)
        if same:
            return sa, sa, saa, saa, saa
        b64 = b.astype(np.float64, copy=False)
        sb, sbb = b64.sum(axis=1), np.einsum("ij,ij->i", b64, b64)
        return sa, sb, saa, sbb, np.einsum("ij,ij->i", a64, b64)
    sides = 1 if same else 2
    wide = scratch.wide[:sides, :rows]
    wide[0, :, :m] = a
    if not same:
        wide[1, :, :m] = b
    if m < wide.shape[2]:  # a last, narrower column slice: clear what an earlier one left
        wide[:, :, m:] = 0.0
    piece = scratch.piece
    sums = np.matmul(wide.reshape(sides, rows, -1, piece), scratch.ones)
    sums = sums.reshape(sides, rows, -1).sum(axis=2)
    x = wide[0]
    saa = _piecewise_dot(x, x, piece)
    if same:
        return sums[0], sums[0], saa, saa, saa
    y = wide[1]
    return sums[0], sums[1], saa, _piecewise_dot(y, y, piece), _piecewise_dot(x, y, piece)


class Partial(NamedTuple):
    """What a slice of columns contributes to each row's statistics.

    The sums are over finite values only (as every vartrace statistic), and
    `finite` counts them: (2, rows), for a and b.
    """

    sums: tuple[np.ndarray, ...]  # sum a, sum b, sum a*a, sum b*b, sum a*b (float64)
    max_abs: np.ndarray
    max_rel: np.ndarray
    close: np.ndarray
    finite: np.ndarray


def _combine(left: Partial, right: Partial) -> Partial:
    """The contribution of two column slices of the same rows."""
    return Partial(
        tuple(x + y for x, y in zip(left.sums, right.sums, strict=True)),
        np.maximum(left.max_abs, right.max_abs),  # a NaN (a NaN met a number) stays
        np.maximum(left.max_rel, right.max_rel),
        left.close & right.close,
        left.finite + right.finite,
    )


def _finite_sums(a: np.ndarray, b: np.ndarray, partial: Partial) -> Partial:
    """`partial` with the sums of rows holding non-finite values taken over finite ones.

    Only rows whose sums came out non-finite are read again, so blocks of finite
    values cost nothing more.
    """
    if np.isfinite(sum(partial.sums)).all():  # (sums past float64's range: looked at below)
        return partial
    sums = np.stack(partial.sums)
    rows = np.flatnonzero(~np.isfinite(sums).all(axis=0))
    if not len(rows):
        return partial
    sums, finite = sums.copy(), partial.finite.copy()
    for i in rows:
        keep_a, keep_b = np.isfinite(a[i]), np.isfinite(b[i])
        za = np.where(keep_a, a[i], 0.0).astype(np.float64)
        zb = np.where(keep_b, b[i], 0.0).astype(np.float64)
        sums[:, i] = (za.sum(), zb.sum(), za @ za, zb @ zb, za @ zb)
        finite[:, i] = keep_a.sum(), keep_b.sum()
    return partial._replace(sums=tuple(sums), finite=finite)


def numeric_stats(
    block_a: np.ndarray, block_b: np.ndarray, atol: float, rtol: float
) -> dict[str, np.ndarray]:
    """Per-record statistics of two equally shaped stacks of records."""
    m = int(np.prod(block_a.shape[1:], dtype=np.int64))
    return finish(m, block_partial(block_a, block_b, atol, rtol))


def block_partial(block_a: np.ndarray, block_b: np.ndarray, atol: float, rtol: float) -> Partial:
    """Row sums, largest differences and closeness of two equally shaped stacks of records."""
    k = block_a.shape[0]
    m = int(np.prod(block_a.shape[1:], dtype=np.int64))
    work = _work_dtype(block_a.dtype, block_b.dtype)
    a2 = block_a.reshape(k, m).astype(work, copy=False)
    b2 = block_b.reshape(k, m).astype(work, copy=False)
    if m == 0:
        zeros = np.zeros(k)
        return Partial((zeros,) * 5, zeros, zeros, np.ones(k, dtype=bool), np.zeros((2, k)))
    width = min(m, _COLUMNS)
    step = max(1, _STEP_ELEMENTS // width)
    scratch = _scratch(min(step, k), width, work)
    partial_of = _complex_partial if work.kind == "c" else _real_partial
    groups = []
    with np.errstate(all="ignore"):
        for start in range(0, k, step):
            rows = slice(start, min(k, start + step))
            x, y = scratch.align(a2[rows, :width], b2[rows, :width])
            partial = partial_of(x, y, atol, rtol, scratch)
            for first in range(width, m, width):
                columns = slice(first, min(m, first + width))
                x, y = scratch.align(a2[rows, columns], b2[rows, columns])
                partial = _combine(partial, partial_of(x, y, atol, rtol, scratch))
            groups.append(partial)
    partial = groups[0] if len(groups) == 1 else concatenate(groups)
    if block_a.dtype.kind in "iu" and block_b.dtype.kind in "iu":
        # float64 cannot tell integers above 2**53 apart: check equality exactly.
        same = np.all(block_a.reshape(k, m) == block_b.reshape(k, m), axis=1)
        partial.close[(partial.max_abs == 0) & ~same] = False
    return partial


def concatenate(parts: list[Partial]) -> Partial:
    """The partials of consecutive row groups as one."""
    return Partial(
        tuple(np.concatenate(column) for column in zip(*(p.sums for p in parts), strict=True)),
        np.concatenate([p.max_abs for p in parts]),
        np.concatenate([p.max_rel for p in parts]),
        np.concatenate([p.close for p in parts]),
        np.concatenate([p.finite for p in parts], axis=1),
    )


def finish(m: int, partial: Partial) -> dict[str, np.ndarray]:
    """Turn the row sums of `partial` (records of `m` elements) into the report's columns.

    Means, variances and standard deviations are those of the finite values.
    """
    sa, sb, saa, sbb, sab = partial.sums
    out: dict[str, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for side, s, ss, count in (
            ("a", sa, saa, partial.finite[0]),
            ("b", sb, sbb, partial.finite[1]),
        ):
            mean = s / count
            var = np.maximum(ss / count - mean * mean, 0.0)
            out[f"mean_{side}"] = mean
            out[f"var_{side}"] = var
            out[f"std_{side}"] = np.sqrt(var)
        norm = np.sqrt(saa * sbb)
        norm = np.where(np.isfinite(norm), norm, np.sqrt(saa) * np.sqrt(sbb))
        cos = np.clip(sab / np.where(norm > 0, norm, 1.0), -1.0, 1.0)
    zero_a, zero_b = saa == 0, sbb == 0
    cos = np.where(zero_a & zero_b, 1.0, cos)
    cos = np.where(zero_a ^ zero_b, 0.0, cos)
    out["cosine"] = np.where(partial.max_abs == 0, 1.0, cos)
    out["max_abs_diff"] = np.asarray(partial.max_abs, dtype=np.float64)
    out["max_rel_diff"] = np.asarray(partial.max_rel, dtype=np.float64)
    out["allclose"] = partial.close.astype(np.float64)
    return out


def _same_bits(a: np.ndarray, b: np.ndarray, scratch: _Scratch) -> bool:
    """Whether `a` and `b` (of one dtype) hold the same bits: equal values, NaN where NaN."""
    if memcmp is not None and a.flags.c_contiguous and b.flags.c_contiguous:
        return memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0  # no array of booleans
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    rows, m = a.shape
    equal = np.equal(a.view(unsigned), b.view(unsigned), out=scratch.equal[:rows, :m])
    return bool(equal.all())


def _real_partial(
    a: np.ndarray, b: np.ndarray, atol: float, rtol: float, scratch: _Scratch
) -> Partial:
    """Row contributions of real columns `a`, `b` of shape (k, width), float32 or float64."""
    rows, m = a.shape
    finite = np.full((2, rows), float(m))
    if _same_bits(a, b, scratch):  # no arithmetic on the differences: they are all zero
        zeros = np.zeros(rows)
        same = Partial(
            _power_sums(a, b, scratch, same=True), zeros, zeros, np.ones(rows, bool), finite
        )
        return _finite_sums(a, b, same)
    diff = np.subtract(a, b, out=scratch.diff[:rows, :m])
    np.abs(diff, out=diff)
    max_abs = diff.max(axis=1)
    sums = _power_sums(a, b, scratch)
    absb = np.abs(b, out=scratch.other[:rows, :m])
    rel = np.divide(diff, absb, out=scratch.rel[:rows, :m])  # 0/0 -> NaN, which fmax skips
    max_rel = np.where(max_abs == 0, 0.0, np.fmax.reduce(rel, axis=1))
    close = (max_abs <= atol) | (max_rel <= rtol)
    for i in np.flatnonzero(~close & ~np.isnan(max_abs)):
        # |a - b| <= atol + rtol * |b| elementwise: max(|a - b| - rtol * |b|) <= atol
        excess = np.multiply(absb[i], -rtol, out=rel[i])
        excess += diff[i]
        close[i] = excess.max() <= atol
    for i in np.flatnonzero(np.isnan(max_abs)):
        row_a, row_b = a[i].astype(np.float64), b[i].astype(np.float64)
        max_abs[i], max_rel[i], close[i] = _nonfinite_row(row_a, row_b, atol, rtol)
    return _finite_sums(a, b, Partial(sums, max_abs, max_rel, close, finite))


def _nonfinite_row(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[float, ...]:
    """Differences of one record holding NaN/inf: NaN == NaN and inf == inf count as equal."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    absb = np.abs(b)
    rel = np.where(same, 0.0, diff / absb)
    close = bool(np.all(same | (diff <= atol + rtol * absb)))
    return float(np.max(diff)), float(np.max(rel)), close


def _complex_partial(
    a: np.ndarray, b: np.ndarray, atol: float, rtol: float, scratch: _Scratch
) -> Partial:
    """Complex columns: differences on the complex values, statistics of the magnitudes."""
    mag_a, mag_b = np.abs(a), np.abs(b)
    sums = _power_sums(mag_a, mag_b, scratch)
    sab = np.real(np.einsum("ij,ij->i", np.conj(a), b))
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    rel = np.where(same, 0.0, diff / mag_b)
    close = np.all(same | (diff <= atol + rtol * mag_b), axis=1)
    finite = np.full((2, len(a)), float(a.shape[1]))
    return Partial((*sums[:4], sab), diff.max(axis=1), rel.max(axis=1), close, finite)
