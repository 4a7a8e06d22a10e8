"""Gathering buffered chunks across ``torch.distributed`` ranks.

The tracer hands each rank's chunk (site name -> :class:`~vartrace.trace.Trace`)
to :func:`gather_chunk` every ``gathering_interval`` iterations and at exit, on
every rank.  Without an initialised process group (or with one rank) this is a
local hand-over.

How a gather travels
--------------------
Each rank other than 0 packs its chunk into one flat ``uint8`` buffer: a small
pickled header (site names, record counts, dtypes, shapes, byte offsets, and
the non-tensor leaves such as Python scalars, strings, bytes, ``None`` or
opaque objects) followed by the raw bytes of every tensor and numeric numpy
record and of the ``iterations`` / ``ranks`` / ``order`` tags.  Tensor bytes
are never pickled: bfloat16, float8, bool and complex tensors travel as
``uint8`` views of their storage.  Then two collectives run:

1. an ``all_gather`` of one ``[length, status]`` pair per rank, so that every
   rank knows the common (padded) buffer size and whether any rank failed to
   pack its chunk;
2. a ``gather`` of the padded buffers to rank 0 (split into a few rounds only
   when the padded buffers of all ranks together exceed 1 GiB, to bound the
   receive memory on rank 0).

Rank 0's own records never travel: it merges them, as they are, with the
unpacked records of the other ranks.  With NCCL the buffers live on the rank's
current CUDA device during the collectives and rank 0 copies what it receives
back to CPU memory; with gloo (or any backend that supports CPU tensors) they
stay on the CPU.  The same code serves both.

The merged chunk holds, for every site present on any rank, the records of
rank 0, then rank 1, and so on, each rank's in its capture order; sites that
only some ranks recorded are included.  Each record keeps the rank that
captured it in ``trace.ranks``.  When every rank's trace of a site was stacked
by a pre-gather callback (:func:`~vartrace.stack_tensors` /
:func:`~vartrace.stack_padded_tensors`), the merged trace is stacked too:
values are concatenated along the record dimension, padded with zeros to the
largest shape where ranks differ (``trace.shapes`` then lists the true shapes)
and the tags become 1-D ``int64`` tensors.  Otherwise the merged trace holds
lists.

Failures
--------
Every gather is a collective: all ranks must reach it, the same number of
times.  If one rank raises inside the traced step it leaves the step (and the
tracer) with that exception and does not reach the next collective.  The
other ranks then block in their next collective -- DDP's gradient all-reduce
or the next gather -- until the process group gives up: at once when the
failed process exits (gloo reports the closed connection), otherwise when the
process group's timeout expires (``init_process_group(..., timeout=
timedelta(minutes=5))``; the default is 30 minutes for gloo and 10 minutes
for NCCL, whose watchdog, with the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
tears the process down).  The collective then raises a ``RuntimeError``
(``torch.distributed.DistBackendError`` for NCCL) on each remaining rank, which
propagates out of its step, so every process ends with an error instead of
hanging forever.  The records buffered since the last completed gather are
lost on every rank; everything a post-gather callback (such as the HDF5 saver)
had already written stays on disk.  If a rank fails while packing its own
chunk (for example an opaque record that cannot be pickled), all ranks learn
it from the first collective and raise together, without waiting for a
timeout.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vartrace.trace import Trace

__all__ = ["gather_chunk", "rank", "world_size"]

_ALIGN = 64
_ROUND_BYTES = 1 << 30
_MIN_ROUND_BYTES = 1 << 20
_HEADER_PREFIX = 8

_TENSOR = "t"
_NUMPY = "n"
_OBJECT = "o"


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without an initialised process group.

    Example::

        if vartrace.distributed.rank() == 0:
            print("writing the file")
    """
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """The number of ranks, 1 without an initialised process group.

    Example::

        shards = [f"run.rank{r}.h5" for r in range(vartrace.distributed.world_size())]
    """
    return dist.get_world_size() if _active() else 1


