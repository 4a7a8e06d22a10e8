"""`DenseCopy`: a record that is a plain dense CPU clone, with what change detection compares.

The common record of a model on the CPU is a clone of a plain contiguous CPU tensor.
Synchronous staging makes it (`BlockingStaging.admit_plain`) and, knowing what it made,
reads the few facts the comparison with the site's next record needs once, here:
its dtype and shape, its bytes and their address.  Comparing two such copies
(`unchanged`) is then a tuple comparison and a `memcmp`, where `vartrace.tensors.same`
reads a dozen tensor attributes of both sides, about 600 instructions each, to learn
again what the copy already knew.  The verdict is the same: equal dtype and shape and
equal bytes, bit for bit (a dtype whose equal values may differ in bytes, complex or
quantized, gets no `DenseCopy`: `same` compares it).

A `DenseCopy` holds its tensor, so the address stays valid while the chunk keeps it as a
site's last record.  A program that resizes a record in place (a callback's `resize_`
or `set_` on `trace.values[i]`) moves its bytes: the address read again before each
comparison tells, and such a record is compared as any tensor is.

Example:
    ```python
    a, b = keyed(torch.ones(3)), keyed(torch.ones(3))
    unchanged(a, b)   # True
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from vartrace._support.memory import memcmp
from vartrace.tensors import NOT_BYTEWISE, same

__all__ = ["DenseCopy", "keyed", "unchanged"]


class DenseCopy:
    """A record that is a plain contiguous CPU tensor, with its dtype and shape (`form`),
    its size in bytes and the address of its first byte, read once when it was made
    (by `keyed`)."""

    __slots__ = ("address", "form", "nbytes", "tensor")

    tensor: torch.Tensor
    form: tuple[torch.dtype, torch.Size]
    nbytes: int
    address: int


_new = object.__new__  # (a class without __init__ is made for a third of the instructions)


def keyed(record: torch.Tensor, nbytes: int) -> Any:
    """What change detection compares for `record`, a contiguous clone of a plain dense
    CPU tensor of `nbytes` bytes that nothing else holds: a `DenseCopy`, or the record
    itself for a dtype compared value by value (or where there is no `memcmp`)."""
    dtype = record.dtype
    if dtype in NOT_BYTEWISE or memcmp is None:
        return record
    key: DenseCopy = _new(DenseCopy)
    key.tensor = record
    key.form = (dtype, record.shape)
    key.nbytes = nbytes
    key.address = record.data_ptr()
    return key


def unchanged(host: Any, last: Any) -> bool:
    """Whether the host copy `host` equals the site's `last` one, bit for bit (either may
    be a `DenseCopy`); a comparison that raises (a subclass lacking an op) says no."""
    if type(host) is DenseCopy and type(last) is DenseCopy:
        if host.form != last.form:
            return False
        if not host.nbytes:
            return True
        if last.tensor.data_ptr() == last.address:  # not resized in place since
            # (`keyed` makes a DenseCopy only where there is a memcmp)
            return memcmp(host.address, last.address, host.nbytes) == 0  # type: ignore[misc]
    try:
        return same(
            host.tensor if type(host) is DenseCopy else host,
            last.tensor if type(last) is DenseCopy else last,
        )
    except Exception:  # a subclass's copy that lacks an op: not known equal
        return False
