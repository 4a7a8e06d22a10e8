"""The on-disk layout shared by the writer and the reader.


```python
/                     attrs: vartrace_format, vartrace_version, writer_host, writer_pid,
                      run_id (one id per run: every shard of a sharded run holds the
                      same when the ranks share a process group, "" when that is unknown),
                      shard (int64 [rank, world size]: only in a shard of a sharded run;
                      [node, number of nodes] in a node's shard, gather="node", which
                      also holds node_ranks, int64 (ranks,): the global ranks whose
                      records it holds, and world_size, the run's number of ranks),
                      last_tags (int64 [largest iteration, largest capture order,
                      sum of /committed] as of the last flush, so that appending needs
                      no walk of the sites; absent in older files, and not trusted when
                      its sum is not /committed's: then the sites' tags are read)
/committed            int64 (slots,): records of each site as of the last flush;
                      rows past it were not flushed and are ignored (an alias: 1 while
                      it holds, 0 once replaced)
/site_index           int64 (slots, 4): per slot, the start and end of its link name in
                      /site_names, the capture order of its first record, and -1, or for
                      an alias the slot of its target (the root index; files written
                      without it are read by walking /vars)
/site_names           uint8 (bytes,): the slots' escaped link names (UTF-8), one after
                      another
/meta/...             run metadata (written once per file)
/vars/<escaped name>  attrs: name (the true site name), slot (its entry in /committed);
                      for records a pre-save callback made (statistics rows):
                      reduced_dtype (str) and reduced_shape (int64 (ndim,), -1 on
                      axes whose size differed; absent when the ndim did) of the values;
                      for a DTensor's local shards (each rank's): placements (str,
                      "Shard(dim=0)", "; " between mesh dimensions), mesh_shape,
                      mesh_ranks (the global rank at each mesh coordinate, row by
                      row) and global_shape (int64 (n,) each)
    tags                       int64 (records, 4): per record, its iteration, rank,
                               capture order and kind (_codec.Kind) (version 2)
    iterations, ranks, order   int64 (records,)  } version 1, instead of ``tags``
    kinds                      uint8 (records,)  }
    values                     records x padded shape (numeric), or (records,) of
                               UTF-8 strings, or (records,) of byte blobs
    shapes                     int64 (records, ndim): true shape of each record
                               (-1 where the record is not in ``values``); absent
                               when records are 0-d, and in version 2 until a record
                               in ``values`` is not of its row shape (absent: every
                               record in ``values`` has the row shape, the others -1)
    other                      (records,) byte blobs of records that did not fit
                               ``values`` (another dtype or kind); absent until needed
```

Version 2 (`FORMAT_VERSION`) differs from version 1 in the per-site datasets only: one
`tags` dataset for the four per-record tags, and `shapes` written lazily, so a site of
uniform records holds two datasets written a gather, not six.  Its record axis is
labelled by a dimension-only scale `records` (never grown; netCDF tools size it by the
datasets using it), where version 1 labels it by `iterations`.  A file never mixes
layouts: appending to a version-1 file writes version 1.  A reader of a file being
written sees a record's tags and values together: both are written before the flush
that precedes its count in `/committed`.

The root index lets a reader list a run of many sites without opening each
site's group: the names, their execution order and the aliases are read from two
datasets.  It is crash-safe as `/committed` is: a slot's row and name bytes are
written before the flush that precedes its first nonzero count, and never change
once counted, so a reader trusts the rows of counted slots only (a slot a killed
writer defined but never counted is ignored, and redefined when a later session
reuses it).  An alias (a site name that reads as another site's records, stored
once: `H5PYSaverCallback.alias`) is a slot of its own with no group, counted 1
while it holds; changing it (another target, or records of its own) takes a new
slot, and the old slot's count drops to 0 in the same commit.  Should a commit be
cut between two chunks of `/committed`, a reader prefers a site of its own over
an alias of the same name, and the later alias over an earlier one; an alias whose
target is not counted is left out.  Files without aliases hold no alias rows, and
an older vartrace, which walks `/vars`, reads every site of a file but its aliases.

Files are written with HDF5's SWMR mode on, so a killed writer leaves a
consistent file; such a file carries "open for writing" flags in its
superblock that plain (non-SWMR) opening refuses: `clear_write_flags`
clears them once the writer is known to be gone, as HDF5's `h5clear` does.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vartrace._support.warnings import warn
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom

__all__ = [
    "COMMITTED",
    "FIRST_ORDER",
    "FORMAT_ATTR",
    "FORMAT_VERSION",
    "GLOBAL_SHAPE",
    "LAST_TAGS",
    "LIBVER",
    "MESH_RANKS",
    "MESH_SHAPE",
    "NAME_END",
    "NAME_START",
    "NODE_RANKS_ATTR",
    "NO_TARGET",
    "PLACEMENTS",
    "REDUCED_DTYPE",
    "REDUCED_SHAPE",
    "RUN_ID_ATTR",
    "SHARD_ATTR",
    "SIGNATURE",
    "SITE_INDEX",
    "SITE_NAMES",
    "TAGGED",
    "TAGS",
    "TARGET",
    "WORLD_SIZE_ATTR",
    "clear_write_flags",
    "escape",
    "has_write_flags",
    "node_attrs",
    "node_shard_path",
    "placement_attrs",
    "placement_of",
    "reduced_from",
    "run_attrs",
    "shard_path",
    "unescape",
    "write_flags_in",
    "writer_alive",
]

COMMITTED = "committed"
SITE_INDEX = "site_index"
SITE_NAMES = "site_names"
#: Columns of /site_index: a slot's link name (start, end in /site_names), the capture
#: order of its first record, its alias target's slot (-1: none).
NAME_START, NAME_END, FIRST_ORDER, TARGET = range(4)
NO_TARGET = -1
FORMAT_ATTR = "vartrace_format"
FORMAT_VERSION = 2
LIBVER = ("v110", "latest")  # the oldest file format that allows SWMR
#: A record's tags: one dataset each in a version-1 file, the columns of TAGGED in version 2.
TAGS = ("iterations", "ranks", "order", "kinds")
TAGGED = "tags"
LAST_TAGS = "last_tags"
REDUCED_DTYPE = "reduced_dtype"
REDUCED_SHAPE = "reduced_shape"
PLACEMENTS = "placements"  # a DTensor site's placements, "; " between mesh dimensions
MESH_SHAPE = "mesh_shape"
MESH_RANKS = "mesh_ranks"
GLOBAL_SHAPE = "global_shape"

_ESCAPED = re.compile(r"%u([0-9A-F]{4})|%([0-9A-F]{2})")
_SURROGATE = re.compile("[\ud800-\udfff]")


def escape(name: str) -> str:
    """An HDF5 link name for a site name, reversibly.

    `%`, `/` and NUL are %-escaped, and a lone surrogate (a key decoded by
    `os.fsdecode`, which UTF-8 cannot hold) becomes `%uDCxx`.
    Example: `escape("forward.a/b") == "forward.a%2Fb"`.
    """
    if not name:
        return "%"
    if set(name) == {"."}:
        return "%2E" * len(name)
    link = name.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    return _SURROGATE.sub(lambda match: f"%u{ord(match.group()):04X}", link)


def unescape(link: str) -> str:
    """The site name of an HDF5 link name made by `escape`."""
    if "%" not in link:  # most names: nothing escaped
        return link
    if link == "%":
        return ""
    return _ESCAPED.sub(lambda match: chr(int(match.group(1) or match.group(2), 16)), link)


def _text(attrs: Mapping[str, Any], name: str) -> str | None:
    """The string attribute `name` of `attrs` (`None` if absent); `ValueError` if it is
    something else."""
    value = attrs.get(name)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"attribute {name} is {value!r}, not a string")
    return value


def reduced_from(attrs: Mapping[str, Any]) -> ReducedFrom | None:
    """The description of a site's reduced values held in its group's `attrs`, if any.

    Raises `ValueError` naming the attribute that is not what the writer makes.
    """
    dtype = _text(attrs, REDUCED_DTYPE)
    if dtype is None:
        return None
    shape = attrs.get(REDUCED_SHAPE)
    if shape is None:
        return ReducedFrom(dtype, None)
    sizes = np.asarray(shape)
    if sizes.ndim != 1 or sizes.dtype.kind not in "iu":
        raise ValueError(f"attribute {REDUCED_SHAPE} is {shape!r}, not a 1-D array of integers")
    return ReducedFrom(dtype, tuple(int(size) for size in sizes))


def placement_attrs(placement: Placement) -> dict[str, Any]:
    """The attributes of a site's group that hold `placement` (`placements` last: a
    reader takes a group with it for one holding them all)."""
    return {
        MESH_SHAPE: np.asarray(placement.mesh_shape, np.int64),
        MESH_RANKS: np.asarray(placement.mesh_ranks, np.int64),
        GLOBAL_SHAPE: np.asarray(placement.shape, np.int64),
        PLACEMENTS: "; ".join(placement.placements),
    }


def placement_of(attrs: Mapping[str, Any]) -> Placement | None:
    """The placement of the DTensor whose local shards a site's records are, held in its
    group's `attrs`, if any.

    Raises `ValueError` naming the attribute that is not what the writer makes.
    """
    placements = _text(attrs, PLACEMENTS)
    if placements is None:
        return None
    sizes = []
    for name in (MESH_SHAPE, MESH_RANKS, GLOBAL_SHAPE):
        found = np.asarray(attrs.get(name, np.zeros((0, 0))))
        if found.ndim != 1 or (found.size and found.dtype.kind not in "iu"):
            raise ValueError(f"attribute {name} is {found!r}, not a 1-D array of integers")
        sizes.append(tuple(int(size) for size in found))
    return Placement(tuple(placements.split("; ")), *sizes)


def shard_path(path: Path, rank: int) -> Path:
    """The file one rank writes in a sharded run: `run.h5` -> `run.rank3.h5`.

    A path that already names a rank (`f"run.rank{rank}.h5"`) gives the same file.
    """
    stem = re.sub(r"\.rank\d+$", "", path.stem)
    return path.with_name(f"{stem}.rank{rank}{path.suffix}")


def node_shard_path(path: Path, node: int) -> Path:
    """The file one node writes with `gather="node"`: `run.h5` -> `run.node1.h5`.

    A path that already names the node (`f"run.node{node}.h5"`) gives the same file.
    """
    stem = re.sub(r"\.node\d+$", "", path.stem)
    return path.with_name(f"{stem}.node{node}{path.suffix}")


RUN_ID_ATTR = "run_id"
SHARD_ATTR = "shard"
NODE_RANKS_ATTR = "node_ranks"
WORLD_SIZE_ATTR = "world_size"
_RUN_KEYS = itertools.count()  # the n-th sharded file this process starts: the same on each rank
_SHARD_NAME = re.compile(r"\.(?:rank|node)\d+$")  # what names a rank's or a node's shard


def run_attrs(path: Path, rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    """The root attributes naming the run a new file belongs to, and a shard's rank.

    A single file gets a fresh id.  The shards of a sharded run share one: the
    first rank to start writes it to the process group's key-value store
    (`torch.distributed`), the others read it there, with no collective; ""
    without a process group.  Example:

    ```python
    handle.attrs.update(run_attrs(path, rank=3, world_size=8, sharded=True))
    ```
    """
    if not sharded:
        return {RUN_ID_ATTR: uuid.uuid4().hex}
    return {RUN_ID_ATTR: _run_id(path), SHARD_ATTR: [rank, world_size]}


def node_attrs(
    path: Path, node: int, nodes: int, ranks: Sequence[int], world_size: int
) -> dict[str, Any]:
    """The root attributes of a node's shard (`gather="node"`): the run's id, shared by
    every node's shard as `run_attrs` shares it, `[node, nodes]`, the node's ranks and
    the run's world size.  Example:

    ```python
    handle.attrs.update(node_attrs(path, node=1, nodes=2, ranks=[2, 3], world_size=4))
    ```
    """
    return {
        RUN_ID_ATTR: _run_id(path),
        SHARD_ATTR: [node, nodes],
        NODE_RANKS_ATTR: np.asarray(ranks, np.int64),
        WORLD_SIZE_ATTR: world_size,
    }


def _run_id(path: Path) -> str:
    """The id the shards of the sharded run of `path` share (see `run_attrs`)."""
    stem = _SHARD_NAME.sub("", path.stem)
    return _shared_id(f"vartrace/run_id/{next(_RUN_KEYS)}/{stem}{path.suffix}", path)


def _shared_id(key: str, path: Path) -> str:
    """An id every rank of the process group reads under `key`; "" without a group, and
    "" with a warning where the group's store cannot be reached (the rank hosting it,
    rank 0, already destroyed the group: a rank that lags behind, with no collective
    between them since)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return ""
    try:
        store = dist.distributed_c10d._get_default_store()
        shared = store.compare_set(key, "", uuid.uuid4().hex)  # the first rank's id stays
    except (AttributeError, RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warn(
            f"vartrace: {path} is written without its run's id: the process group's store "
            f"did not answer ({type(error).__name__}: {reason}); vartrace.open will take "
            "it for a shard of another run.  Keep the process group until every rank "
            "created its file (dist.barrier() before destroy_process_group())",
            RuntimeWarning,
        )
        return ""
    return bytes(shared).decode("ascii", "replace")


def writer_alive(host: str, pid: int) -> bool | None:
    """Whether the process that last opened a file for writing still runs.

    `None` when that cannot be told (it ran on another host).
    """
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def _lookup3(data: bytes) -> int:
    """Bob Jenkins' lookup3 `hashlittle` (initval 0): HDF5's metadata checksum."""
    mask = 0xFFFFFFFF
    a = b = c = (0xDEADBEEF + len(data)) & mask
    words = data + bytes(-len(data) % 12)
    blocks = max(1, -(-len(data) // 12))
    for index in range(blocks):
        x, y, z = (
            int.from_bytes(words[12 * index + 4 * i : 12 * index + 4 * i + 4], "little")
            for i in range(3)
        )
        a, b, c = (a + x) & mask, (b + y) & mask, (c + z) & mask
        if index == blocks - 1:
            break
        a = (a - c) & mask ^ _rot(c, 4)
        c = (c + b) & mask
        b = (b - a) & mask ^ _rot(a, 6)
        a = (a + c) & mask
        c = (c - b) & mask ^ _rot(b, 8)
        b = (b + a) & mask
        a = (a - c) & mask ^ _rot(c, 16)
        c = (c + b) & mask
        b = (b - a) & mask ^ _rot(a, 19)
        a = (a + c) & mask
        c = (c - b) & mask ^ _rot(b, 4)
        b = (b + a) & mask
    if not data:
        return c
    c = (c ^ b) - _rot(b, 14) & mask
    a = (a ^ c) - _rot(c, 11) & mask
    b = (b ^ a) - _rot(a, 25) & mask
    c = (c ^ b) - _rot(b, 16) & mask
    a = (a ^ c) - _rot(c, 4) & mask
    b = (b ^ a) - _rot(a, 14) & mask
    c = (c ^ b) - _rot(b, 24) & mask
    return c


SIGNATURE = b"\x89HDF\r\n\x1a\n"


def has_write_flags(path: Path) -> bool:
    """Whether the superblock says a writer has the file open (or was killed)."""
    with open(path, "rb") as handle:
        return write_flags_in(handle.read(12))


def write_flags_in(head: bytes) -> bool:
    """Whether a file's first 12 bytes `head` say a writer has it open (or was killed):
    the status flags of a version 2 or 3 superblock."""
    return len(head) == 12 and head[:8] == SIGNATURE and head[8] in (2, 3) and head[11] != 0


def clear_write_flags(path: Path) -> bool:
    """Clear the superblock's "open for writing" flags left by a killed writer.

    What `h5clear -s` does, for superblock versions 2 and 3 (the ones with
    flags and a checksum).  Only call it when no process writes the file.
    Returns whether anything was cleared.
    """
    with open(path, "r+b") as handle:
        head = bytearray(handle.read(12))
        if head[:8] != SIGNATURE or head[8] not in (2, 3) or head[11] == 0:
            return False
        offsets = head[9]
        body = head + handle.read(4 * offsets)
        body[11] = 0
        handle.seek(0)
        handle.write(bytes(body) + _lookup3(bytes(body)).to_bytes(4, "little"))
        handle.flush()
        os.fsync(handle.fileno())
    return True
