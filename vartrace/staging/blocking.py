"""`BlockingStaging`: each record copied and delivered on the thread that captures it.

The synchronous implementation of `vartrace.staging.protocol.Staging`, for models
on the CPU (`ModelTracer(staging="sync")`): admission is the copy, so `flush` and
`drain` have nothing to wait for, and a job runs at once, on the caller's thread.

Example:
    ```python
    staging = BlockingStaging(lambda site, record, iteration, host, nbytes: print(site))
    staging.admit("forward.x", torch.ones(3), iteration=1)   # prints at once
    ```
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from vartrace._support.memory import MAP_FROM
from vartrace.tensors import copy_leaf, dense_clone

__all__ = ["BlockingStaging"]

_CPU = torch.device("cpu")
_TENSOR = torch.Tensor
_STRIDED = torch.strided
_transforms_active = torch._C._are_functorch_transforms_active

BlockingDeliver = Callable[[str, Any, int, Any, int], None]
"""`deliver(site, record, iteration, host, nbytes)`: each record, at admission; `host` is
the record itself (on the host to compare), `nbytes` the bytes room was made for."""

DeliverDense = Callable[[str, Any, int, int], None]
"""`deliver_dense(site, value, iteration, nbytes)`: a plain dense CPU tensor of `nbytes`
bytes, captured where no room is to be made, to be compared and copied (unless unchanged);
what its copy raises reaches `admit_plain`."""


class BlockingStaging:
    """Copies each record to `device` where it is captured and delivers it at once.

    Args:
        deliver: `deliver(site, record, iteration, host, nbytes)` (see `BlockingDeliver`).
        device: where records are copied.
        make_room: `make_room(value) -> nbytes`, called before each copy when given:
            waits until a saver writing on a thread of its own has room for it, so
            that the step waits before the copy exists.
        deliver_dense: `deliver_dense(site, value, iteration, nbytes)` (see
            `DeliverDense`), for the common record: a plain dense CPU tensor below
            `MAP_FROM` kept on the CPU with no saver to wait for, copied by the callee
            (unless unchanged); a clone delivered where not given.
    """

    stats = None  # nothing runs apart from the caller: nothing to count

    def __init__(
        self,
        deliver: BlockingDeliver,
        *,
        device: torch.device,
        make_room: Callable[[Any], int] | None = None,
        deliver_dense: DeliverDense | None = None,
    ) -> None:
        self._deliver = deliver
        self._deliver_dense = deliver_dense or (
            lambda site, value, iteration, nbytes: self._clone(site, value, iteration)
        )
        self._device = device
        self._make_room = make_room
        self._on_cpu = device == _CPU
        self._direct = self._on_cpu and make_room is None  # admit_plain's short path
        self._lock = threading.Lock()

    def admit(self, site: str, value: Any, iteration: int, *, fresh: bool = False) -> None:
        """Copy `value` (waiting for room first, if asked) and deliver the copy.

        `fresh`: `value` is a new tensor nothing else holds (a statistics row); one that
        already is what the copy would be (a plain contiguous CPU tensor outside autograd,
        records kept on the CPU) is delivered as it is.
        """
        nbytes = 0 if self._make_room is None else self._make_room(value)
        if (
            fresh
            and self._on_cpu
            and type(value) is _TENSOR
            and value.is_cpu
            and value.layout is _STRIDED
            and not value.requires_grad
            and value.is_contiguous()
        ):
            record = value  # what copy_leaf makes for the CPU: dense, contiguous, detached
        else:
            record = copy_leaf(value, self._device, site)
        self._deliver(site, record, iteration, record, nbytes)

    def admit_plain(self, site: str, value: torch.Tensor, iteration: int) -> None:
        """`admit` of a tensor of type `torch.Tensor` that is no `torch.func` wrapper.

        The common record, a plain dense CPU tensor below `MAP_FROM` kept on the CPU
        with no saver to wait for, goes to `deliver_dense` as it is, with its size: the
        callee compares it with the site's last record before copying it.  One whose copy
        fails (a dtype torch cannot copy, no memory) gets `admit`'s marker.
        """
        if self._direct and value.is_cpu and value.layout is _STRIDED and not value.is_nested:
            nbytes = value.nbytes
            if nbytes < MAP_FROM:
                try:
                    self._deliver_dense(site, value, iteration, nbytes)
                except Exception:  # a dtype torch cannot copy, no memory: admit's marker
                    self.admit(site, value, iteration)
                return
        self.admit(site, value, iteration)

    def _clone(self, site: str, value: torch.Tensor, iteration: int) -> None:
        record = dense_clone(value)
        self._deliver(site, record, iteration, record, 0)

    def flush(self) -> None:
        """Nothing to start: every record was delivered at admission."""

    def call(self, job: Callable[[], None]) -> None:
        """Run `job` now, after any job another thread runs (threads that end iterations
        at once hand their chunks over one by one), outside any torch.func transform (a
        model called under `vmap` ends its iteration inside it; jobs see plain tensors)."""
        with self._lock:
            if _transforms_active():  # (the guard costs ~7 k instructions: only under one)
                with torch._C._DisableFuncTorch():
                    job()
            else:
                job()

    def drain(self) -> None:
        """Nothing to wait for: every record was delivered at admission."""

    def close(self, last: Callable[[], None] | None = None) -> None:
        """Run `last`, if given, as `call` does."""
        if last is not None:
            self.call(last)
