"""Built-in callbacks for the pipeline: stacking records and reducing chunks.

All of them follow the gather-callback signature ``callback(name, trace)``
and change the :class:`~vartrace.trace.Trace` in place.  Example::

    tracer = ModelTracer(model, ["layers.*.attn.forward.scores"],
                         post_gather_callbacks=[stack_padded_tensors])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vartrace.trace import Trace

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


def _as_tensors(name: str, values: Sequence[Any], *, one_dtype: bool = True) -> list[torch.Tensor]:
    """The records as tensors of their exact dtypes (Python numbers in 64 bits).

    Raises ``TypeError`` for a record that is not a number or a tensor, an int
    that does not fit int64, or (with ``one_dtype``) records of different
    dtypes: stacking would change their values silently.
    """
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif type(value) in _SCALAR_DTYPES:
            try:
                out.append(torch.tensor(value, dtype=_SCALAR_DTYPES[type(value)]))
            except (OverflowError, RuntimeError, ValueError) as error:
                raise TypeError(
                    f"site {name!r}: cannot stack the int {value:#x} exactly ({error})"
                ) from None
        else:
            raise TypeError(
                f"site {name!r}: cannot stack a {type(value).__name__} record; "
                "stacking needs tensors or numbers"
            )
    dtypes = {t.dtype for t in out}
    if one_dtype and len(dtypes) > 1:
        raise TypeError(
            f"site {name!r}: records have different dtypes "
            f"{sorted(str(d).removeprefix('torch.') for d in dtypes)}; stacking would "
            "convert some of them, so it is refused (convert them with a pre_save callback)"
        )
    return out


def stack_tensors(name: str, trace: Trace) -> None:
    """Stack equally shaped records into one tensor with a leading record dimension.

    Tags become 1-D int64 tensors.  Records of different shapes raise
    ``ValueError``: use :func:`stack_padded_tensors` for those.  Every record
    keeps its exact value: Python floats stack as float64, ints as int64, and
    records of different dtypes raise ``TypeError`` rather than being converted.
    """
    if isinstance(trace.values, torch.Tensor) or not len(trace):
        return
    tensors = _as_tensors(name, trace.values)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"site {name!r}: records have different shapes {sorted(shapes)}; "
            "use stack_padded_tensors to pad them"
        )
    trace.values = torch.stack(tensors)
    _tags(trace)


def pad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zero-pad ``tensor`` at the end of each dimension up to ``shape``."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    padding: list[int] = []
    for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True):
        padding += [0, want - have]
    return F.pad(tensor, padding)


def stack_padded_tensors(name: str, trace: Trace) -> None:
    """Stack records of different shapes, zero-padded to the largest in each dimension.

    ``trace.shapes`` keeps each record's true shape, so
    ``trace.values[i][tuple(slice(n) for n in trace.shapes[i])]`` is record ``i``.
    """
    if isinstance(trace.values, torch.Tensor) or not len(trace):
        return
    tensors = _as_tensors(name, trace.values)
    ranks = {t.dim() for t in tensors}
    if len(ranks) > 1:
        raise ValueError(
            f"site {name!r}: records have different numbers of dimensions {sorted(ranks)}"
        )
    shapes = [tuple(t.shape) for t in tensors]
    biggest = [max(sizes) for sizes in zip(*shapes, strict=True)] if shapes[0] else []
    trace.values = torch.stack([pad_to(t, biggest) for t in tensors])
    trace.shapes = shapes
    _tags(trace)


def _mean(values: list[Any]) -> torch.Tensor:
    tensors = _as_tensors("", values, one_dtype=False)
    return torch.stack([t.double() for t in tensors]).mean(dim=0)


def reduce_chunk(fn: Callable[[list[Any]], Any] = _mean) -> Callable[[str, Trace], None]:
    """A callback collapsing each rank's records in a chunk into one record.

    ``fn`` receives the list of one rank's record values and returns the
    reduced value (default: the element-wise mean over records, in
    float64).  The record keeps the last iteration and capture order of the
    ones it replaces.  Example (mean over records and the batch dimension)::

        mean_scores = reduce_chunk(lambda vs: torch.stack(vs).float().mean(dim=(0, 1)))
        ModelTracer(model, paths, pre_gather_callbacks=[mean_scores], gathering_interval=8)
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
