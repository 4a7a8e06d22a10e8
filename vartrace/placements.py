"""How the ranks' records of a `DTensor` site join into one tensor.

A `DTensor` (tensor parallelism, FSDP2's sharded parameters and `.grad`) is recorded as
each rank's local shard.  The tracer notes each such site's
[`Placement`][vartrace.Placement] (the placements, the device mesh and its ranks, the whole
shape) and hands it on beside the reductions of `vartrace.reduced`: to the results, and to
the sinks that have a `placed` method (the HDF5 saver keeps it as attributes of the site).
[`assemble`][vartrace.assemble] joins the ranks' records into the whole tensor.

Example:
    ```python
    whole = vartrace.assemble(run["a.weight@grad"], iteration=40)
    ```
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from vartrace._support.warnings import warn

__all__ = ["Placement", "Placements", "assemble"]


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
