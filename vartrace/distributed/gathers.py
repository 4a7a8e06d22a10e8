"""Gathering buffered chunks across `torch.distributed` ranks.

The tracer hands each rank's chunk (site name -> [`Trace`][vartrace.Trace])
to `gather_chunk` every `gathering_interval` iterations, on every rank,
and to `final_gathers` at exit.  Without an initialised process group (or
with one rank) this is a local hand-over.

How a gather travels
--------------------
Each rank other than 0 packs its chunk: a small pickled header (site names,
record counts, dtypes, shapes, where each record's bytes are, the
non-tensor leaves: Python scalars, strings, bytes, `None`, opaque objects,
and the facts about sites the tracer sends along: aliases, reductions)
followed, in one flat `uint8` buffer, by the `iterations` / `ranks` /
`order` tags and the bytes of small tensor and numeric numpy records.
Records of 256 KiB or more are not copied into that buffer: they travel as
messages of their own, straight from their storage, and rank 0 receives them
straight into freshly allocated tensors of their final dtype and shape.
Tensor bytes are never pickled: tensors of any dtype (bfloat16, float8, bool
and complex included) travel as `uint8` views of their storage; only
tensors without plain strided storage (sparse, quantized, nested, tensor
subclasses) travel pickled, as opaque objects.  The exchange:

1. an `all_gather` of one `[length, status, done]` triple per rank, so
   that rank 0 knows every buffer's size and every rank knows whether any rank
   failed to pack its chunk, and which ranks are done (see below);
2. one batch of point-to-point operations (`batch_isend_irecv`): each rank
   sends its packed buffer, at its exact size, to rank 0 (a rank with an
   empty chunk and no facts sends nothing);
3. a second batch: the large records, whose sizes rank 0 read from the
   buffers.

Batches are cut into rounds of at most 1 GiB in flight, which bounds the
device memory rank 0 needs with NCCL.  (Point-to-point rather than
`dist.gather`: a gather needs equal sizes, so uneven ranks would pad to
the largest buffer, and gloo's gather measured about 5x slower than
point-to-point for 64 MB per rank.)

Rank 0's own records never travel: it merges them, as they are (and where
they are), with the unpacked records of the other ranks.  With NCCL the
buffers live on the rank's current CUDA device during the transfer (call
`torch.cuda.set_device(local_rank)` before tracing, as NCCL requires anyway)
and rank 0 copies what it receives back to CPU memory, so the other ranks'
records arrive as CPU tensors; with gloo (or any backend that supports CPU
tensors) the buffers stay on the CPU.  The same code serves both.

The merged chunk holds, for every site present on any rank, the records of
rank 0, then rank 1, and so on, each rank's in its capture order; sites that
only some ranks recorded are included.  Each record keeps the rank that
captured it in `trace.ranks`.  When every rank's trace of a site was stacked
by a pre-gather callback ([`stack_tensors`][vartrace.stack_tensors] /
[`stack_padded_tensors`][vartrace.stack_padded_tensors]), the merged trace is stacked too:
values are concatenated along the record dimension, padded with zeros to the
largest shape where ranks differ (`trace.shapes` then lists the true shapes)
and the tags become 1-D `int64` tensors.  Otherwise the merged trace holds
lists.

Ranks that run different numbers of iterations
----------------------------------------------
Evaluation shards of different sizes, or generation that stops early on one
rank, make the ranks reach different numbers of periodic gathers.  Gathers
never assume that the ranks step in lockstep: each rank's gathers pair, in
order, with the other ranks' gathers, whatever iterations they hold (every
record carries its own iteration and rank).  At exit, a rank calls
`final_gathers`: its first gather carries its last chunk and says, in the
exchange of step 1, that this rank is done; then it joins, with nothing to
send, every gather of the ranks still running, until every rank has said it
is done, and all of them leave together.  A rank that finishes early so waits
at exit for the others, as it would in a barrier; no collective is added to
any step.  The wait is bounded by the group's timeout (the tracer's own group,
with asynchronous staging, takes the default group's; an NCCL default group's
watchdog ends the process at its timeout instead): when a rank does not come
(stuck, or gone), the exchange fails, every rank that waited warns
naming the ranks not known to be done, rank 0 hands on what it holds, and a
rank whose last chunk could not be sent keeps it (in `tracer.results` on
that rank).

Failures
--------
Every gather is a collective: all ranks must reach it (a rank that is done
reaches it from `final_gathers`).  If one rank raises inside the traced
step it leaves the step (and the tracer) with that exception and does not
reach the next collective.  The other ranks then block in their next
collective -- DDP's gradient all-reduce or the next gather -- until the
process group gives up: at once when the failed process exits (gloo reports
the closed connection), otherwise when the process group's timeout expires
(`init_process_group(..., timeout=timedelta(minutes=5))`; the default is 30
minutes for gloo and 10 minutes for NCCL, whose watchdog, with the default
`TORCH_NCCL_ASYNC_ERROR_HANDLING`, tears the process down).  The collective
then raises a `RuntimeError` (`torch.distributed.DistBackendError` for
NCCL) on each remaining rank, which propagates out of its step, so every
process ends with an error instead of hanging forever.  The records buffered
since the last completed gather are lost on every rank; everything a
post-gather callback (such as the HDF5 saver) had already written stays on
disk.  If a rank fails while packing its own chunk (for example an opaque
record that cannot be pickled), all ranks learn it from the first collective
and raise together, without waiting for a timeout.  If rank 0 cannot unpickle
what a rank sent (an opaque record whose class only exists on that rank), it
still completes the transfer, then raises alone; the other ranks' gather has
returned, and they meet the failure as above at their next collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vartrace._support.warnings import warn
from vartrace.trace import Trace, join_traces

__all__ = ["final_gathers", "gather_chunk", "new_host_group", "rank", "world_size"]

#: What a rank knows about a site beside its records: `(kind, site, fact)`.
Fact = tuple[str, str, Any]

_ALIGN = 64
_ROUND_BYTES = 1 << 30
_DIRECT_BYTES = 1 << 18

_TENSOR = "t"
_NUMPY = "n"
_OBJECT = "o"


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without an initialised process group.

    Example:
        ```python
        if vartrace.distributed.gathers.rank() == 0:
            print("writing the file")
        ```
    """
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """The number of ranks, 1 without an initialised process group.

    Example:
        ```python
        shards = [f"run.rank{r}.h5" for r in range(vartrace.distributed.gathers.world_size())]
        ```
    """
    return dist.get_world_size() if _active() else 1