def gather_chunk(chunk: dict[str, Trace]) -> dict[str, Trace] | None:
    """Gather every rank's chunk to rank 0.

    Must be called on every rank of the default process group, the same number
    of times.  Returns the merged chunk (site name -> :class:`Trace` holding
    the records of all ranks, rank 0's first) on rank 0 and ``None`` on the
    other ranks.  Without an initialised process group, or with a single rank,
    ``chunk`` is returned unchanged.

    Example::

        merged = gather_chunk({"forward.x": trace})
        if merged is not None:  # rank 0
            print(merged["forward.x"].ranks)  # e.g. [0, 0, 1, 1]

    Raises:
        RuntimeError: on every rank when some rank could not pack its chunk,
            or when the process group reports a failed or timed-out collective.
    """
    if not _active() or dist.get_world_size() == 1:
        return chunk
    me = dist.get_rank()
    size = dist.get_world_size()
    device = _comm_device()

    packed: _Packed | None = None
    own: dict[str, _Part] = {}
    error: Exception | None = None
    try:
        if me == 0:
            own = _parts_of_chunk(chunk)
        else:
            packed = _pack(chunk)
    except Exception as exc:
        error = exc
    length = packed.nbytes if packed is not None else 0
    status = torch.tensor([length, 0 if error is None else 1], dtype=torch.int64, device=device)
    statuses = [torch.empty_like(status) for _ in range(size)]
    dist.all_gather(statuses, status)
    table = torch.stack(statuses).cpu().tolist()
    failed = [r for r, (_, bad) in enumerate(table) if bad]
    if failed:
        if error is not None:
            raise RuntimeError(f"vartrace: rank {me} could not pack its chunk: {error}") from error
        raise RuntimeError(
            f"vartrace: rank(s) {failed} could not pack their chunk for gathering; "
            "see the error on those ranks"
        )
    lengths = [n for n, _ in table]
    received = _transfer(packed, lengths, me, size, device)
    if me != 0:
        return None
    parts_by_rank = [own]
    parts_by_rank.extend(_unpack(received[r]) for r in range(1, size))
    return _merge(parts_by_rank)


def _comm_device() -> torch.device:
    """The device the default group's collectives need their tensors on."""
    backend = str(dist.get_backend())
    if ":" in backend:
        devices = [pair.split(":", 1)[0].strip() for pair in backend.split(",")]
    else:
        devices = list(dist.Backend.backend_capability.get(backend, ["cpu"]))
    if "cpu" in devices:
        return torch.device("cpu")
    kind = devices[0]
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind, torch.accelerator.current_device_index())


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _Packed:
    """One rank's chunk as a header plus the byte views to lay out after it."""

    header: bytes
    data_start: int
    pieces: list[tuple[int, torch.Tensor]]
    nbytes: int


@dataclass
class _Part:
    """One rank's records of one site, decoded (or taken as-is on rank 0)."""

    stacked: bool
    values: Any
    iterations: Any
    ranks: Any
    order: Any
    shapes: list[tuple[int, ...]] | None

    def __len__(self) -> int:
        return len(self.iterations)


class _Layout:
    """Assigns aligned offsets to byte views in the data section of a buffer."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.size = 0

    def add(self, flat: torch.Tensor) -> int:
        offset = self.size
        self.pieces.append((offset, flat))
        self.size = _align(offset + flat.numel())
        return offset


def _tensor_bytes(value: torch.Tensor) -> torch.Tensor | None:
    """``value``'s elements as a flat ``uint8`` tensor, or None when it has no plain storage."""
    if value.layout != torch.strided or value.is_quantized or value.is_nested or value.is_meta:
        return None
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    flat = value.detach().resolve_conj().resolve_neg().reshape(-1)
    try:
        return flat.view(torch.uint8)
    except RuntimeError:
        return None


def _numpy_bytes(value: np.ndarray) -> torch.Tensor | None:
    """``value``'s elements as a flat ``uint8`` tensor, or None for object/zero-size dtypes."""
    if value.dtype.hasobject or value.dtype.itemsize == 0:
        return None
    flat = np.ascontiguousarray(value).reshape(-1)
    if not flat.flags.writeable:
        flat = flat.copy()
    return torch.from_numpy(flat.view(np.uint8))


def _encode_record(value: Any, layout: _Layout) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        flat = _tensor_bytes(value)
        if flat is not None:
            return (_TENSOR, value.dtype, tuple(value.shape), layout.add(flat), flat.numel())
    elif isinstance(value, np.ndarray):
        flat = _numpy_bytes(value)
        if flat is not None:
            return (_NUMPY, value.dtype, value.shape, layout.add(flat), flat.numel())
    return (_OBJECT, value)


