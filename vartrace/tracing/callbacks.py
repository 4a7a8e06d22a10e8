"""Built-in callbacks for the pipeline: stacking records and reducing chunks.

All of them follow the gather-callback signature `callback(name, trace)`
and change the [`Trace`][vartrace.Trace] in place.  Example:

```python
tracer = ModelTracer(model, ["layers.*.attn.forward.scores"],
                     post_gather_callbacks=[stack_padded_tensors])
```
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vartrace._support.warnings import warn
from vartrace.trace import RunContext, Trace

__all__ = ["pad_to", "reduce_chunk", "stack_padded_tensors", "stack_tensors"]


def _tags(trace: Trace) -> None:
    for field in ("iterations", "ranks", "order"):
        tags = getattr(trace, field)
        if not isinstance(tags, torch.Tensor):
            setattr(trace, field, torch.as_tensor(list(tags), dtype=torch.int64))


_SCALAR_DTYPES = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
    complex: torch.complex128,
}


class _Unstackable(TypeError):
    """Why the records of a chunk cannot be stacked without changing a value."""


def _tensor(value: Any) -> torch.Tensor:
    """`value` as a tensor of its exact dtype (Python numbers in 64 bits)."""
    if isinstance(value, torch.Tensor):
        return value
    if type(value) not in _SCALAR_DTYPES:
        raise _Unstackable(
            f"cannot stack a {type(value).__name__} record; stacking needs tensors or numbers"
        )
    try:
        return torch.tensor(value, dtype=_SCALAR_DTYPES[type(value)])
    except (OverflowError, RuntimeError, ValueError) as error:
        raise _Unstackable(f"cannot stack the int {value:#x} exactly ({error})") from None


def _exact_in(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of `tensor` survives a round trip through `dtype`."""
    if tensor.dtype == dtype:
        return True
    back = tensor.to(dtype).to(tensor.dtype)
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.equal(back, tensor)
    nan = torch.isnan(tensor)
    return torch.equal(torch.isnan(back), nan) and torch.equal(back[~nan], tensor[~nan])


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype that holds every record exactly: the promoted one, else its 64-bit kind
    (bfloat16 + float32 -> float32; int64 + float32 -> float64 when the ints fit)."""
    dtypes = {t.dtype for t in tensors}
    promoted = functools.reduce(torch.promote_types, dtypes)
    if len(dtypes) == 1:
        return promoted
    candidates = [promoted]
    if promoted.is_floating_point and promoted != torch.float64:
        candidates.append(torch.float64)
    elif promoted.is_complex and promoted != torch.complex128:
        candidates.append(torch.complex128)
    for dtype in candidates:
        if all(_exact_in(t, dtype) for t in tensors):
            return dtype
    names = sorted(str(d).removeprefix("torch.") for d in dtypes)
    raise _Unstackable(f"no dtype holds every value of its records of dtypes {names}")


_GatherCallback = Callable[[str, Trace], None]


def _as_tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    """The records as tensors of one dtype that holds each exactly, else `_Unstackable`."""
    tensors = [_tensor(value) for value in values]
    dtype = _common_dtype(tensors)
    return [t.to(dtype) for t in tensors]


# (callback, site) pairs warned about in the current run: a callback's on_start (called by
# each tracer as it starts) forgets its own pairs, so that every run warns once per site.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()  # gathers run on staging threads too


def _once_per_run(callback: _GatherCallback) -> _GatherCallback:
    """Give a stacking callback an `on_start`: each tracer's start begins a new run, in
    which the callback warns once per site again (not once per process)."""
    name = callback.__name__

    def on_start(context: RunContext) -> None:
        with _warned_lock:
            _warned.difference_update([key for key in _warned if key[0] == name])

    callback.on_start = on_start  # type: ignore[attr-defined]
    return callback


def _unstacked(callback: str, name: str, why: Exception) -> None:
    """Warn, once per callback, site and run, that a chunk stays a list of records."""
    with _warned_lock:
        first = (callback, name) not in _warned
        _warned.add((callback, name))
    if first:
        warn(
            f"vartrace: {callback} leaves the records of site {name!r} unstacked (a list): {why}",
            RuntimeWarning,
            stacklevel=3,
        )


@_once_per_run
def stack_tensors(name: str, trace: Trace) -> None:
    """Stack equally shaped records into one tensor with a leading record dimension.

    Tags become 1-D int64 tensors.  Every record keeps its exact value: Python
    floats stack as float64, ints as int64; records of different dtypes stack in
    the dtype that holds them all exactly (bfloat16 + float32 as float32, int64 +
    float32 as float64 when the ints fit).  A chunk that cannot be stacked so
    (different shapes: use [`stack_padded_tensors`][vartrace.stack_padded_tensors]; values
    no dtype holds; records that are not numbers) stays a list, with one warning per site and
    tracer run.
    """
    if isinstance(trace.values, torch.Tensor) or not len(trace):
        return
    try:
        tensors = _as_tensors(trace.values)
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise _Unstackable(
                f"records have different shapes {sorted(shapes)}; stack_padded_tensors pads them"
            )
    except _Unstackable as why:
        _unstacked("stack_tensors", name, why)
        return
    trace.values = torch.stack(tensors)
    _tags(trace)


def pad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zero-pad `tensor` at the end of each dimension up to `shape`."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    padding: list[int] = []
    for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True):
        padding += [0, want - have]
    return F.pad(tensor, padding)


@_once_per_run
def stack_padded_tensors(name: str, trace: Trace) -> None:
    """Stack records of different shapes, zero-padded to the largest in each dimension.

    `trace.shapes` keeps each record's true shape, so
    `trace.values[i][tuple(slice(n) for n in trace.shapes[i])]` is record `i`.
    Dtypes are handled as by [`stack_tensors`][vartrace.stack_tensors]; records with different
    numbers of dimensions stay a list, with one warning per site and tracer run.
    """
    if isinstance(trace.values, torch.Tensor) or not len(trace):
        return
    try:
        tensors = _as_tensors(trace.values)
        ranks = {t.dim() for t in tensors}
        if len(ranks) > 1:
            raise _Unstackable(f"records have different numbers of dimensions {sorted(ranks)}")
    except _Unstackable as why:
        _unstacked("stack_padded_tensors", name, why)
        return
    shapes = [tuple(t.shape) for t in tensors]
    biggest = [max(sizes) for sizes in zip(*shapes, strict=True)] if shapes[0] else []
    trace.values = torch.stack([pad_to(t, biggest) for t in tensors])
    trace.shapes = shapes
    _tags(trace)


def _mean(values: list[Any]) -> torch.Tensor:
    return torch.stack([_tensor(value).double() for value in values]).mean(dim=0)


def reduce_chunk(fn: Callable[[list[Any]], Any] = _mean) -> Callable[[str, Trace], None]:
    """A callback collapsing each rank's records in a chunk into one record.

    `fn` receives the list of one rank's record values and returns the
    reduced value (default: the element-wise mean over records, in
    float64).  The record keeps the last iteration and capture order of the
    ones it replaces.  Example (mean over records and the batch dimension):

    ```python
    mean_scores = reduce_chunk(lambda vs: torch.stack(vs).float().mean(dim=(0, 1)))
    ModelTracer(model, paths, pre_gather_callbacks=[mean_scores], gathering_interval=8)
    ```
    """

    def reduce_records(name: str, trace: Trace) -> None:
        if not len(trace):
            return
        groups: dict[int, list[int]] = {}
        for index, rank in enumerate(trace.ranks):
            groups.setdefault(int(rank), []).append(index)
        reduced = Trace()
        for rank, indices in groups.items():
            last = indices[-1]
            reduced.append(
                fn([trace.values[i] for i in indices]),
                int(trace.iterations[last]),
                rank,
                int(trace.order[last]),
            )
        trace.values, trace.iterations = reduced.values, reduced.iterations
        trace.ranks, trace.order, trace.shapes = reduced.ranks, reduced.order, None

    return reduce_records
