"""What a site's records were made from, where they are not the values themselves: the
values a pre-save callback replaced.

Statistics mode ([`stats`][vartrace.stats]) turns each tensor into a row of numbers: the
row alone no longer says whether the tensor was `bfloat16` or `float32`, nor its shape.
The tracer notes, per site, the dtype and shape of the values a pre-save callback
replaced, and hands what changed to the results and to the post-gather callbacks that
have a `reduced` method (the HDF5 saver keeps them as attributes of the site), at each
gather before the records.

One description covers every record of a site: the dtypes seen, in order of first
appearance, and the shape, with -1 on each axis whose size differed between records
(a variable sequence length reads `(8, -1, 768)`).

The placements of `DTensor` records, a fact of the same kind that travels the same way, are
`vartrace.placements`'s.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["ReducedFrom", "Reductions"]


class ReducedFrom(NamedTuple):
    """The values a site's records were made from by a pre-save callback.

    `dtype`: their dtype name (`"bfloat16"`), or several joined by `"|"` in order of
    first appearance (`"float32|bfloat16"`); `shape`: their shape, -1 on the axes whose
    size differed, `None` when their number of axes differed.

    Example:
        ```python
        run["blocks.0.forward"].reduced_from   # ReducedFrom(dtype='bfloat16', shape=(8, -1, 768))
        ```
    """

    dtype: str
    shape: tuple[int, ...] | None

    def merged(self, other: ReducedFrom) -> ReducedFrom:
        """This description widened to cover the values `other` describes too."""
        mine = self.dtype.split("|")
        dtype = "|".join([*mine, *(name for name in other.dtype.split("|") if name not in mine)])
        if self.shape is None or other.shape is None or len(self.shape) != len(other.shape):
            return ReducedFrom(dtype, None)
        sizes = zip(self.shape, other.shape, strict=True)
        return ReducedFrom(dtype, tuple(a if a == b else -1 for a, b in sizes))

    @property
    def shape_text(self) -> str:
        """The shape as `vartrace ls` shows it: `(8, *, 768)`, `*` where sizes differed."""
        if self.shape is None:
            return "(ndim differed)"
        sizes = ", ".join("*" if size < 0 else str(size) for size in self.shape)
        return f"({sizes}{',' if len(self.shape) == 1 else ''})"

    def __str__(self) -> str:
        """`bfloat16 (8, *, 768)`."""
        return f"{self.dtype} {self.shape_text}"


def _dtype_name(dtype: Any) -> str:
    """`torch.bfloat16` and `numpy.dtype('float32')` as `"bfloat16"`, `"float32"`."""
    return str(dtype).removeprefix("torch.")


def _sizes(value: Any) -> tuple[int, ...] | None:
    """`value`'s shape, -1 on an axis without one size (a nested tensor's ragged axes);
    `None` when it cannot tell its axes."""
    try:
        return tuple(int(size) for size in value.shape)
    except Exception:  # a nested tensor has no one shape
        pass
    try:
        axes = range(value.dim())
    except Exception:
        return None
    sizes = []
    for axis in axes:
        try:
            sizes.append(int(value.size(axis)))
        except Exception:  # ragged
            sizes.append(-1)
    return tuple(sizes)


class Reductions:
    """The descriptions of one tracer's replaced values, site by site.

    The capture side calls `note` with each value a pre-save callback replaced; the
    tracer hands `taken()` to its sinks at each gather.

    Example:
        ```python
        reductions = Reductions()
        reductions.note("head.forward", torch.zeros(8, 16, dtype=torch.bfloat16))
        reductions.taken()  # [("head.forward", ReducedFrom("bfloat16", (8, 16)))]
        ```
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, Any]] = {}  # site -> the last (dtype, shape) noted
        self._described: dict[str, ReducedFrom] = {}
        self._changed: dict[str, None] = {}  # sites described anew since the last `taken`
        self._lock = threading.Lock()

    def note(self, site: str, value: Any) -> None:
        """Note that a pre-save callback replaced `value` (a tensor or an array) at `site`.

        A nested tensor's ragged axes read -1, as axes whose size differed do."""
        dtype = value.dtype
        try:
            shape = value.shape
        except Exception:  # a strided nested tensor has no one shape: described each time
            shape = None
        last = self._last.get(site)
        if shape is not None and last is not None and last[0] == dtype and last[1] == shape:
            return  # the common case, record after record: as before
        with self._lock:
            self._last[site] = (dtype, shape)
            described = ReducedFrom(_dtype_name(dtype), _sizes(value))
            if self._widen(site, described):
                self._changed[site] = None

    def adopt(self, site: str, described: ReducedFrom) -> ReducedFrom | None:
        """Widen `site`'s description by another rank's; the result if it changed.

        The caller declares what it returns: it is not handed out by `taken()`.
        """
        with self._lock:
            return self._described[site] if self._widen(site, described) else None

    def _widen(self, site: str, described: ReducedFrom) -> bool:
        known = self._described.get(site)
        if known is not None:
            described = known.merged(described)
        if described == known:
            return False
        self._described[site] = described
        return True

    def taken(self) -> list[tuple[str, ReducedFrom]]:
        """The sites whose description is new or changed since the last call, with it."""
        if not self._changed:  # the common case, at every gather: nothing new
            return []
        with self._lock:
            changed, self._changed = self._changed, {}
            return [(site, self._described[site]) for site in changed]
