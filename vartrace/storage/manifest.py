"""The manifest beside a shard: what the shard held at its writer's last flush, in JSON, so
that `vartrace.open` lists the sites of thousands of shards without opening their HDF5 files.

The shard `run.rank3.h5` has the manifest `run.rank3.h5.manifest.json` (`manifest_path`),
rewritten by the saver at each flush and when it closes the file, with no collective
(see `manifest_writer`).  Example of its content:

```json
{"vartrace_manifest": 1, "file": "run.rank3.h5", "size": 51200, "mtime_ns": 17961...,
 "format": 2, "run_id": "6f0c...", "shard": [3, 8], "host": "node07", "pid": 4711,
 "open": false, "records": 96,
 "sites": [{"name": "forward.x", "link": "forward.x", "slot": 0, "records": 48,
            "first_order": 0, "first_iteration": 1, "last_iteration": 12,
            "dtype": "float32", "shape": [4, 16], "bytes": 12288}, ...],
 "aliases": [{"name": "x", "link": "x", "slot": 2, "target": "forward.x", "target_slot": 0}]}
```

A node's shard (`gather="node"`, `run.node1.h5`) names its node and the number of nodes in
`shard`, and adds `"node_ranks": [4, 5, 6, 7], "world_size": 16`: the global ranks it holds.
`size` and `mtime_ns` are the file's as the writer left it at that flush; `records` sums the
counts of `/committed` then (aliases count 1), each site's and alias's `slot` and `records`
being its entry there.  A reader trusts a manifest only when the file still has that size
(and, on a local disk, that modification time): a file flushed later, or rewritten by
another run, is opened instead.  Sites list their true name, the link name of their group
under `/vars`, the capture order of their first record, the dtype as `Site.dtype` names it,
the padded shape of a record and the bytes of their `values` rows (`null` for strings and
objects).  A damaged manifest is ignored with a warning; the shard's file is opened instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from vartrace.errors import ManifestError
from vartrace.storage.layout import NO_TARGET, unescape

__all__ = [
    "MANIFEST_SUFFIX",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestError",
    "manifest_path",
    "parse_manifest",
    "write_manifest",
]

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_VERSION = 1

#: The most bytes a manifest may hold (a site takes about 200): a larger one is no manifest.
_MOST_BYTES = 256 << 20


def manifest_path(path: str) -> str:
    """The manifest of the shard at `path` (a local path or a URL)."""
    return path + MANIFEST_SUFFIX


@dataclass(frozen=True)
class Manifest:
    """A manifest as a reader uses it: the shard's identity and its root index as of a flush.

    `counts` and `indexed` are what `/committed` and the root index give (see
    `root_rows.indexed`): (slot, link name, first capture order, alias target slot or -1).
    """

    size: int
    mtime_ns: int | None
    format: int
    run_id: str
    shard: tuple[int, int] | None
    host: str
    pid: int
    open: bool
    counts: np.ndarray
    indexed: list[tuple[int, str, int, int]]
    content: dict[str, Any]
    #: A node's shard (`gather="node"`): the global ranks it holds and the run's world size.
    node_ranks: tuple[tuple[int, ...], int] | None = None

    def matches(self, size: int | None, mtime_ns: int | None) -> bool:
        """Whether a file of `size` bytes modified at `mtime_ns` (`None`: not known, as of a
        remote file) is the file this manifest describes."""
        if size is None or size != self.size:
            return False
        return mtime_ns is None or self.mtime_ns is None or mtime_ns == self.mtime_ns


def write_manifest(path: str, content: dict[str, Any]) -> None:
    """Write the manifest of the shard at `path` atomically: a temporary file in its
    directory, then `os.replace`, so a reader sees the old manifest or the new one."""
    target = manifest_path(path)
    folder, name = os.path.split(target)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(content, out, separators=(",", ":"))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _field(content: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = content.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ManifestError(f"its {name!r} is missing or not of the right type")
    return value


def _entry(item: Any, what: str) -> tuple[str, int, int]:
    """(link, slot, records) of a manifest's site or alias entry, checked."""
    if not isinstance(item, dict):
        raise ManifestError(f"one of its {what} is no object")
    link, slot, records = (
        _field(item, "link", str),
        _field(item, "slot", int),
        _field(item, "records", int),
    )
    if unescape(link) != item.get("name") or slot < 0 or records < 0 or not link:
        raise ManifestError(f"the {what} entry {link!r} is impossible")
    return link, slot, records


def parse_manifest(data: bytes) -> Manifest:
    """The manifest `data` holds; `ManifestError` saying why for one vartrace never writes."""
    if len(data) > _MOST_BYTES:
        raise ManifestError(f"it holds {len(data)} bytes, more than a manifest ever does")
    try:
        content = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"it is no JSON ({error})") from None
    if not isinstance(content, dict):
        raise ManifestError("it is no JSON object")
    version = _field(content, "vartrace_manifest", int)
    if version != MANIFEST_VERSION:
        raise ManifestError(f"it is of version {version}, this vartrace reads {MANIFEST_VERSION}")
    shard = content.get("shard")
    if shard is not None and not (
        isinstance(shard, list) and len(shard) == 2 and all(type(n) is int for n in shard)
    ):
        raise ManifestError("its 'shard' is no [rank, world size]")
    mtime = content.get("mtime_ns")
    sites = [_entry(item, "sites") for item in _field(content, "sites", list)]
    aliases = _field(content, "aliases", list)
    slots = {slot: link for link, slot, _ in sites}
    indexed = [
        (slot, link, _field(item, "first_order", int), NO_TARGET)
        for (link, slot, _), item in zip(sites, content["sites"], strict=True)
    ]
    for item in aliases:
        link, slot, _ = _entry(item, "aliases")
        target = _field(item, "target_slot", int)
        if slots.get(target) is None or unescape(slots[target]) != item.get("target"):
            raise ManifestError(f"the alias {link!r} names a target that is no site of it")
        indexed.append((slot, link, 0, target))
    if len({slot for slot, *_ in indexed}) != len(indexed):
        raise ManifestError("two of its entries share a slot")
    counts = np.zeros(max((slot for slot, *_ in indexed), default=-1) + 1, np.int64)
    for _, slot, records in sites:
        counts[slot] = records
    for item in aliases:
        counts[item["slot"]] = item["records"]
    if int(counts.sum()) != _field(content, "records", int) or not counts[list(slots)].all():
        raise ManifestError("its record counts do not add up")
    return Manifest(
        size=_field(content, "size", int),
        mtime_ns=mtime if type(mtime) is int else None,
        format=_field(content, "format", int),
        run_id=_field(content, "run_id", str),
        shard=None if shard is None else (shard[0], shard[1]),
        host=_field(content, "host", str),
        pid=_field(content, "pid", int),
        open=_field(content, "open", bool),
        counts=counts,
        indexed=sorted(indexed),
        content=content,
        node_ranks=_node_ranks(content),
    )


def _node_ranks(content: dict[str, Any]) -> tuple[tuple[int, ...], int] | None:
    """(global ranks, world size) of a node's shard, checked; `None` for another shard."""
    if "node_ranks" not in content:
        return None
    ranks, world = content["node_ranks"], _field(content, "world_size", int)
    if not isinstance(ranks, list) or not all(type(r) is int and 0 <= r < world for r in ranks):
        raise ManifestError("its 'node_ranks' are no ranks of its 'world_size'")
    return tuple(ranks), world
