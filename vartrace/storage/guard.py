"""Reading run files safely: nothing outside the file, nothing beyond what the file holds.

Run files travel (sent between users, attached to bug reports), so a reader
treats each as possibly crafted: data kept in other files (external storage,
external links, virtual datasets mapping other files) is refused, links are
never followed, and no read allocates more than `FREE_READ_BYTES` unless
the file really holds that much of the dataset; compressed data counts for at most
`MAX_COMPRESSION` times the file's size whatever its real compression ratio, so a
small file of compressed zeros cannot make a reader allocate gigabytes.

Example:
    ```python
    values = child(group, "values", h5py.Dataset)   # a hard-linked dataset, data inside
    check_read(values, rows * record_elements)       # before reading that many elements
    ```
"""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

from vartrace.errors import RunFileError

__all__ = [
    "FREE_READ_BYTES",
    "RunFileError",
    "check_link",
    "check_read",
    "check_storage",
    "child",
    "file_name",
    "held_bytes",
    "open_object",
    "size_text",
]


#: Reads up to this size are allowed whatever a dataset holds; larger ones only when the
#: file holds that much of the dataset (a declared size costs a crafted file nothing).
FREE_READ_BYTES = 64 << 20
#: The largest compression ratio a read believes: recorded values compress a few times at
#: most (floats barely, ReLU outputs and masks some tens), a gzip bomb a thousand times.
MAX_COMPRESSION = 32
_OBJECT_SCALE = 16  # bytes in memory per byte of a variable-length element's descriptor


def file_name(object_id: Any) -> str:
    return os.fsdecode(h5py.h5f.get_name(object_id))


def check_link(group: h5py.Group, link: str) -> None:
    """Refuse a link other than a hard link (vartrace writes no other kind): never follow it."""
    try:
        kind = group.id.links.get_info(link.encode()).type
    except (KeyError, RuntimeError):  # h5py's errors for a missing link
        path = f"{group.name.rstrip('/')}/{link}"
        raise RunFileError(f"{file_name(group.id)}: {path} is missing: a damaged file") from None
    if kind == h5py.h5l.TYPE_HARD:
        return
    if kind == h5py.h5l.TYPE_EXTERNAL:
        target, inner = (os.fsdecode(part) for part in group.id.links.get_val(link.encode()))
        what = f"an external link to {inner} in {target}"
    elif kind == h5py.h5l.TYPE_SOFT:
        what = f"a soft link to {os.fsdecode(group.id.links.get_val(link.encode()))}"
    else:
        what = "a user-defined link"
    raise RunFileError(
        f"{file_name(group.id)}: {group.name.rstrip('/')}/{link} is {what}; vartrace writes "
        "no links and does not follow them"
    )


def check_storage(dsid: h5py.h5d.DatasetID) -> h5py.h5p.PropDCID:
    """Refuse a dataset whose data lies outside its file (external storage, virtual sources).

    Returns the dataset's creation property list (its layout, filters), for a caller
    that needs them too.
    """
    plist = dsid.get_create_plist()
    layout = plist.get_layout()
    outside: list[str] = []
    if layout == h5py.h5d.CONTIGUOUS:  # the only layout external storage may have
        outside = [os.fsdecode(plist.get_external(i)[0]) for i in range(plist.get_external_count())]
    elif layout == h5py.h5d.VIRTUAL:
        count = plist.get_virtual_count()
        names = {plist.get_virtual_filename(i) for i in range(count)}
        outside = sorted(names - {"."})
    if outside:
        name = os.fsdecode(h5py.h5i.get_name(dsid) or b"?")
        raise RunFileError(
            f"{file_name(dsid)}: dataset {name} keeps its data in another file ({outside[0]}); "
            "vartrace reads only data stored inside the run file"
        )
    return plist


def open_object(group: h5py.Group, link: str) -> h5py.h5o.ObjectID:
    """The low-level object `link` of `group` (a hard link, checked); an object HDF5
    cannot open (a damaged header) is a `RunFileError` naming it."""
    check_link(group, link)
    try:
        return h5py.h5o.open(group.id, link.encode())
    except KeyError as error:
        where = f"{group.name.rstrip('/')}/{link}"
        raise RunFileError(
            f"{file_name(group.id)}: {where} cannot be read: a damaged file ({error.args[0]})"
        ) from None


def child(group: h5py.Group, link: str, kind: type) -> Any:
    """The object `link` of `group` (a hard link to a `kind`), its data inside the file."""
    item = open_object(group, link)
    if kind is h5py.Group and isinstance(item, h5py.h5g.GroupID):
        return h5py.Group(item)
    if kind is h5py.Dataset and isinstance(item, h5py.h5d.DatasetID):
        check_storage(item)
        return h5py.Dataset(item)
    what = "group" if kind is h5py.Group else "dataset"
    name = f"{group.name.rstrip('/')}/{link}"
    raise RunFileError(f"{file_name(group.id)}: {name} is not a {what}: a damaged file")


def held_bytes(dsid: h5py.h5d.DatasetID) -> int:
    """The bytes of a dataset's data the file really holds (unwritten chunks hold none).

    Counted as read (decompressed): no more than the file's size, or than
    `MAX_COMPRESSION` times it for compressed data, whose real ratio is only known
    by decompressing (a gzip of zeros reaches thousands).
    """
    plist = dsid.get_create_plist()
    layout = plist.get_layout()
    file_size = h5py.h5i.get_file_id(dsid).get_filesize()
    if layout == h5py.h5d.COMPACT:
        return dsid.get_space().get_select_npoints() * dsid.get_type().get_size()
    if layout == h5py.h5d.CONTIGUOUS:
        return min(dsid.get_storage_size(), file_size)
    if layout == h5py.h5d.CHUNKED:
        chunk = int(np.prod(plist.get_chunk(), dtype=object)) * dsid.get_type().get_size()
        ratio = MAX_COMPRESSION if plist.get_nfilters() else 1
        return min(dsid.get_num_chunks() * chunk, ratio * file_size)
    return 0


def check_read(dataset: h5py.Dataset | h5py.h5d.DatasetID, elements: int) -> None:
    """Raise `RunFileError` before a read of `elements` that the file cannot back.

    A read is allowed up to `FREE_READ_BYTES`, beyond that only as far as
    the file holds data of the dataset: a crafted file declaring gigabytes it does
    not hold, or holding them as a few KiB of compressed zeros, cannot make a
    reader allocate them.
    """
    dsid = dataset.id if isinstance(dataset, h5py.Dataset) else dataset
    kind = dsid.get_type()
    variable = kind.get_class() == h5py.h5t.VLEN or (
        kind.get_class() == h5py.h5t.STRING and kind.is_variable_str()
    )
    # A variable-length element costs a Python object when read, far more than its 16 bytes.
    scale = _OBJECT_SCALE if variable else 1
    nbytes = elements * kind.get_size() * scale
    if nbytes <= FREE_READ_BYTES:
        return
    held = held_bytes(dsid) * scale
    if nbytes > held:
        name = os.fsdecode(h5py.h5i.get_name(dsid) or b"?")
        compressed = (
            f" (compressed data counts for at most {MAX_COMPRESSION} times the file's size: "
            "read a genuine record in slices of the lazy Site.values)"
            if dsid.get_create_plist().get_nfilters()
            else ""
        )
        raise RunFileError(
            f"{file_name(dsid)}: dataset {name} declares {size_text(nbytes)} to read but the file "
            f"holds {size_text(held)} of it: a damaged or crafted file{compressed}"
        )


def size_text(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"
