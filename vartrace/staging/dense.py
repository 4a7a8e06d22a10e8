"""`LastRecords`: each site's last record kept, and whether a new one differs from it.

Change detection keeps a record only where it differs from its site's last one, bit for
bit: equal dtype and shape and equal bytes (`vartrace.tensors.same`).  The common record
of a model on the CPU is a plain dense CPU tensor, which synchronous staging hands here
to be compared and copied in one step (`dense_copy`, from `BlockingStaging.admit_plain`
through `Chunk.keep_dense`).  Its copy is kept with the few facts it has, read once
(a `DenseCopy`): its dtype and shape, its bytes and their address.  The next value of
the site is compared with it by a tuple comparison and one `memcmp`, where `same` reads
a dozen tensor attributes of both sides, about 600 instructions each; once a site's value
has repeated, the bytes of its next values are compared as they lie, before any copy is
made, so that a value that stays the same is not copied step after step.  A dtype whose
equal values may differ in bytes (complex, quantized) gets no `DenseCopy`: `same`
compares its copy, as it does every other record (`differs`).

A `DenseCopy` holds its tensor, so the address stays valid while it is a site's last
record.  A program that resizes a record in place (a callback's `resize_` or `set_` on
`trace.values[i]`) moves its bytes: the address read again before each comparison tells,
and such a record is compared as any tensor is.

Example:
    ```python
    last = LastRecords()
    last.dense_copy("forward.x", torch.ones(3), 12)   # a copy: the site's first record
    last.dense_copy("forward.x", torch.ones(3), 12)   # None: the same bytes again
    last.dense_copy("forward.x", torch.ones(3), 12)   # None, without a copy
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from vartrace._support import memory
from vartrace.tensors import NOT_BYTEWISE, dense_clone, same

__all__ = ["DenseCopy", "LastRecords"]

_MISSING = object()


class DenseCopy:
    """A record that is a plain contiguous CPU tensor, with its dtype and shape (`form`),
    its size in bytes and the address of its first byte, read once when it was kept;
    `repeated`: a value of its site has equalled it since."""

    __slots__ = ("address", "form", "nbytes", "repeated", "tensor")

    tensor: torch.Tensor
    form: tuple[torch.dtype, torch.Size]
    nbytes: int
    address: int
    repeated: bool


_new = object.__new__  # (a class without __init__ is made for a third of the instructions)


class LastRecords:
    """Each site's last record kept (a host copy, or its `DenseCopy`), and whether a new
    record differs from it: what change detection keeps."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}
        memory.build_memcmp()  # (before the first step compares)

    def differs(self, site: str, host: Any) -> bool:
        """Whether `host`, the host copy of `site`'s new record, differs from the site's
        last one (then it is the last one from now on).  `None`: a record a stager
        compared on the device, which compares the site's records from now on."""
        if host is None:
            self._last.pop(site, None)
            return True
        last = self._last.get(site, _MISSING)
        if last is not _MISSING and _unchanged(host, last):
            return False
        self._last[site] = host
        return True

    def dense_copy(self, site: str, value: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        """The record `site` keeps of `value`, a plain dense CPU tensor of `nbytes` bytes:
        its contiguous copy (the site's last record from now on), or `None` where it equals
        the site's last record.

        Once a site's value has repeated (a batch of constant inputs, a frozen weight),
        its next contiguous values are compared before they are copied: an unchanged one
        is not copied again.  A site whose values change pays no comparison of a value
        it then copies anyway.
        """
        dtype = value.dtype
        memcmp = memory.memcmp
        if dtype in NOT_BYTEWISE or memcmp is None:
            record = dense_clone(value)
            return record if self.differs(site, record) else None
        form = (dtype, value.shape)
        last = self._last.get(site, _MISSING)
        if type(last) is DenseCopy:  # written out: the common case of the record path
            if last.form != form:
                last = _MISSING  # known to differ
            elif last.tensor.data_ptr() != last.address:
                last = last.tensor  # resized in place since (a callback's resize_): a tensor
            elif not nbytes:
                return None
            elif last.repeated and value.is_contiguous():
                # Its bytes as they lie, unless they are not its values: a zero tensor has
                # none, a negative view's are negated (then its copy is compared).
                address = value.data_ptr()
                if address and memcmp(address, last.address, nbytes) == 0 and not value.is_neg():
                    return None
        record = dense_clone(value)
        address = record.data_ptr()
        if type(last) is DenseCopy:
            if memcmp(address, last.address, nbytes) == 0:
                last.repeated = True
                return None
        elif last is not _MISSING and _unchanged(record, last):
            return None
        key: DenseCopy = _new(DenseCopy)
        key.tensor = record
        key.form = form
        key.nbytes = nbytes
        key.address = address
        key.repeated = False
        self._last[site] = key
        return record

    def clear(self) -> None:
        """Forget every site's last record."""
        self._last.clear()


def _unchanged(host: Any, last: Any) -> bool:
    """Whether the host copy `host` equals the site's `last` one, bit for bit (either may
    be a `DenseCopy`); a comparison that raises (a subclass lacking an op) says no."""
    try:
        return same(
            host.tensor if type(host) is DenseCopy else host,
            last.tensor if type(last) is DenseCopy else last,
        )
    except Exception:  # a subclass's copy that lacks an op: not known equal
        return False