def new_host_group() -> Any:
    """A gloo process group of every rank, for gathers that run beside the training's own.

    Collectives on one group must come in the same order on every rank: a
    thread gathering on the group that DDP's all-reduces use could interleave
    with them.  A group of its own, on the host, also never stages through
    device memory.  A collective call: every rank must make it, at the same
    point.  Its timeout is the default group's (``init_process_group(...,
    timeout=)``), which so bounds the gathers' waits as it bounds the training's.
    Example:
        ```python
        group = new_host_group()
        merged = gather_chunk(chunk, group)
        ```
    """
    return dist.new_group(backend="gloo", timeout=_timeout())


def _timeout() -> timedelta | None:
    """The default group's timeout (`None`, torch's default, where it cannot be read)."""
    world = dist.group.WORLD
    if world is None:
        return None
    try:
        timeout = world._get_backend(_comm_device(None)).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def gather_chunk(
    chunk: dict[str, Trace], group: Any = None, *, facts: list[Fact] | None = None
) -> dict[str, Trace] | None:
    """Gather every rank's chunk to rank 0.

    Must be called on every rank of `group` (a group of every rank; `None`
    is the default process group), the same number of times, unless a rank
    has left for `final_gathers`, which joins the gathers of the others.
    Returns the merged chunk (site name -> [`Trace`][vartrace.Trace] holding the records
    of all ranks, rank 0's first) on rank 0 and `None` on the other ranks.
    Without an initialised process group, or with a single rank, `chunk` is
    returned unchanged.

    `facts`: what this rank knows about its sites beside the records, as
    `(kind, site, fact)` triples of picklable objects (the tracer sends its
    aliases and the descriptions of reduced values).  They travel with the
    chunk (a rank with facts but no records sends them alone); on rank 0 the
    list is extended in place with every other rank's, in rank order.

    Example:
        ```python
        merged = gather_chunk({"forward.x": trace})
        if merged is not None:  # rank 0
            print(merged["forward.x"].ranks)  # e.g. [0, 0, 1, 1]
        ```

    Raises:
        RuntimeError: on every rank when some rank could not pack its chunk,
            or when the process group reports a failed or timed-out collective.
    """
    if not _active() or dist.get_world_size() == 1:
        return chunk
    return _gather(chunk, group, final=False, facts=facts)[0]


