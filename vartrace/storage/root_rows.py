"""A file's root index read and checked: what the reader lists and the appender continues.

Both read `/committed`, the counted rows of `/site_index` with their names in
`/site_names` and each site group's `slot` through these functions, so a file that one
refuses as damaged the other refuses with the same `RunFileError`, and neither meets a
raw `KeyError`, `IndexError` or `UnicodeDecodeError` from a crafted file.

Example:
    ```python
    counts = committed_counts(handle)
    rows = indexed(handle, counts)          # None: sites are found by walking /vars
    slots = site_slots(handle, counts)      # link name -> slot, of every group in /vars
    ```
"""

from __future__ import annotations

import h5py
import numpy as np

from vartrace.storage.files import int_attr
from vartrace.storage.guard import RunFileError, check_read, child, file_name
from vartrace.storage.layout import (
    COMMITTED,
    NAME_END,
    NAME_START,
    NO_TARGET,
    SITE_INDEX,
    SITE_NAMES,
    TARGET,
    unescape,
)

__all__ = ["alias_rows", "committed_counts", "indexed", "site_slot", "site_slots"]

#: A counted root index row: slot, link name, first capture order, alias target slot or -1.
Row = tuple[int, str, int, int]


def committed_counts(handle: h5py.File) -> np.ndarray:
    """The record count of each slot in `/committed`; a negative count is a `RunFileError`
    (it would hide a site)."""
    committed = child(handle, COMMITTED, h5py.Dataset)
    if committed.ndim != 1 or committed.dtype.kind not in "iu":
        raise RunFileError(
            f"{file_name(handle.id)}: /{COMMITTED} is not a dataset of integers: a damaged file"
        )
    check_read(committed, committed.size)
    counts = np.asarray(committed[()], np.int64)
    negative = np.flatnonzero(counts < 0)
    if len(negative):
        raise RunFileError(
            f"{file_name(handle.id)}: /{COMMITTED} counts {int(counts[negative[0]])} records "
            f"for slot {int(negative[0])}: a damaged file"
        )
    return counts


def indexed(handle: h5py.File, counts: np.ndarray) -> list[Row] | None:
    """(slot, link name, first capture order, alias target slot) of each counted slot of
    `handle`'s root index (see `layout`); `None` for a file without a complete one (written
    by an older vartrace, or appended to by one: its sites are found by walking `/vars`).

    A root index that cannot be what vartrace writes is a `RunFileError`.
    """
    links = handle.id.links
    has_index, has_names = (links.exists(name.encode()) for name in (SITE_INDEX, SITE_NAMES))
    if not has_index and not has_names:
        return None
    if not has_index or not has_names:
        held, lacked = (SITE_INDEX, SITE_NAMES) if has_index else (SITE_NAMES, SITE_INDEX)
        raise RunFileError(
            f"{file_name(handle.id)}: /{held} is there without /{lacked}: a damaged file"
        )
    index = child(handle, SITE_INDEX, h5py.Dataset)
    names = child(handle, SITE_NAMES, h5py.Dataset)
    where = f"{file_name(handle.id)}: /{SITE_INDEX}"
    if index.ndim != 2 or index.shape[1] != 4 or index.dtype.kind not in "iu":
        raise RunFileError(f"{where} is not a (slots, 4) dataset of integers: a damaged file")
    if names.ndim != 1 or names.dtype != np.uint8:
        raise RunFileError(
            f"{file_name(handle.id)}: /{SITE_NAMES} is not a dataset of bytes: a damaged file"
        )
    check_read(index, index.size)
    check_read(names, names.size)
    counted = np.flatnonzero(counts > 0)
    if len(counted) and counted[-1] >= len(index):
        return None  # counted slots past the index: an older vartrace appended
    rows = np.asarray(index[()], np.int64)[counted]
    if len(rows) and not rows[:, NAME_END].all():
        return None  # counted slots the index never named: likewise
    data = np.asarray(names[()], np.uint8).tobytes()
    starts, ends = rows[:, NAME_START], rows[:, NAME_END]
    bad = (starts < 0) | (starts >= ends) | (ends > len(data))
    bad |= (rows[:, TARGET] < NO_TARGET) | (rows[:, TARGET] >= len(counts))
    if bad.any():
        slot = int(counted[np.flatnonzero(bad)[0]])
        raise RunFileError(f"{where} holds an impossible row for slot {slot}: a damaged file")
    found = []
    for slot, (start, end, first, target) in zip(counted.tolist(), rows.tolist(), strict=True):
        try:
            link = data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise RunFileError(
                f"{where} names slot {slot} with bytes that are no UTF-8: a damaged file"
            ) from None
        found.append((slot, link, first, target))
    return found


def alias_rows(rows: list[Row]) -> dict[str, tuple[int, str]]:
    """Alias name -> (its slot, its target's name) of a file's counted index rows
    (`indexed`): the later slot of a name wins (a commit cut short between two); an alias
    whose target is no counted site of the file is left out."""
    sites = {slot: link for slot, link, _, target in rows if target == NO_TARGET}
    return {
        unescape(link): (slot, unescape(sites[target]))
        for slot, link, _, target in rows
        if target != NO_TARGET and target in sites
    }


def site_slot(group: h5py.Group, bound: int | None = None) -> int:
    """The `slot` attribute of a site's group: a `RunFileError` unless it is an integer at
    least 0 and, given `bound`, below it."""
    slot = int_attr(group, "slot")
    if slot is None:
        raise RunFileError(
            f"{file_name(group.id)}: {group.name} has no integer 'slot' attribute: a damaged file"
        )
    if slot < 0 or (bound is not None and slot >= bound):
        below = "" if bound is None else f" below {bound}"
        raise RunFileError(
            f"{file_name(group.id)}: {group.name} has the slot {slot}, where the file's root "
            f"index gives slots from 0{below}: a damaged file"
        )
    return slot


def site_slots(handle: h5py.File, counts: np.ndarray) -> dict[str, int]:
    """Link name -> slot of every group under `/vars`, each bounded by the index's own size.

    Slots are given one after another, a site's group made before its first count:
    none lies past the slots of `/committed` and `/site_index` by more than the number
    of groups (a killed writer's uncounted ones).  A slot beyond that would make an
    append size `/committed` by it: the file is refused.
    """
    sites = child(handle, "vars", h5py.Group)
    rows = len(handle[SITE_INDEX]) if handle.id.links.exists(SITE_INDEX.encode()) else 0
    bound = max(len(counts), rows) + len(sites)
    return {link: site_slot(child(sites, link, h5py.Group), bound) for link in sites}
