"""What a site's records were made from, where they are not the values themselves: the
values a pre-save callback replaced, and the `DTensor` whose local shards they are.

Statistics mode ([`stats`][vartrace.stats]) turns each tensor into a row of numbers: the
row alone no longer says whether the tensor was `bfloat16` or `float32`, nor its shape.
The tracer notes, per site, the dtype and shape of the values a pre-save callback
replaced, and hands what changed to the results and to the post-gather callbacks that
have a `reduced` method (the HDF5 saver keeps them as attributes of the site), at each
gather before the records.

One description covers every record of a site: the dtypes seen, in order of first
appearance, and the shape, with -1 on each axis whose size differed between records
(a variable sequence length reads `(8, -1, 768)`).

A `DTensor` (tensor parallelism, FSDP2's sharded parameters) is recorded as each rank's
local shard; the site's [`Placement`][vartrace.Placement] (the placements, the device mesh
and its ranks, the whole shape) travels the same way, and
[`assemble`][vartrace.assemble] joins the ranks' records into the whole tensor.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from vartrace._support.warnings import warn

__all__ = ["Placement", "Placements", "ReducedFrom", "Reductions", "assemble"]


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


class Placement(NamedTuple):
    """How the ranks' records of a site make one tensor: the site recorded a `DTensor`
    (tensor parallelism, FSDP2's sharded `.grad`) as each rank's local shard.

    `placements`: one per mesh dimension, as torch writes them (`"Shard(dim=0)"`,
    `"Replicate()"`, `"Partial(sum)"`); `mesh_shape`: the device mesh's shape;
    `mesh_ranks`: the global ranks of the mesh, row by row (the rank at each mesh
    coordinate); `shape`: the whole tensor's shape.

    Example:
        ```python
        run["a.weight"].placement
        # Placement(placements=('Shard(dim=0)',), mesh_shape=(2,), mesh_ranks=(0, 1), shape=(8, 4))
        ```
    """

    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> Placement:
        """The placement of the DTensor `value`."""
        mesh = value.device_mesh
        return cls(
            tuple(map(repr, value.placements)),
            tuple(int(size) for size in mesh.shape),
            tuple(int(rank) for rank in mesh.mesh.flatten().tolist()),
            tuple(int(size) for size in value.shape),
        )

    def __str__(self) -> str:
        """`Shard(dim=0) on a mesh (2,) of ranks 0, 1, shape (8, 4)`."""
        ranks = ", ".join(map(str, self.mesh_ranks))
        return (
            f"{', '.join(self.placements)} on a mesh {self.mesh_shape} of ranks {ranks}, "
            f"shape {self.shape}"
        )

    def assemble(self, shard: Callable[[int], Any]) -> Any:
        """The whole tensor from `shard(rank)`, each rank's local shard: `Shard(d)`
        shards concatenated along `d` in mesh order (the last mesh dimension first),
        one `Replicate()` copy; `ValueError` for any other placement (`Partial`: the
        ranks hold addends of a sum whose order the records do not keep)."""
        import torch

        dims = [_shard_dim(placement, self) for placement in self.placements]

        def joined(flat: int, axis: int) -> Any:
            """The tensor the mesh coordinates below `axis` starting at `flat` hold."""
            if axis == len(self.mesh_shape):
                return shard(self.mesh_ranks[flat])
            stride = math.prod(self.mesh_shape[axis + 1 :])
            dim = dims[axis]
            if dim is None:  # Replicate(): every coordinate holds the same
                return joined(flat, axis + 1)
            parts = [joined(flat + i * stride, axis + 1) for i in range(self.mesh_shape[axis])]
            return torch.cat(parts, dim=dim)

        whole = joined(0, 0)
        if tuple(whole.shape) != self.shape:
            raise ValueError(
                f"the shards placed {self} join into shape {tuple(whole.shape)}, not {self.shape}"
            )
        return whole


def _shard_dim(placement: str, where: Placement) -> int | None:
    """The dimension `placement` shards (`None` for `Replicate()`); `ValueError` when
    the records cannot make the whole tensor."""
    if placement == "Replicate()":
        return None
    found = re.fullmatch(r"Shard\(dim=(-?\d+)\)", placement)
    if found is not None:
        return int(found.group(1))
    why = (
        "each rank holds an addend of the sum torch computes when it reduces them, in an "
        "order the records do not keep"
        if placement.startswith("Partial")
        else "vartrace assembles Shard(d) and Replicate() placements only"
    )
    raise ValueError(f"records placed {where} cannot be assembled: {placement}: {why}")


def assemble(records: Any, iteration: int) -> Any:
    """The whole tensor a site held at `iteration`, from every rank's record of a
    `DTensor`'s local shard: `records` is a site of a read run (`run["a.weight"]`)
    or of a tracer's results (`tracer.results["a.weight"]`); each rank's record is
    its last at or before `iteration` (as `Site.get`), joined as the site's
    [`Placement`][vartrace.Placement] says.

    `ValueError` when the site recorded no DTensor, or one placed `Partial`;
    `KeyError` when a rank of the mesh has no record.

    Example:
        ```python
        weight = vartrace.assemble(run["a.weight"], iteration=3)  # (8, 4): every rank's (4, 4)
        ```
    """
    placement = getattr(records, "placement", None)
    name = getattr(records, "name", "the site")
    if placement is None:
        raise ValueError(
            f"{name} recorded no DTensor (it has no placement): its records are whole tensors"
        )
    if hasattr(records, "get"):
        return placement.assemble(lambda rank: records.get(iteration, rank=rank))
    return placement.assemble(lambda rank: _last_record(records, iteration, rank))


def _last_record(records: Any, iteration: int, rank: int) -> Any:
    """The last record of `rank` at or before `iteration` in the `Trace` `records`."""
    tags = zip(records.iterations, records.ranks, records.order, strict=True)
    found = [(int(it), int(order), i) for i, (it, r, order) in enumerate(tags) if int(r) == rank]
    found = [tag for tag in found if tag[0] <= iteration]
    if not found:
        raise KeyError(f"no record at or before iteration {iteration} on rank {rank}")
    return records.records()[max(found)[2]]


class Placements:
    """The placements of one tracer's DTensor records, site by site (the first a site
    met; a later different one is warned about).

    Example:
        ```python
        placements = Placements()
        placements.note("a.weight", colwise_weight)
        placements.taken()  # [("a.weight", Placement(("Shard(dim=0)",), (2,), (0, 1), (8, 4)))]
        ```
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, Any, Any]] = {}  # site -> (mesh, placements, shape)
        self._described: dict[str, Placement] = {}
        self._changed: dict[str, None] = {}  # sites described since the last `taken`
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def note(self, site: str, value: Any) -> None:
        """Note that `site` recorded the local shard of `value` (an `AsyncCollectiveTensor`,
        placed nowhere, is no DTensor: nothing to note)."""
        mesh = getattr(value, "device_mesh", None)
        if mesh is None:
            return
        key = (mesh, value.placements, value.shape)
        last = self._last.get(site)
        if last is not None and last[0] is mesh and last[1:] == key[1:]:
            return  # the common case, record after record
        self._last[site] = key
        if self.adopt(site, Placement.of(value)) is not None:
            with self._lock:
                self._changed[site] = None

    def adopt(self, site: str, placement: Placement) -> Placement | None:
        """Describe `site` by `placement` (another rank's) if it has no placement yet;
        the placement if it was new.  A different one is warned about, and not kept."""
        with self._lock:
            known = self._described.get(site)
            if known is None:
                self._described[site] = placement
                return placement
        if known != placement and site not in self._warned:
            self._warned.add(site)
            warn(
                f"vartrace: {site} recorded a DTensor placed {placement}, and before it one "
                f"placed {known}: the site keeps the first placement, which "
                "vartrace.assemble uses for every record",
                stacklevel=4,
            )
        return None

    def taken(self) -> list[tuple[str, Placement]]:
        """The sites described since the last call, with their placement."""
        if not self._changed:
            return []
        with self._lock:
            changed, self._changed = self._changed, {}
            return [(site, self._described[site]) for site in changed]