def final_gathers(
    chunk: dict[str, Trace], group: Any = None, *, facts: list[Fact] | None = None
) -> Iterator[tuple[dict[str, Trace], bool]]:
    """A rank's last gathers: its `chunk`, then empty ones until every rank has sent its last.

    Ranks may run different numbers of iterations (evaluation shards of
    different sizes, generation that stops early on one rank), and so make
    different numbers of periodic `gather_chunk` calls.  A rank that
    is done calls this instead: its first gather carries `chunk` and says
    that this rank is done; then it joins, with nothing to send, each gather
    that the ranks still running make, until every rank has said it is done.
    The ranks learn who is done from the exchange that every gather starts
    with, so no collective is added.  Must be called once on every rank of
    `group` (as `gather_chunk`), at the end.

    Yields `(records, gathered)` after each gather: on rank 0 the merged
    chunk and `True`, on the other ranks an empty chunk and `False`.  The
    wait for ranks still running is bounded by the group's timeout: if a
    gather fails there (a rank never came, or its process is gone), this
    warns, naming the ranks not known to be done, and stops; a chunk not yet
    sent is yielded back, on rank 0 as gathered (its own records, for the
    file), on the other ranks with `False` (records to keep where they
    are).  Without an initialised process group, or with a single rank, it
    yields `(chunk, True)` once.  `facts` travel with `chunk` as with
    `gather_chunk`: on rank 0 the list grows after each gather that brought some.

    Example:
        ```python
        for records, gathered in final_gathers(chunk):
            for name, trace in records.items():
                (save if gathered else keep)(name, trace)
        ```

    Raises:
        RuntimeError: as `gather_chunk`, for a failure after the ranks met.
    """
    if not _active() or dist.get_world_size() == 1:
        yield chunk, True
        return
    me = dist.get_rank()
    running = [r for r in range(dist.get_world_size()) if r != me]
    own = chunk
    while running:
        try:
            merged, done = _gather(own, group, final=True, facts=facts)
        except _Unmet as unmet:
            _warn_unmet(me, running, own, unmet.__cause__)
            if own:
                yield own, me == 0
            return
        own = {}
        if me:
            facts = None  # sent with the chunk; rank 0's list gathers the others'
        yield ({}, False) if merged is None else (merged, True)
        running = [r for r, finished in enumerate(done) if not finished]


class _Unmet(Exception):
    """The exchange that starts a final gather failed: some rank did not come."""


def _warn_unmet(
    me: int, running: list[int], own: dict[str, Trace], error: BaseException | None
) -> None:
    count = sum(len(trace) for trace in own.values())
    if me:
        kept = (
            f"this rank's last {count} records stay in tracer.results on rank {me}"
            if own
            else "this rank had sent all its records"
        )
    else:
        kept = (
            "the records those ranks took since their last gather are not in rank 0's "
            "results (a rank that reaches its own final gather keeps them in its "
            "tracer.results)"
        )
        if own:
            kept = f"rank 0 hands on its own last {count} records alone; {kept}"
    warn(
        f"vartrace: rank(s) {running} did not come to the final gathers before the process "
        f"group gave up ({type(error).__name__}: {error}); {kept}",
        RuntimeWarning,
    )


