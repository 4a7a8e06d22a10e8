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

Gathering within a node
-----------------------
`gather_chunk` and `final_gathers` take a process group: with `None` every rank
gathers to global rank 0; with a node's group (`vartrace.distributed.nodes`,
`ModelTracer(gather="node")`) the ranks of each node gather to their node's first
rank, and no record ever travels to a rank of another node.  Everything below
holds within the group: "rank 0" is the group's first rank, records keep the
global rank that captured them, and messages name global ranks.

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
is done, and all of them leave together.  (Chunks a rank held back while its
gathers would have collided with the training's own communication, see
`vartrace.distributed.spill`, go first, a gather each, without saying it is done:
ranks that held back different numbers pair as above.)  A rank that finishes early
so waits at exit for the others, as it would in a barrier; no collective is added to
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

from collections.abc import Iterable, Iterator
from datetime import timedelta
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from vartrace._support.warnings import warn
from vartrace.distributed.wire import (
    Decoder,
    Fact,
    Packed,
    Part,
    merge,
    pack,
    packed_buffer,
    parts_of_chunk,
)
from vartrace.trace import Trace

_ROUND_BYTES = 1 << 30


_AVAILABLE = dist.is_available()  # (a fact of the build: read once)


def active() -> bool:
    """Whether the default process group is initialised (also when that happened after
    the tracer started: a tracer around Lightning's `trainer.fit`).

    Example:
        ```python
        if not vartrace.distributed.gathers.active():
            print("one process: nothing to gather")
        ```
    """
    return _AVAILABLE and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in `group` (`None`: every rank), 0 without an initialised
    process group.

    Example:
        ```python
        if vartrace.distributed.gathers.rank() == 0:
            print("writing the file")
        ```
    """
    return dist.get_rank(group) if active() else 0


def world_size(group: Any = None) -> int:
    """The number of ranks in `group` (`None`: every rank), 1 without an initialised
    process group.

    Example:
        ```python
        shards = [f"run.rank{r}.h5" for r in range(vartrace.distributed.gathers.world_size())]
        ```
    """
    return dist.get_world_size(group) if active() else 1


def new_host_group(ranks: list[int] | None = None) -> Any:
    """A gloo process group of every rank (or of `ranks`), for gathers that run beside
    the training's own.

    Collectives on one group must come in the same order on every rank: a
    thread gathering on the group that DDP's all-reduces use could interleave
    with them.  A group of its own, on the host, also never stages through
    device memory.  A collective call: every rank must make it (with `ranks`, every
    rank of `ranks`, and only those: the tracer of a model on some ranks is started
    on those alone), at the same point.  Its timeout is the default group's
    (``init_process_group(..., timeout=)``), which so bounds the gathers' waits as it
    bounds the training's.
    Example:
        ```python
        group = new_host_group()
        merged = gather_chunk(chunk, group)
        ```
    """
    return dist.new_group(
        ranks, backend="gloo", timeout=_timeout(), use_local_synchronization=ranks is not None
    )


def new_host_subgroups(ranks_per_group: list[list[int]]) -> Any:
    """Gloo process groups of the given ranks (disjoint lists); returns this rank's.

    As `new_host_group`, for gathers within groups of ranks (`gather="node"`: one
    group a node).  A collective call: every rank must make it with the same lists,
    in the same order, at the same point; the groups' timeout is the default group's.
    Example:
        ```python
        mine = new_host_subgroups([[0, 1], [2, 3]])
        merged = gather_chunk(chunk, mine)  # on ranks 0 and 2: their node's records
        ```
    """
    group, _ = dist.new_subgroups_by_enumeration(
        ranks_per_group, timeout=_timeout(), backend="gloo"
    )
    return group


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
    """Gather every rank's chunk of `group` to the group's rank 0.

    Must be called on every rank of `group` (`None` is the default process
    group; a node's group gathers to the node's first rank), the same number
    of times, unless a rank has left for `final_gathers`, which joins the
    gathers of the others.  Returns the merged chunk (site name ->
    [`Trace`][vartrace.Trace] holding the records of all the group's ranks, its
    rank 0's first) on the group's rank 0 and `None` on the other ranks.
    Records keep the global rank they were tagged with.  Without an initialised
    process group, or with a group of a single rank, `chunk` is returned unchanged.

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
    if not active() or dist.get_world_size(group) == 1:
        return chunk
    return _gather(chunk, group, final=False, facts=facts)[0]


def final_gathers(
    chunk: dict[str, Trace],
    group: Any = None,
    *,
    facts: list[Fact] | None = None,
    held: Iterable[dict[str, Trace]] = (),
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

    `held`: chunks this rank held back from earlier gathers (see
    `vartrace.distributed.spill`), each sent first, in order, as a gather of its own
    that does not say this rank is done (taken from the iterable one at a time: only
    the chunk in flight is in memory).

    Yields `(records, gathered)` after each gather: on rank 0 the merged
    chunk and `True`, on the other ranks an empty chunk and `False`.  The
    wait for ranks still running is bounded by the group's timeout: if a
    gather fails there (a rank never came, or its process is gone), this
    warns, naming the ranks not known to be done, and stops; the chunks not yet
    sent (`held`'s rest, then `chunk`) are yielded back, on rank 0 as gathered (its
    own records, for the file), on the other ranks with `False` (records to keep
    where they are).  Without an initialised process group, or with a single rank, it
    yields each of `held` and `chunk` with `True`.  `facts` travel with the first gather as
    with `gather_chunk`: on rank 0 the list grows after each gather that brought some.

    Example:
        ```python
        for records, gathered in final_gathers(chunk):
            for name, trace in records.items():
                (save if gathered else keep)(name, trace)
        ```

    Raises:
        RuntimeError: as `gather_chunk`, for a failure after the ranks met.
    """
    sending = chain(((own, False) for own in held), [(chunk, True)])
    if not active() or dist.get_world_size(group) == 1:
        yield from ((own, True) for own, _ in sending)
        return
    me = dist.get_rank(group)
    running = [r for r in range(dist.get_world_size(group)) if r != me]
    while running:
        own, last = next(sending, ({}, True))
        try:
            merged, done = _gather(own, group, final=last, facts=facts, leaving=True)
        except _Unmet as unmet:
            others = [r for r in running if r != me]
            _warn_unmet(me, others, own, unmet.__cause__, group)
            for unsent, _ in chain([(own, last)], sending):
                if unsent:
                    yield unsent, me == 0
            return
        if me:
            facts = None  # sent with the first chunk; rank 0's list gathers the others'
        yield ({}, False) if merged is None else (merged, True)
        running = [r for r, finished in enumerate(done) if not finished]


class _Unmet(Exception):
    """The exchange that starts a final gather failed: some rank did not come."""


def _global(group: Any, ranks: list[int]) -> list[int]:
    """The global ranks of `group`'s ranks `ranks` (messages name ranks as the launcher does)."""
    if group is None or group is dist.group.WORLD:
        return ranks
    return [dist.get_global_rank(group, r) for r in ranks]


def _warn_unmet(
    me: int, running: list[int], own: dict[str, Trace], error: BaseException | None, group: Any
) -> None:
    count = sum(len(trace) for trace in own.values())
    root, mine = _global(group, [0, me])
    if me:
        kept = (
            f"this rank's last {count} records stay in tracer.results on rank {mine}"
            if own
            else "this rank had sent all its records"
        )
    else:
        kept = (
            f"the records those ranks took since their last gather are not in rank {root}'s "
            "results (a rank that reaches its own final gather keeps them in its "
            "tracer.results)"
        )
        if own:
            kept = f"rank {root} hands on its own last {count} records alone; {kept}"
    warn(
        f"vartrace: rank(s) {_global(group, running)} did not come to the final gathers "
        f"before the process group gave up ({type(error).__name__}: {error}); {kept}",
        RuntimeWarning,
    )


def _gather(
    chunk: dict[str, Trace],
    group: Any,
    *,
    final: bool,
    facts: list[Fact] | None,
    leaving: bool = False,
) -> tuple[dict[str, Trace] | None, list[bool]]:
    """One gather: the merged chunk (`None` except on rank 0) and which ranks are done.

    `final`: this rank is done (it sends its last chunk or nothing).  A rank
    other than 0 with an empty chunk and no `facts` sends nothing; on rank 0,
    `facts` is extended with the others'.  If the first exchange
    fails in a gather of `final_gathers` (`leaving`), raises `_Unmet` (the cause is the
    error).
    """
    me = dist.get_rank(group)
    size = dist.get_world_size(group)
    device = _comm_device(group)

    packed: Packed | None = None
    own: dict[str, Part] = {}
    error: Exception | None = None
    try:
        if me == 0:
            own = parts_of_chunk(chunk)
        elif chunk or facts:
            packed = pack(chunk, facts or [])
    except Exception as exc:
        error = exc
    length = packed.nbytes if packed is not None else 0
    status = torch.tensor([length, error is not None, final], dtype=torch.int64, device=device)
    statuses = [torch.empty_like(status) for _ in range(size)]
    try:
        dist.all_gather(statuses, status, group=group)
    except RuntimeError as exc:
        if leaving:
            raise _Unmet() from exc
        raise
    table = torch.stack(statuses).cpu().tolist()
    done = [bool(finished) for _, _, finished in table]
    failed = [r for r, (_, bad, _) in enumerate(table) if bad]
    if failed:
        if error is not None:
            (mine,) = _global(group, [me])
            raise RuntimeError(
                f"vartrace: rank {mine} could not pack its chunk: {error}"
            ) from error
        raise RuntimeError(
            f"vartrace: rank(s) {_global(group, failed)} could not pack their chunk for "
            "gathering; see the error on those ranks"
        )
    if packed is not None:
        _send_all([packed_buffer(packed)], device, group)
        _send_all(packed.direct, device, group)
    if me != 0:
        return None, done
    buffers = {r: torch.empty(n, dtype=torch.uint8) for r, (n, _, _) in enumerate(table) if n}
    _receive_all([[buffers[r]] if r in buffers else [] for r in range(size)], device, group)
    decoders = {sender: Decoder(buffer) for sender, buffer in buffers.items()}
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
        root, sender = _global(group, [0, failure[0]])
        raise RuntimeError(
            f"vartrace: rank {root} could not unpack the chunk of rank {sender}: {failure[1]}"
        ) from failure[1]
    return merge(parts_by_rank), done


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
        _run_ops(
            [
                dist.P2POp(dist.isend, messages[i].to(device), group=group, tag=i, group_peer=0)
                for i in round_
            ]
        )


def _receives(receives: list[tuple[torch.Tensor, int, int]], group: Any) -> list[dist.P2POp]:
    """Receive operations of `(tensor, sender's rank in group, tag)` triples."""
    return [
        dist.P2POp(dist.irecv, tensor, group=group, tag=tag, group_peer=sender)
        for tensor, sender, tag in receives
    ]


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
            receives = [(m, r, tag) for r, tag, m in batch]
            _run_ops(_receives(receives, group))
            continue
        staging = [torch.empty_like(m, device=device) for _, _, m in batch]
        pairs = list(zip(staging, batch, strict=True))
        _run_ops(_receives([(buf, r, tag) for buf, (r, tag, _) in pairs], group))
        for buf, (_, _, m) in pairs:
            m.copy_(buf)
