"""What travels through the staging thread: records copied at admission (`Ready`), records
staged on the device (`Staged`), the batches and jobs that carry them, and the bit-exact
comparison of two host copies.

Example:
    ```python
    batch = Batch([Ready(site, record, iteration, host, nbytes)], ready={})
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "Job", "Ready", "Staged", "bit_view", "same_bytes"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COMPARE_CHUNK = 1 << 20  # bytes compared at once on the host


def _bytes(host: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes, as a numpy view (views only: no torch CPU kernel)."""
    return host.view(-1).view(torch.uint8).numpy()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous host tensors of one dtype and shape hold the same bits, as
    `memcmp` tells: a chunk at a time, to the first chunk that differs (no temporary larger
    than a chunk).  -0.0 differs from 0.0, NaNs are equal when their payloads are."""
    left, right = _bytes(a), _bytes(b)
    return all(
        np.array_equal(left[start : start + _COMPARE_CHUNK], right[start : start + _COMPARE_CHUNK])
        for start in range(0, left.size, _COMPARE_CHUNK)
    )


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous record as integers of its width: equal views mean equal bits."""
    if tensor.dtype == torch.complex128:
        tensor = tensor.view(torch.float64)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


class Ready:
    """A value copied at admission, in the batch to keep capture order."""

    __slots__ = ("host", "iteration", "nbytes", "record", "site")

    def __init__(self, site: str, record: Any, iteration: int, host: Any, nbytes: int) -> None:
        self.site, self.record, self.iteration = site, record, iteration
        self.host, self.nbytes = host, nbytes


class Staged:
    """A device clone on its way to the host."""

    __slots__ = (
        "clone",
        "host",
        "iteration",
        "module",
        "nbytes",
        "on_host",
        "prev",
        "site",
        "stream",
    )

    def __init__(
        self, site: str, iteration: int, clone: torch.Tensor, stream: Any, module: ModuleType
    ) -> None:
        self.site, self.iteration = site, iteration
        self.clone: torch.Tensor | None = clone
        self.stream, self.module = stream, module
        self.nbytes = clone.nbytes
        self.host: torch.Tensor | None = None
        self.prev: torch.Tensor | None = None  # what the clone is compared with, kept alive
        self.on_host = False  # compared at delivery, its host copy with the site's last one


class Batch:
    """Records flushed together: one event per producer stream, one copy-done event."""

    __slots__ = ("done", "failed", "flags", "items", "module", "ready", "slot")

    def __init__(self, items: list[Ready | Staged], ready: dict[Any, Any]) -> None:
        self.items = items
        self.ready = ready  # producer stream -> the event recorded after its clones
        self.done: Any = None
        self.failed = False
        self.module: ModuleType | None = None  # the device module of the copies
        self.flags: dict[int, int] = {}  # item index -> its position in ``slot``
        self.slot: torch.Tensor | None = None  # host copy of the changed-flags


class Job:
    __slots__ = ("job",)

    def __init__(self, job: Callable[[], None]) -> None:
        self.job = job
