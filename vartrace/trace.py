"""The record container that flows through the callback pipeline.

A [`Trace`][vartrace.Trace] holds the records of one site: parallel sequences
`values`, `iterations`, `ranks` and `order` (the global capture
order), one entry per record.  While the tracer buffers a chunk these are
plain lists; stacking callbacks turn `values` into one tensor with a
leading record dimension and the tags into 1-D integer tensors.

This module imports no torch at import time (joining stacked pieces loads it when
called): a trace only needs `len()` and slicing of its sequences, so the same class
serves in-memory results and chunks read back from a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from vartrace.errors import TraceLengthError

if TYPE_CHECKING:  # annotations only: this module imports none of them at run time
    import numpy as np
    import torch

    from vartrace.placements import Placement
    from vartrace.reduced import ReducedFrom

from vartrace._support.warnings import warn

__all__ = [
    "PreSaveCallback",
    "RunContext",
    "SaverCallback",
    "Trace",
    "TraceLengthError",
    "join_traces",
    "report_during",
    "unstacked",
]


#: Per-record tags: a list of ints, or a 1-D integer tensor / array once stacked.
_Tags: TypeAlias = "Sequence[int] | torch.Tensor | np.ndarray"


_new = object.__new__


class Trace:
    """The records of one site.

    Example:
        ```python
        trace = tracer.results["layers.0.attn.forward.scores"]
        for value, it, rank in zip(trace.values, trace.iterations, trace.ranks):
            ...
        ```

    Attributes:
        values: the recorded values (a list, or a tensor after stacking).
        iterations: the iteration of each record.
        ranks: the `torch.distributed` rank that captured each record.
        order: the global capture order of each record (monotonic per rank).
        shapes: the true shape of each record when `values` was padded by
            [`stack_padded_tensors`][vartrace.stack_padded_tensors], else `None`.
        placement: in a tracer's results, the [`Placement`][vartrace.Placement] of the
            DTensor whose local shards the records are ([`assemble`][vartrace.assemble]
            joins them), else `None`.
    """

    __slots__ = ("iterations", "order", "placement", "ranks", "shapes", "values")

    def __init__(
        self,
        values: Sequence[Any] | torch.Tensor | np.ndarray | None = None,
        iterations: _Tags | None = None,
        ranks: _Tags | None = None,
        order: _Tags | None = None,
        shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        self.values: Any = [] if values is None else values
        self.iterations: Any = [] if iterations is None else iterations
        self.ranks: Any = [] if ranks is None else ranks
        self.order: Any = [] if order is None else order
        self.shapes: Any = shapes
        self.placement: Placement | None = None

    @classmethod
    def _first(cls, value: Any, iteration: int, rank: int, order: int) -> Trace:
        """`Trace([value], [iteration], [rank], [order])` for about half the instructions
        (a site's first record of each gather makes one)."""
        trace: Trace = _new(cls)
        trace.values = [value]
        trace.iterations = [iteration]
        trace.ranks = [rank]
        trace.order = [order]
        trace.shapes = trace.placement = None
        return trace

    def __len__(self) -> int:
        return len(self.iterations)

    def __repr__(self) -> str:
        kind = type(self.values).__name__
        return f"<Trace records={len(self)} values={kind}>"

    def records(self) -> list[Any]:
        """Each record's value, cut back to its true shape where `values` was padded.

        Works for list values and for stacked tensors or arrays alike:

        ```python
        for value, it in zip(trace.records(), trace.iterations):
            print(it, value.shape)
        ```
        """
        values, shapes = self.values, self.shapes
        if isinstance(values, (list, tuple)) and shapes is None:
            return list(values)
        rows = [values[index] for index in range(len(self))]
        if shapes is None:
            return rows
        return [
            row[tuple(slice(0, int(size)) for size in shape)]
            for row, shape in zip(rows, shapes, strict=True)
        ]

    def append(self, value: Any, iteration: int, rank: int, order: int) -> None:
        """Append one record (only while the fields are lists)."""
        self.values.append(value)
        self.iterations.append(iteration)
        self.ranks.append(rank)
        self.order.append(order)

    def clear(self) -> None:
        """Drop every record: what a callback that consumed the chunk does."""
        self.values = []
        self.iterations = []
        self.ranks = []
        self.order = []
        self.shapes = None

    def check_lengths(self, culprit: str = "") -> None:
        """Raise `TraceLengthError` unless all fields have one entry per record.

        `culprit` names the callback that last touched the trace, for the message.
        """
        count = len(self.iterations)
        if len(self.values) == count == len(self.ranks) == len(self.order) and (
            self.shapes is None or len(self.shapes) == count
        ):
            return
        lengths = {
            "values": len(self.values),
            "iterations": len(self.iterations),
            "ranks": len(self.ranks),
            "order": len(self.order),
        }
        if self.shapes is not None:
            lengths["shapes"] = len(self.shapes)
        if len(set(lengths.values())) > 1:
            where = f" after callback {culprit}" if culprit else ""
            detail = ", ".join(f"{k}={v}" for k, v in lengths.items())
            raise TraceLengthError(
                f"trace fields differ in length{where}: {detail}; a callback that changes "
                "the number of records must keep values, iterations, ranks and order equal"
            )


@dataclass(frozen=True)
class RunContext:
    """What a callback learns about the run when tracing starts.

    The tracer calls `callback.on_start(context)` on every callback that
    defines it, before the first record; a saver uses it to name per-rank
    shard files (`sharded=True` when `ModelTracer(gather=False)` and more
    than one rank) and per-node ones: with `ModelTracer(gather="node")` and
    more than one rank, `node` is this rank's node number (else `None`),
    `nodes` the number of nodes and `node_ranks` the global ranks of this
    rank's node, whose first gathers the node's records and writes its shard.

    `held_bytes`, where records wait in the tracer's own pool of host memory
    (asynchronous staging: `max_host_bytes` of it), is what a saver writing on a
    thread of its own may hold unwritten beside the records still to be gathered,
    so that the pool never overflows while the saver falls behind (`make_room`
    waits); `None` leaves the bound to the saver.
    """

    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    node: int | None = None
    nodes: int = 1
    node_ranks: tuple[int, ...] = ()
    held_bytes: int | None = None


class SaverCallback(Protocol):
    """A gather callback that is a sink: `cb(name, trace)` and the optional hooks below.

    Only `__call__` is required.  Every other member is optional: the tracer looks
    each one up once, when it starts (`getattr`), and uses those the callback has;
    `H5PYSaverCallback` has them all.  A custom sink defines the ones it needs (see
    docs/callbacks.md, "Writing your own sink").  `on_start` and `failure` are looked
    up on callbacks of every stage, the others on post-gather callbacks.
    """

    def __call__(self, name: str, trace: Trace) -> None:
        """Take the gathered records of site `name` (rank 0's post-gather stage); a sink
        that writes them may empty `trace`, so that memory stays bounded."""

    def on_start(self, context: RunContext) -> None:
        """Learn the run's rank and world size before the first record (the tracer's
        `start`, on the thread that starts it): open a file, name a shard."""

    def flush(self) -> None:
        """Make what the calls of this gather handed over durable or visible; called
        once after each gather whose records went through the post-gather callbacks
        (the thread that ran them: the training thread, or the staging thread), in
        place of `flush_later` when the sink lacks it, and after the tracer's last
        gather, when it returns only once everything handed over is durable."""

    def flush_later(self) -> None:
        """Start making what the calls of this gather handed over durable, and return
        without waiting (a sink writing on a thread of its own hands the gather to it);
        called in place of `flush` after each gather but the tracer's last."""

    def make_room(self, nbytes: int) -> None:
        """Wait until `nbytes` of records, the tracer's chunk with the record about to
        be kept, fit beside those the sink still holds (used only when `background`
        is `True`, or `None` with a `flush_later`).  Called for each record: on the
        capturing thread before the copy with `staging="sync"`, on the staging thread
        before keeping it with `"async"`."""

    @property
    def background(self) -> bool | None:
        """Whether the sink writes on a thread of its own, so that records must wait for
        it in `make_room`: `True` (only `True`, not any true value), or `None` for a
        sink that does so for what a tracer hands it with `flush_later`."""

    @property
    def failure(self) -> BaseException | None:
        """The failure that stopped the sink during the run, or `None`; the tracer warns
        about it again when it stops, after the last hand-over."""

    def alias(self, name: str, target: str) -> None:
        """Site `name` held the same tensor as `target`: its records are `target`'s.
        Called before the records of the gather that first sees it (rank 0 with
        `gather=True`), on the thread that hands the chunk over."""

    def reduced(self, name: str, origin: ReducedFrom) -> None:
        """A pre-save callback replaced site `name`'s values: `origin` describes what
        they were made from.  Called as `alias` is."""

    def placed(self, name: str, placement: Placement) -> None:
        """Site `name` recorded a DTensor as each rank's local shard: `placement` says
        how the ranks' records join into the whole tensor.  Called as `alias` is."""


class PreSaveCallback(Protocol):
    """A pre-save callback: `cb(name, value, iteration) -> value`, with one optional hook.

    The tracer looks up `fresh_records` once, when it starts.
    """

    def __call__(self, name: str, value: Any, iteration: int) -> Any:
        """The value to record in place of `value` (a reduction, a structure of them,
        or `vartrace.DROP`); called on the capturing thread, inside the step."""

    @property
    def fresh_records(self) -> bool:
        """`True` when a value this callback returns in place of its input is a new tensor
        that nothing else holds or writes (a statistics row): asynchronous staging takes
        it as it is, without a device clone."""


def report_during(exc: BaseException, what: str, error: Exception) -> None:
    """Report `error`, raised by cleanup while `exc` propagates, without replacing `exc`.

    A warning says what failed, and a note on `exc` (Python >= 3.11) keeps it in
    the traceback the user sees.  Example:

    ```python
    try:
        saver.close()
    except Exception as error:
        report_during(step_error, "H5PYSaverCallback.close() failed", error)
    ```
    """
    message = (
        f"vartrace: {what} while the step was raising {type(exc).__name__}: "
        f"{type(error).__name__}: {error}"
    )
    warn(message, RuntimeWarning, stacklevel=2)
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(message)


_TAGS = ("iterations", "ranks", "order")


def _ints(tags: Any) -> list[int]:
    return tags.tolist() if hasattr(tags, "tolist") else [int(t) for t in tags]


def _pad_cat(stacks: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along records, zero-padding each record dimension to the largest (any dtype)."""
    import torch

    biggest = [max(sizes) for sizes in zip(*(v.shape[1:] for v in stacks), strict=True)]
    if all(list(v.shape[1:]) == biggest for v in stacks):
        return torch.cat(stacks)
    out = stacks[0].new_zeros((sum(len(v) for v in stacks), *biggest))
    start = 0
    for v in stacks:
        out[(slice(start, start + len(v)), *(slice(0, n) for n in v.shape[1:]))] = v
        start += len(v)
    return out


def join_traces(pieces: list[Trace]) -> Trace:
    """One trace holding the records of `pieces`, in order.

    Stacked pieces of one dtype, dimensionality and device stay stacked
    (zero-padded to the largest record, with `shapes` keeping the true
    ones where padding happened, and int64 tag tensors); anything else
    becomes a list of exact-shape records with int tags.
    """
    import torch  # here, not at the top: `import vartrace` loads this module without torch

    stacks = [p.values for p in pieces]
    if all(isinstance(v, torch.Tensor) for v in stacks) and (
        len({(v.dtype, v.dim(), v.device) for v in stacks}) == 1
    ):
        values = _pad_cat(stacks)
        shapes = None
        if any(p.shapes is not None for p in pieces) or any(
            v.shape[1:] != values.shape[1:] for v in stacks
        ):
            shapes = [
                tuple(int(n) for n in shape)
                for p in pieces
                for shape in (p.shapes if p.shapes is not None else [p.values.shape[1:]] * len(p))
            ]
        tags = [torch.as_tensor([t for p in pieces for t in _ints(getattr(p, f))]) for f in _TAGS]
        return Trace(values, tags[0], tags[1], tags[2], shapes=shapes)
    return unstacked(pieces)


def unstacked(pieces: list[Trace]) -> Trace:
    """One trace holding the records of `pieces` in order, as a list with int tags.

    The form captures append to: a chunk a callback stacked goes back to it so.
    """
    lists = [[t for p in pieces for t in _ints(getattr(p, f))] for f in _TAGS]
    records = [record for p in pieces for record in p.records()]
    return Trace(records, lists[0], lists[1], lists[2])
