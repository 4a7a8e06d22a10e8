"""The statistics row of a dense real CPU tensor in one compiled pass (float32, bfloat16, ints...).

`summary.c` (beside this module) reads each value once: sums in float64 lanes, extremes
and zeros from the values as they are, read again masked only where they hold NaN or
infinities (float32 and bfloat16: from the chunk of 512 where they appear), or where
a block's plain sums would cancel (the numpy kernel's steps, `vartrace.statistics.kernels`).
It is built once per machine and Python, as an
extension module (`vartrace._support.native`), when a tracer in statistics mode starts
(`vartrace.statistics.rows.build_kernel`) or at first use; a call costs what a Python
function's does.  The build targets any x86-64: the AVX2 loops are chosen at run time.
Where it cannot be built (no compiler, no `Python.h`, no writable cache), `row` returns
`None` and the numpy kernel computes the same fields.

Example:
    ```python
    row(torch.randn(1000), None)   # 11 float64 fields, or None without a compiler
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numpy import empty as _empty

from vartrace._support.native import load

__all__ = ["available", "dense_row", "dense_summary", "row"]

_SOURCE = Path(__file__).with_name("summary.c")

_kernel: Any = None  # the C function once loaded; False where it cannot be built
_kinds: dict[Any, int] = {}  # torch dtype -> the kernel's kind, once torch is imported


def available() -> bool:
    """Whether the compiled kernel is built and loaded here (built by this call if not yet)."""
    return bool(_kernel if _kernel is not None else _load())


def row(x: Any, header: float | None, width: int) -> Any:
    """The summary row of CPU tensor `x` (`header` first, when given) as a float64
    tensor, in blocks of `width` values; `None` where the kernel does not read `x`
    (another dtype, not dense in row-major order, a subclass) or cannot be built."""
    kind = (_kinds or _as_kinds()).get(x.dtype)
    if kind is None or type(x) is not _tensor or not x.is_contiguous():
        return None
    kernel = _kernel if _kernel is not None else _load()
    if not kernel:
        return None
    out = _empty(11 if header is None else 12)  # (torch.empty: an aten op)
    kernel(x.data_ptr(), x.numel(), kind, width, out, header)
    return _from_numpy(out)


def dense_row(x: Any, header: float, width: int) -> Any:
    """`row` of a plain dense CPU tensor of more than one value, read with the fewest
    tensor attribute reads (a statistics record's common case); `None` for any other
    value (a subclass, a nested, sparse or other non-strided tensor, a scalar), and
    before `row` first read a tensor (`_tensor` is set then, torch imported)."""
    out = _empty(12)  # (torch.empty: an aten op)
    if dense_summary(x, header, width, out, None) is None:
        return None
    return _from_numpy(out)


def dense_summary(x: Any, header: float, width: int, out: Any, last: Any) -> bool | None:
    """`dense_row`'s fields of `x` into `out` (12 float64, a numpy array), and whether
    they equal `last`'s bit for bit (a previous `out`, or `None`: `False`); `None`, with
    `out` unwritten, where `dense_row` gives `None` (the same checks: a statistics
    record's path reads each once)."""
    if type(x) is not _tensor:
        return None
    kind = _kinds.get(x.dtype)
    if kind is None or not x.is_cpu or x.layout is not _strided or x.is_nested:
        return None
    count = x.numel()
    if count == 1 or not x.is_contiguous():
        return None
    kernel = _kernel if _kernel is not None else _load()
    if not kernel:
        return None
    return bool(kernel(x.data_ptr(), count, kind, width, out, header, last))


_tensor: Any = None
_from_numpy: Any = None
_strided: Any = None


def _as_kinds() -> dict[Any, int]:
    """The kernel's kinds of torch dtypes (and the torch names `row` uses), once."""
    global _tensor, _from_numpy, _strided
    import torch

    _tensor, _from_numpy, _strided = torch.Tensor, torch.from_numpy, torch.strided
    names = ("float32", "float64", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
    _kinds.update({getattr(torch, name): kind for kind, name in enumerate(names)})
    return _kinds


def _load() -> Any:
    """The kernel's function, built first where no build of this source is cached."""
    global _kernel
    module = load(_SOURCE, "vartrace_summary")
    kernel = False if module is None else module.summary
    if kernel:
        _kinds or _as_kinds()  # (dense_summary reads them: set before its first call)
    _kernel = kernel
    return _kernel
