"""`LastRecords`: each site's last record kept, and whether a new one differs from it.

Change detection keeps a record only where it differs from its site's last one, bit for
bit: equal dtype and shape and equal bytes (`vartrace.tensors.same`).  The common record
of a model on the CPU is a plain dense CPU tensor, which synchronous staging hands here
to be compared and copied in one step (`dense_copy`, from `BlockingStaging.admit_plain`
through `Chunk.keep_dense`).  Its copy is kept with the few facts it has, read once
(a `DenseCopy`): its dtype and shape, its bytes and their address.  The next value of
the site is compared with it by a tuple comparison and one `memcmp`, where `same` reads
a dozen tensor attributes of both sides, about 600 instructions each.  The copy of a
value whose bytes are its values (`COPIED_AS_BYTES`, contiguous) is a tensor made for it
(`torch.empty_like`) that its bytes are copied into (`memory.memcpy`): for a 64 KiB
record, 15.5 k instructions against `clone`'s 19.9 k, whose dispatch and copy kernel cost
more than the copy itself.  Once a site's value has repeated, the bytes of its next values
are compared as they lie, before any copy is made, so that a value that stays the same
is not copied step after step.  A dtype whose
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

__all__ = ["COPIED_AS_BYTES", "DenseCopy", "LastRecords", "plain_copy"]

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
_empty_like = torch.empty_like

#: The dtypes whose tensors a copy of their bytes copies (`dense_copy`): whole bytes an
#: element, values equal where their bytes are.  (Sub-byte dtypes torch cannot copy get
#: their marker from torch's copy.)
COPIED_AS_BYTES = frozenset(
    getattr(torch, name)
    for name in (  # noqa: SIM905 (the names on two lines, not seventeen)
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 "
        "float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz"
    ).split()
    if hasattr(torch, name)
)


def plain_copy(value: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A contiguous copy of `value`, a plain dense CPU tensor of `nbytes` bytes: its bytes
    copied into a tensor made for them where they are its values, else torch's clone (a
    record kept without change detection)."""
    memcpy = memory.memcpy
    if (
        memcpy is None
        or value.dtype not in COPIED_AS_BYTES
        or not value.is_contiguous()
        or value.is_neg()
        or not (source := value.data_ptr())
    ):
        return dense_clone(value)
    record = _empty_like(value)
    memcpy(record.data_ptr(), source, nbytes)
    return record


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
        # The value's bytes as they lie, where they are its values: not a zero tensor's
        # (it has none) or a negative view's (negated); then torch copies and compares.
        source = 0
        if dtype in COPIED_AS_BYTES and value.is_contiguous() and not value.is_neg():
            source = value.data_ptr()
        form = (dtype, value.shape)
        last = self._last.get(site, _MISSING)
        if type(last) is DenseCopy:  # written out: the common case of the record path
            if last.form != form:
                last = _MISSING  # known to differ
            elif last.tensor.data_ptr() != last.address:
                last = last.tensor  # resized in place since (a callback's resize_): a tensor
            elif not nbytes or (
                last.repeated and source and memcmp(source, last.address, nbytes) == 0
            ):
                return None  # no bytes, or the same as they lie
        memcpy = memory.memcpy
        if source and memcpy is not None:  # what clone makes, for fewer instructions
            record = _empty_like(value)
            address = record.data_ptr()
            memcpy(address, source, nbytes)
        else:
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
