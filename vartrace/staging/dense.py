"""`LastRecords`: each site's last record kept, and whether a new one differs from it.

Change detection keeps a record only where it differs from its site's last one, bit for
bit: equal dtype and shape and equal bytes (`vartrace.tensors.same`).  The common record
of a model on the CPU is a clone of a plain contiguous CPU tensor, which synchronous
staging makes (`BlockingStaging.admit_plain`).  Such a record is compared here by the few
facts it has, read once when it is kept (`dense_differs`): its dtype and shape, its
bytes and their address, held in a `DenseCopy`.  Comparing two of them is a tuple
comparison and a `memcmp`, where `same` reads a dozen tensor attributes of both sides,
about 600 instructions each, to learn again what the copy already knew.  A dtype whose
equal values may differ in bytes (complex, quantized) gets no `DenseCopy`: `same`
compares it, as it does every other record (`differs`).

A `DenseCopy` holds its tensor, so the address stays valid while it is a site's last
record.  A program that resizes a record in place (a callback's `resize_` or `set_` on
`trace.values[i]`) moves its bytes: the address read again before each comparison tells,
and such a record is compared as any tensor is.

Example:
    ```python
    last = LastRecords()
    last.dense_differs("forward.x", torch.ones(3), 12)   # True: the site's first record
    last.dense_differs("forward.x", torch.ones(3), 12)   # False: the same bytes again
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from vartrace._support import memory
from vartrace.tensors import NOT_BYTEWISE, same

__all__ = ["DenseCopy", "LastRecords"]

_MISSING = object()


class DenseCopy:
    """A record that is a plain contiguous CPU tensor, with its dtype and shape (`form`),
    its size in bytes and the address of its first byte, read once when it was kept."""

    __slots__ = ("address", "form", "nbytes", "tensor")

    tensor: torch.Tensor
    form: tuple[torch.dtype, torch.Size]
    nbytes: int
    address: int


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

    def dense_differs(self, site: str, record: torch.Tensor, nbytes: int) -> bool:
        """`differs` for `record`, a contiguous clone of a plain dense CPU tensor of
        `nbytes` bytes that nothing else holds."""
        dtype = record.dtype
        memcmp = memory.memcmp
        if dtype in NOT_BYTEWISE or memcmp is None:
            return self.differs(site, record)
        form = (dtype, record.shape)
        address = record.data_ptr()
        last = self._last.get(site, _MISSING)
        if type(last) is DenseCopy:  # written out: the common case of the record path
            if last.form != form:
                last = _MISSING  # known to differ
            elif not nbytes:
                return False
            elif last.tensor.data_ptr() == last.address:  # not resized in place since
                if memcmp(address, last.address, nbytes) == 0:
                    return False
                last = _MISSING
        if last is not _MISSING and _unchanged(record, last):
            return False
        key: DenseCopy = _new(DenseCopy)
        key.tensor = record
        key.form = form
        key.nbytes = nbytes
        key.address = address
        self._last[site] = key
        return True

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
