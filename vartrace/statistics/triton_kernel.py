"""The statistics row of one tensor on a CUDA device: two Triton kernels, one read of it.

`summary` launches `_partials` (one program per span of the tensor: its
values upcast to float64 in registers; per tile of `_BLOCK` a two-pass ``(n, mean,
M2)``, merged by Chan's formula with the means taken relative to the record's first value,
so a large mean with a tiny spread keeps its digits; min, max and the NaN, +inf, -inf and
zero counts) and `_finish` (one program: the spans' partials merged into the 11
fields of `SUMMARY_FIELDS`).  No float64 copy of the
input is made; the device holds 10 float64 per span (at most `_SPANS` spans).

Importing this module needs `triton`.  With `TRITON_INTERPRET=1` set before the import
the kernels run on CPU tensors in Triton's interpreter (how the tests check them).

Example:
    ```python
    row = summary(torch.randn(4096, device="cuda"))   # 11 float64 on the device
    ```
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped,import-not-found]
import triton.language as tl  # type: ignore[import-untyped,import-not-found]

__all__ = ["DTYPES", "summary"]

_BLOCK = 1024  # elements of one tile (one masked load per program and iteration)
_SPANS = 1024  # most programs of the first launch; longer tensors give each more tiles
_TILE = 1024  # partials merged per iteration of the finishing program
_FIELDS = 10  # per span: n, sum, M2, mean - shift, min, max, nan, posinf, neginf, zeros

# A kernel's globals must equal themselves: each launch checks they did not change since
# the compile (`!=`), so a NaN global fails every launch on a GPU.  NaN is made in-kernel.
_INF: tl.constexpr = tl.constexpr(float("inf"))

#: Dtypes loaded as they are (upcast in registers); 1-byte floats are decoded by a table.
DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


@triton.jit
def _load(x_ptr, table_ptr, offsets, inside, DECODE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Values at `offsets` as float64 (1-byte floats decoded by their table)."""
    raw = tl.load(x_ptr + offsets, mask=inside, other=0)
    if DECODE:
        return tl.load(table_ptr + raw.to(tl.int32), mask=inside, other=0.0)
    return raw.to(tl.float64)


@triton.jit
def _partials(  # type: ignore[no-untyped-def]
    x_ptr, table_ptr, part_ptr, size, tiles, BLOCK: tl.constexpr, DECODE: tl.constexpr
):
    """Program `p` reduces tiles `p * tiles ...` of the flat input into 10 float64: count,
    sum, M2 and mean minus the shift (the first value when finite) of its finite values,
    min, max, and its NaN, +inf, -inf and zero counts."""
    first = _load(x_ptr, table_ptr, tl.arange(0, 1), tl.arange(0, 1) < size, DECODE)
    shift = tl.sum(tl.where((first == first) & (tl.abs(first) != _INF), first, 0.0), 0)
    span = tl.program_id(0).to(tl.int64) * tiles * BLOCK
    n = tl.zeros([], tl.float64)
    s = tl.zeros([], tl.float64)
    q = tl.zeros([], tl.float64)
    offset = tl.zeros([], tl.float64)
    low = tl.full([BLOCK], _INF, tl.float64)
    high = tl.full([BLOCK], -_INF, tl.float64)
    nan = tl.zeros([BLOCK], tl.int32)
    posinf = tl.zeros([BLOCK], tl.int32)
    neginf = tl.zeros([BLOCK], tl.int32)
    zeros = tl.zeros([BLOCK], tl.int32)
    for tile in range(tiles):
        offsets = span + tile * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < size
        x = _load(x_ptr, table_ptr, offsets, inside, DECODE)
        finite = inside & (x == x) & (tl.abs(x) != _INF)
        # the tile: two-pass centred sum of squares; its mean refined by the centred sum
        tile_n = tl.sum(finite.to(tl.float64), 0)
        tile_s = tl.sum(tl.where(finite, x, 0.0), 0)
        mean = tile_s / tl.maximum(tile_n, 1.0)
        centred = tl.where(finite, x - mean, 0.0)
        tile_q = tl.sum(centred * centred, 0)
        tile_m = (mean - shift) + tl.sum(centred, 0) / tl.maximum(tile_n, 1.0)
        # Chan's merge of (n, mean, M2), means relative to the shift
        merged = n + tile_n
        delta = tl.where(tile_n > 0, tile_m - offset, 0.0)
        q += tile_q + delta * delta * (n * tile_n / tl.maximum(merged, 1.0))
        offset += delta * (tile_n / tl.maximum(merged, 1.0))
        n = merged
        s += tile_s
        low = tl.minimum(low, tl.where(finite, x, _INF))
        high = tl.maximum(high, tl.where(finite, x, -_INF))
        nan += (inside & (x != x)).to(tl.int32)
        posinf += (x == _INF).to(tl.int32)
        neginf += (x == -_INF).to(tl.int32)
        zeros += (inside & (x == 0)).to(tl.int32)
    out = part_ptr + tl.program_id(0).to(tl.int64) * 10
    tl.store(out, n)
    tl.store(out + 1, s)
    tl.store(out + 2, q)
    tl.store(out + 3, offset)
    tl.store(out + 4, tl.min(low, 0))
    tl.store(out + 5, tl.max(high, 0))
    tl.store(out + 6, tl.sum(nan.to(tl.float64), 0))
    tl.store(out + 7, tl.sum(posinf.to(tl.float64), 0))
    tl.store(out + 8, tl.sum(neginf.to(tl.float64), 0))
    tl.store(out + 9, tl.sum(zeros.to(tl.float64), 0))