def _tags_tensor(trace: Trace) -> torch.Tensor:
    """The ``iterations``, ``ranks`` and ``order`` tags as one ``(3, n)`` int64 tensor."""
    rows = []
    for tags in (trace.iterations, trace.ranks, trace.order):
        if isinstance(tags, torch.Tensor):
            rows.append(tags.detach().to("cpu", torch.int64).reshape(-1))
        else:
            rows.append(torch.as_tensor(np.asarray(tags, dtype=np.int64).reshape(-1)))
    return torch.stack(rows)


def _pack(chunk: dict[str, Trace]) -> _Packed:
    layout = _Layout()
    sites = []
    for name, trace in chunk.items():
        trace.check_lengths()
        tags = _tags_tensor(trace)
        tag_offset = layout.add(tags.reshape(-1).view(torch.uint8))
        values = trace.values
        stacked = _tensor_bytes(values) if isinstance(values, torch.Tensor) else None
        if stacked is not None:
            shapes = None if trace.shapes is None else [tuple(s) for s in trace.shapes]
            payload: Any = (values.dtype, tuple(values.shape), layout.add(stacked), shapes)
        else:
            payload = [_encode_record(value, layout) for value in values]
        sites.append((name, stacked is not None, len(trace), tag_offset, payload))
    header = pickle.dumps(sites, protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(_HEADER_PREFIX + len(header))
    return _Packed(header, data_start, layout.pieces, data_start + layout.size)


def _fill(packed: _Packed, out: torch.Tensor) -> None:
    """Lay ``packed`` out at the start of the flat ``uint8`` buffer ``out``."""
    prefix = len(packed.header).to_bytes(_HEADER_PREFIX, "little")
    head = torch.frombuffer(bytearray(prefix + packed.header), dtype=torch.uint8)
    out[: head.numel()].copy_(head)
    for offset, flat in packed.pieces:
        start = packed.data_start + offset
        out[start : start + flat.numel()].copy_(flat)
    out[packed.nbytes :].zero_()


def _transfer(
    packed: _Packed | None, lengths: list[int], me: int, size: int, device: torch.device
) -> list[torch.Tensor]:
    """Gather the packed buffers of ranks 1.. to rank 0 as CPU ``uint8`` tensors.

    Returns one buffer per rank on rank 0 (rank 0's own entry holds nothing
    useful) and an empty list elsewhere.  Decoding copies every record out of
    these buffers, so records own their memory and the buffers die with the round.
    """
    padded = max(lengths)
    step = max(_MIN_ROUND_BYTES, _ROUND_BYTES // size)
    bounds = [(start, min(start + step, padded)) for start in range(0, padded, step)]
    send = torch.empty(padded, dtype=torch.uint8, device=device)
    if packed is not None:
        _fill(packed, send)
    if len(bounds) == 1 and device.type == "cpu":
        slots = [torch.empty(padded, dtype=torch.uint8) for _ in range(size)] if me == 0 else None
        dist.gather(send, slots, dst=0)
        return slots or []
    out = [torch.empty(n, dtype=torch.uint8) for n in lengths] if me == 0 else []
    for start, stop in bounds:
        staging = None
        if me == 0:
            staging = [torch.empty(stop - start, dtype=torch.uint8, device=device) for _ in lengths]
        dist.gather(send[start:stop], staging, dst=0)
        if staging is None:
            continue
        for buffer, slot, n in zip(out, staging, lengths, strict=True):
            valid = min(n, stop) - start
            if valid > 0:
                buffer[start : start + valid].copy_(slot[:valid])
    return out


def _unpack(buffer: torch.Tensor) -> dict[str, _Part]:
    header_len = int.from_bytes(buffer[:_HEADER_PREFIX].numpy().tobytes(), "little")
    sites = pickle.loads(buffer[_HEADER_PREFIX : _HEADER_PREFIX + header_len].numpy())
    data = buffer[_align(_HEADER_PREFIX + header_len) :]
    parts = {}
    for name, stacked, count, tag_offset, payload in sites:
        tags = data[tag_offset : tag_offset + 3 * count * 8].view(torch.int64).reshape(3, count)
        if stacked:
            dtype, shape, offset, shapes = payload
            values = _tensor_at(data, offset, dtype, shape)
            tags = tags.clone()
            parts[name] = _Part(True, values, tags[0], tags[1], tags[2], shapes)
        else:
            values = [_decode_record(data, entry) for entry in payload]
            iterations, ranks, order = tags.tolist()
            parts[name] = _Part(False, values, iterations, ranks, order, None)
    return parts


def _tensor_at(data: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return data[offset : offset + nbytes].view(dtype).reshape(shape).clone()


def _decode_record(data: torch.Tensor, entry: tuple[Any, ...]) -> Any:
    kind = entry[0]
    if kind == _TENSOR:
        _, dtype, shape, offset, _ = entry
        return _tensor_at(data, offset, dtype, shape)
    if kind == _NUMPY:
        _, dtype, shape, offset, nbytes = entry
        return data[offset : offset + nbytes].numpy().view(dtype).reshape(shape).copy()
    return entry[1]


def _parts_of_chunk(chunk: dict[str, Trace]) -> dict[str, _Part]:
    """Rank 0's own chunk in the merge's terms, without copying any value."""
    parts = {}
    for name, trace in chunk.items():
        trace.check_lengths()
        stacked = isinstance(trace.values, torch.Tensor)
        if stacked:
            tags = _tags_tensor(trace)
            parts[name] = _Part(True, trace.values, tags[0], tags[1], tags[2], trace.shapes)
        else:
            parts[name] = _Part(
                False,
                list(trace.values),
                _int_list(trace.iterations),
                _int_list(trace.ranks),
                _int_list(trace.order),
                None,
            )
    return parts


def _int_list(tags: Any) -> list[int]:
    return tags.tolist() if isinstance(tags, torch.Tensor) else [int(t) for t in tags]


def _merge(parts_by_rank: list[dict[str, _Part]]) -> dict[str, Trace]:
    names: dict[str, None] = {}
    for parts in parts_by_rank:
        names.update(dict.fromkeys(parts))
    return {
        name: _merge_site([parts[name] for parts in parts_by_rank if name in parts])
        for name in names
    }


def _merge_site(parts: list[_Part]) -> Trace:
    filled = [part for part in parts if len(part)]
    if not filled:
        first = parts[0]
        if first.stacked:
            empty = torch.zeros(0, dtype=torch.int64)
            return Trace(first.values, empty, empty.clone(), empty.clone(), first.shapes)
        return Trace()
    if all(part.stacked for part in filled) and _stackable(filled):
        return _concat_stacked(filled)
    trace = Trace()
    for part in filled:
        trace.values.extend(_records(part))
        trace.iterations.extend(_int_list(part.iterations))
        trace.ranks.extend(_int_list(part.ranks))
        trace.order.extend(_int_list(part.order))
    return trace


def _stackable(parts: list[_Part]) -> bool:
    first = parts[0].values
    return all(
        part.values.dtype == first.dtype
        and part.values.dim() == first.dim()
        and part.values.device == first.device
        for part in parts
    )


def _concat_stacked(parts: list[_Part]) -> Trace:
    dims = [tuple(part.values.shape[1:]) for part in parts]
    target = tuple(max(sizes) for sizes in zip(*dims, strict=True))
    padded = any(dim != target for dim in dims) or any(p.shapes is not None for p in parts)
    if all(dim == target for dim in dims):
        values = torch.cat([part.values for part in parts])
    else:
        total = sum(len(part) for part in parts)
        first = parts[0].values
        values = first.new_zeros((total, *target))
        start = 0
        for part in parts:
            n = len(part)
            region = (slice(start, start + n), *(slice(0, size) for size in part.values.shape[1:]))
            values[region] = part.values
            start += n
    shapes = None
    if padded:
        shapes = []
        for part, dim in zip(parts, dims, strict=True):
            shapes.extend(
                [tuple(s) for s in part.shapes] if part.shapes is not None else [dim] * len(part)
            )
    return Trace(
        values,
        torch.cat([torch.as_tensor(part.iterations) for part in parts]),
        torch.cat([torch.as_tensor(part.ranks) for part in parts]),
        torch.cat([torch.as_tensor(part.order) for part in parts]),
        shapes,
    )


def _records(part: _Part) -> list[Any]:
    """A part's values as a list of records, stacked values cut back to their true shapes."""
    if not part.stacked:
        return part.values
    if part.shapes is None:
        return list(part.values.unbind(0))
    return [
        value[tuple(slice(0, size) for size in shape)]
        for value, shape in zip(part.values.unbind(0), part.shapes, strict=True)
    ]