def _gather(
    chunk: dict[str, Trace], group: Any, *, final: bool, facts: list[Fact] | None
) -> tuple[dict[str, Trace] | None, list[bool]]:
    """One gather: the merged chunk (`None` except on rank 0) and which ranks are done.

    `final`: this rank is done (it sends its last chunk or nothing).  A rank
    other than 0 with an empty chunk and no `facts` sends nothing; on rank 0,
    `facts` is extended with the others'.  If the first exchange
    fails in a final gather, raises `_Unmet` (the cause is the error).
    """
    me = dist.get_rank()
    size = dist.get_world_size()
    device = _comm_device(group)

    packed: _Packed | None = None
    own: dict[str, _Part] = {}
    error: Exception | None = None
    try:
        if me == 0:
            own = _parts_of_chunk(chunk)
        elif chunk or facts:
            packed = _pack(chunk, facts or [])
    except Exception as exc:
        error = exc
    length = packed.nbytes if packed is not None else 0
    status = torch.tensor([length, error is not None, final], dtype=torch.int64, device=device)
    statuses = [torch.empty_like(status) for _ in range(size)]
    try:
        dist.all_gather(statuses, status, group=group)
    except RuntimeError as exc:
        if final:
            raise _Unmet() from exc
        raise
    table = torch.stack(statuses).cpu().tolist()
    done = [bool(finished) for _, _, finished in table]
    failed = [r for r, (_, bad, _) in enumerate(table) if bad]
    if failed:
        if error is not None:
            raise RuntimeError(f"vartrace: rank {me} could not pack its chunk: {error}") from error
        raise RuntimeError(
            f"vartrace: rank(s) {failed} could not pack their chunk for gathering; "
            "see the error on those ranks"
        )
    if packed is not None:
        _send_all([_buffer(packed)], device, group)
        _send_all(packed.direct, device, group)
    if me != 0:
        return None, done
    buffers = {r: torch.empty(n, dtype=torch.uint8) for r, (n, _, _) in enumerate(table) if n}
    _receive_all([[buffers[r]] if r in buffers else [] for r in range(size)], device, group)
    decoders = {sender: _Decoder(buffer) for sender, buffer in buffers.items()}
    parts_by_rank = [own]
    failure: tuple[int, Exception] | None = None
    for sender, decoder in decoders.items():
        try:
            parts_by_rank.append(decoder.parts())
        except Exception as exc:
            failure = failure or (sender, exc)
    targets = [decoders[r].targets if r in decoders else [] for r in range(size)]
    _receive_all(targets, device, group)
    if failure is None and facts is not None:
        for sender in sorted(decoders):
            facts.extend(decoders[sender].facts)
    if failure is not None:
        sender, error = failure
        raise RuntimeError(
            f"vartrace: rank 0 could not unpack the chunk of rank {sender}: {error}"
        ) from error
    return _merge(parts_by_rank), done