@triton.jit(do_not_specialize=["size"])  # a size of 1 would become a constant: no .to()
def _finish(part_ptr, out_ptr, spans, size, header, TILE: tl.constexpr, FIRST: tl.constexpr):  # type: ignore[no-untyped-def]
    """One program: the spans' partials merged into the 11 summary fields, written from
    `out_ptr + FIRST` (`header` at `out_ptr` when FIRST is 1).  A tile of partials:
    M2 is theirs plus n (mean - tile mean)^2 (two passes, in registers); tiles then merge
    by Chan's formula."""
    n = tl.zeros([], tl.float64)
    s = tl.zeros([], tl.float64)
    q = tl.zeros([], tl.float64)
    offset = tl.zeros([], tl.float64)
    low = tl.full([], _INF, tl.float64)
    high = tl.full([], -_INF, tl.float64)
    nan = tl.zeros([], tl.float64)
    posinf = tl.zeros([], tl.float64)
    neginf = tl.zeros([], tl.float64)
    zeros = tl.zeros([], tl.float64)
    for start in range(0, spans, TILE):
        rows = start + tl.arange(0, TILE)
        kept = rows < spans
        at = part_ptr + rows * 10
        counts = tl.load(at, mask=kept, other=0.0)
        means = tl.load(at + 3, mask=kept, other=0.0)
        tile_n = tl.sum(counts, 0)
        tile_m = tl.sum(counts * means, 0) / tl.maximum(tile_n, 1.0)
        apart = tl.where(counts > 0, means - tile_m, 0.0)
        tile_q = tl.sum(tl.load(at + 2, mask=kept, other=0.0) + counts * apart * apart, 0)
        merged = n + tile_n
        delta = tl.where(tile_n > 0, tile_m - offset, 0.0)
        q += tile_q + delta * delta * (n * tile_n / tl.maximum(merged, 1.0))
        offset += delta * (tile_n / tl.maximum(merged, 1.0))
        n = merged
        s += tl.sum(tl.load(at + 1, mask=kept, other=0.0), 0)
        low = tl.minimum(low, tl.min(tl.load(at + 4, mask=kept, other=_INF), 0))
        high = tl.maximum(high, tl.max(tl.load(at + 5, mask=kept, other=-_INF), 0))
        nan += tl.sum(tl.load(at + 6, mask=kept, other=0.0), 0)
        posinf += tl.sum(tl.load(at + 7, mask=kept, other=0.0), 0)
        neginf += tl.sum(tl.load(at + 8, mask=kept, other=0.0), 0)
        zeros += tl.sum(tl.load(at + 9, mask=kept, other=0.0), 0)
    has = n > 0
    missing = tl.full([], _INF, tl.float64) - _INF  # NaN: min, max and absmax of no values
    mean = s / n
    var = q / n
    if FIRST:
        tl.store(out_ptr, header.to(tl.float64))
    out_ptr += FIRST
    tl.store(out_ptr, size.to(tl.float64))
    tl.store(out_ptr + 1, mean)
    tl.store(out_ptr + 2, tl.sqrt(var))
    tl.store(out_ptr + 3, tl.where(has, low, missing))
    tl.store(out_ptr + 4, tl.where(has, high, missing))
    tl.store(out_ptr + 5, tl.where(has, tl.maximum(-low, high), missing))
    tl.store(out_ptr + 6, tl.where(has, tl.sqrt(n * (var + mean * mean)), 0.0))
    tl.store(out_ptr + 7, nan)
    tl.store(out_ptr + 8, posinf)
    tl.store(out_ptr + 9, neginf)
    tl.store(out_ptr + 10, zeros)


_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 256 values of a 1-byte float dtype as float64 on `device` (made once)."""
    table = _tables.get((dtype, device))
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        host = codes.view(dtype).to(torch.float64)
        table = _tables[dtype, device] = host.to(device)
    return table


def summary(x: torch.Tensor, header: float | None = None) -> torch.Tensor:
    """The 11 float64 `SUMMARY_FIELDS` of `x` (real:
    a dtype of `DTYPES` or a 1-byte float) on its device, `header` first when given:
    two launches."""
    flat = x.reshape(-1)
    size = flat.numel()
    decode = flat.element_size() == 1 and flat.is_floating_point()
    table: Any = flat
    if decode:
        table, flat = _table(flat.dtype, flat.device), flat.view(torch.uint8)
    blocks = max(1, triton.cdiv(size, _BLOCK))
    tiles = triton.cdiv(blocks, _SPANS)
    spans = triton.cdiv(blocks, tiles)
    partials = torch.empty((spans, _FIELDS), dtype=torch.float64, device=flat.device)
    first = 0 if header is None else 1
    out = torch.empty(11 + first, dtype=torch.float64, device=flat.device)
    # No fused multiply-adds: the IEEE operations of the definition (and no warning from
    # Triton 3.9 asking for the choice, which -W error would raise in the training step)
    options = {"enable_fp_fusion": False}
    _partials[(spans,)](flat, table, partials, size, tiles, BLOCK=_BLOCK, DECODE=decode, **options)
    _finish[(1,)](
        partials, out, spans, size, 0.0 if header is None else header,
        TILE=_TILE, FIRST=first, **options,
    )  # fmt: skip
    return out