def _comm_device(group: Any) -> torch.device:
    """The device the group's collectives need their tensors on."""
    backend = str(dist.get_backend(group))
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
    """One rank's chunk: a header, small byte views laid out after it, large ones apart."""

    header: bytes
    data_start: int
    pieces: list[tuple[int, torch.Tensor]]
    direct: list[torch.Tensor]
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
    """Decides where each byte view travels.

    Views smaller than `_DIRECT_BYTES` get an aligned offset (>= 0) in the
    packed buffer; larger ones travel as messages of their own, straight from
    their storage, and get the location `-1 - index`.
    """

    def __init__(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.direct: list[torch.Tensor] = []
        self.size = 0

    def add(self, flat: torch.Tensor, *, direct: bool = True) -> int:
        if direct and flat.numel() >= _DIRECT_BYTES:
            self.direct.append(flat)
            return -len(self.direct)
        offset = self.size
        self.pieces.append((offset, flat))
        self.size = _align(offset + flat.numel())
        return offset


def _tensor_bytes(value: torch.Tensor) -> torch.Tensor | None:
    """`value`'s elements as a flat `uint8` tensor, or None when it has no plain storage."""
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
    """`value`'s elements as a flat `uint8` tensor, or None for object/zero-size dtypes."""
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
            return (_TENSOR, value.dtype, tuple(value.shape), layout.add(flat))
    elif isinstance(value, np.ndarray):
        flat = _numpy_bytes(value)
        if flat is not None:
            return (_NUMPY, value.dtype, value.shape, layout.add(flat))
    return (_OBJECT, value)


def _tags_tensor(trace: Trace) -> torch.Tensor:
    """The `iterations`, `ranks` and `order` tags as one `(3, n)` int64 tensor."""
    rows = []
    for tags in (trace.iterations, trace.ranks, trace.order):
        if isinstance(tags, torch.Tensor):
            rows.append(tags.detach().to("cpu", torch.int64).reshape(-1))
        else:
            rows.append(torch.as_tensor(np.asarray(tags, dtype=np.int64).reshape(-1)))
    return torch.stack(rows)


def _pack(chunk: dict[str, Trace], facts: list[Fact]) -> _Packed:
    layout = _Layout()
    sites = []
    for name, trace in chunk.items():
        trace.check_lengths()
        tags = _tags_tensor(trace)
        tag_offset = layout.add(tags.reshape(-1).view(torch.uint8), direct=False)
        values = trace.values
        stacked = _tensor_bytes(values) if isinstance(values, torch.Tensor) else None
        if stacked is not None:
            shapes = None if trace.shapes is None else [tuple(s) for s in trace.shapes]
            payload: Any = (values.dtype, tuple(values.shape), layout.add(stacked), shapes)
        else:
            payload = [_encode_record(value, layout) for value in values]
        sites.append((name, stacked is not None, len(trace), tag_offset, payload))
    header = pickle.dumps((sites, facts), protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(8 * (2 + len(layout.direct)) + len(header))
    return _Packed(header, data_start, layout.pieces, layout.direct, data_start + layout.size)


def _buffer(packed: _Packed) -> torch.Tensor:
    """The packed buffer: the prefix, the header, then the small byte views.

    The prefix (int64s) holds the header's length, the number of separate
    messages and their sizes, so rank 0 can receive them even if the header
    itself fails to unpickle there.
    """
    sizes = [flat.numel() for flat in packed.direct]
    prefix = torch.tensor([len(packed.header), len(sizes), *sizes], dtype=torch.int64)
    header = torch.frombuffer(bytearray(packed.header), dtype=torch.uint8)
    head = torch.cat([prefix.view(torch.uint8), header])
    out = torch.zeros(packed.nbytes, dtype=torch.uint8)
    out[: head.numel()].copy_(head)
    for offset, flat in packed.pieces:
        start = packed.data_start + offset
        out[start : start + flat.numel()].copy_(flat)
    return out


def _segments(flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flats` cut, in order, into messages of at most `_ROUND_BYTES`."""
    return [
        flat[start : start + _ROUND_BYTES]
        for flat in flats
        for start in range(0, flat.numel(), _ROUND_BYTES)
    ]


def _rounds(sizes: list[int]) -> list[list[int]]:
    """Consecutive message indices grouped so that each group holds at most `_ROUND_BYTES`."""
    groups: list[list[int]] = []
    used = _ROUND_BYTES
    for index, size in enumerate(sizes):
        if used + size > _ROUND_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += size
    return groups


def _run_ops(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _send_all(flats: list[torch.Tensor], device: torch.device, group: Any) -> None:
    """Send `flats` to rank 0 as numbered messages, a bounded round at a time.

    On a CPU backend the messages leave straight from the records' storage; on
    a device backend each round is first copied to the device.
    """
    messages = _segments(flats)
    for round_ in _rounds([m.numel() for m in messages]):
        _run_ops([dist.P2POp(dist.isend, messages[i].to(device), 0, group, tag=i) for i in round_])


def _receive_all(targets: list[list[torch.Tensor]], device: torch.device, group: Any) -> None:
    """On rank 0, fill `targets[r]` (CPU `uint8` tensors) with what rank `r` sends.

    Matches `_send_all` message by message (same cutting, same numbers).
    Rounds bound what is in flight, and so the device staging memory, to
    `_ROUND_BYTES`.
    """
    messages = [
        (sender, tag, message)
        for sender, flats in enumerate(targets)
        for tag, message in enumerate(_segments(flats))
    ]
    for round_ in _rounds([m.numel() for _, _, m in messages]):
        batch = [messages[i] for i in round_]
        if device.type == "cpu":
            _run_ops([dist.P2POp(dist.irecv, m, r, group, tag=tag) for r, tag, m in batch])
            continue
        staging = [torch.empty_like(m, device=device) for _, _, m in batch]
        pairs = list(zip(staging, batch, strict=True))
        _run_ops([dist.P2POp(dist.irecv, buf, r, group, tag=tag) for buf, (r, tag, _) in pairs])
        for buf, (_, _, m) in pairs:
            m.copy_(buf)


class _Decoder:
    """Rebuilds one rank's records from its packed buffer.

    Records that travel as their own messages are allocated here with their
    final dtype and shape; `targets` lists their bytes, in message order,
    for `_receive_all` to fill in place (no copy after the transfer).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        header_len, count = buffer[:16].view(torch.int64).tolist()
        self.sizes = buffer[16 : 16 + 8 * count].view(torch.int64).tolist()
        self.header = buffer[16 + 8 * count : 16 + 8 * count + header_len]
        self.data = buffer[_align(16 + 8 * count + header_len) :]
        self.direct: dict[int, torch.Tensor] = {}
        self.facts: list[Fact] = []

    @property
    def targets(self) -> list[torch.Tensor]:
        """Where each separate message lands (scratch space for any not decoded)."""
        return [
            self.direct.get(i, torch.empty(size, dtype=torch.uint8))
            for i, size in enumerate(self.sizes)
        ]

    def _tensor(self, location: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if location >= 0:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            raw = self.data[location : location + nbytes]
            return raw.view(dtype).reshape(shape).clone()
        value = torch.empty(shape, dtype=dtype)
        self.direct[-1 - location] = value.reshape(-1).view(torch.uint8)
        return value

    def _record(self, entry: tuple[Any, ...]) -> Any:
        kind = entry[0]
        if kind == _TENSOR:
            _, dtype, shape, location = entry
            return self._tensor(location, dtype, shape)
        if kind == _NUMPY:
            _, dtype, shape, location = entry
            raw = self._tensor(location, torch.uint8, (int(np.prod(shape)) * dtype.itemsize,))
            return raw.numpy().view(dtype).reshape(shape)
        return entry[1]

    def parts(self) -> dict[str, _Part]:
        parts = {}
        entries, self.facts = pickle.loads(self.header.numpy().tobytes())
        for name, stacked, count, tag_offset, payload in entries:
            raw = self.data[tag_offset : tag_offset + 3 * count * 8]
            tags = raw.view(torch.int64).reshape(3, count).clone()
            if stacked:
                dtype, shape, location, shapes = payload
                values = self._tensor(location, dtype, shape)
                parts[name] = _Part(True, values, tags[0], tags[1], tags[2], shapes)
            else:
                records = [self._record(entry) for entry in payload]
                iterations, ranks, order = tags.tolist()
                parts[name] = _Part(False, records, iterations, ranks, order, None)
        return parts


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
    return join_traces([Trace(p.values, p.iterations, p.ranks, p.order, p.shapes) for p in filled])
