"""The hand-over: a chunk's records through the gather callbacks into the results.

`HandOver` runs once per gathering interval (and once more when the tracer stops),
on the thread its staging runs jobs on: flush -> pre-gather callbacks -> gather to
rank 0 (with `gather="node"`: to the node's first rank) -> post-gather callbacks ->
`tracer.results` -> the sinks' `flush_later` (the last hand-over: `flush`, which waits
until what the sinks were handed is durable).  Facts about sites (aliases, reductions)
travel with the records and reach the results and the sinks before them.  Where a
gather would collide with the training's own communication (a pipeline schedule, a
live `Join`: `vartrace.distributed.collisions`), the chunk goes through the pre-gather
callbacks into a file of the rank's instead (`vartrace.distributed.spill`), and the
final gathers send those chunks first.
`gathers_at_start` makes the gathers' process group and the callbacks' `RunContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

from vartrace._support import warnings as _warnings
from vartrace._support.memory import held_bytes
from vartrace.distributed import gathers as distributed
from vartrace.distributed.collisions import in_pipeline_schedule, join_enabled, join_live
from vartrace.distributed.groups import check_member, group_ranks
from vartrace.distributed.nodes import node_of_this_rank
from vartrace.distributed.spill import Spill
from vartrace.errors import CallbackError, TraceLengthError
from vartrace.markers import DROP, Unstored
from vartrace.placements import Placements
from vartrace.reduced import Reductions
from vartrace.trace import RunContext, Trace
from vartrace.tracing.aliases import Aliases
from vartrace.tracing.chunk import Chunk
from vartrace.tracing.config import GatherCallback, TracerConfig, callback_name
from vartrace.tracing.hooks import SinkHooks
from vartrace.tracing.results import Results

__all__ = ["HandOver", "callback_error", "gathers_at_start", "run_callbacks"]


def gathers_at_start(config: TracerConfig) -> tuple[Any, RunContext]:
    """The gathers' process group (`None`: the default group) and the run's context for
    the callbacks' `on_start`; called by the tracer's `start`, on every rank.

    A collective where it makes a group: with `gather="node"`, each node's group (see
    `vartrace.distributed.nodes`); with asynchronous staging, a gloo group of every rank
    (of the tracer's group, `config.group`), for gathers on the stager's thread, never on
    the group the training thread's collectives (DDP's NCCL all-reduces) use, and never
    on a device.  With one rank (or no process group yet) `gather="node"` gathers
    nothing, as `gather=True`.  With a group, the context is the group's: `rank` is this
    rank's place in it and `world_size` its size, so that its first rank writes the
    group's file.
    """
    rank, world = distributed.rank(), distributed.world_size()
    held = _held_bytes(config)
    if config.gather and world > 1 and join_live(config.joinable):
        raise ValueError(
            "ModelTracer(gather=...) started inside a torch.distributed.algorithms.Join of "
            "its model that still runs: inside the Join, the tracer's final gather would "
            "wait, on a rank out of inputs, for ranks that wait for its Join; start the "
            "tracer first and build the Join inside it (`with tracer: with Join([ddp]): "
            "...`) or pass gather=False (a shard a rank, no communication)"
        )
    if config.gather == "node" and world > 1:
        node = node_of_this_rank()
        context = RunContext(
            rank,
            world,
            node=node.index,
            nodes=node.count,
            node_ranks=node.ranks,
            held_bytes=held,
        )
        return node.group, context
    if config.group is not None and config.gather:
        check_member(config.group)
        ranks = group_ranks(config.group)
        context = RunContext(distributed.rank(config.group), len(ranks), held_bytes=held)
        if config.staging == "async" and len(ranks) > 1:
            return distributed.new_host_group(ranks), context
        return config.group, context
    group = None
    if config.staging == "async" and config.gather and world > 1:
        group = distributed.new_host_group()
    sharded = not config.gather and world > 1
    return group, RunContext(rank, world, sharded=sharded, held_bytes=held)


def _held_bytes(config: TracerConfig) -> int | None:
    """`RunContext.held_bytes`: with asynchronous staging, the stager's host memory
    (`max_host_bytes`) less the records in flight to it, which holds the chunk and what a
    saver has not written yet; `None` where records are copied on the capturing thread."""
    if config.staging != "async":
        return None
    return max(config.max_host_bytes - config.max_inflight_bytes, 0)


def callback_error(stage: str, callback: object, site: str, error: Exception) -> CallbackError:
    """The `CallbackError` for `error`, raised by a `stage` callback on `site`."""
    return CallbackError(
        f"{stage} callback {callback_name(callback)} raised on site {site!r}: "
        f"{type(error).__name__}: {error}"
    )


def pre_saved(
    callbacks: Sequence[tuple[Callable[[str, Any, int], Any], bool]],
    site: str,
    value: Any,
    iteration: int,
) -> tuple[Any, bool]:
    """`value` through the pre-save `callbacks` in order (`DROP` as soon as one drops it),
    and whether the last callback that replaced it makes new tensors (nothing to clone)."""
    fresh = False
    for callback, makes_fresh in callbacks:
        try:
            result = callback(site, value, iteration)
        except Exception as error:
            raise callback_error("pre_save", callback, site, error) from error
        if result is DROP:
            return DROP, False
        if result is not value:
            fresh = makes_fresh
        value = result
    return value, fresh


def run_callbacks(stage: str, callbacks: Sequence[GatherCallback], name: str, trace: Trace) -> None:
    """Each of `callbacks` on `name`'s `trace`, its lengths checked after each."""
    for callback in callbacks:
        try:
            callback(name, trace)
        except Exception as error:
            raise callback_error(stage, callback, name, error) from error
        try:
            trace.check_lengths()
        except TraceLengthError:  # raised again below, naming the callback (named only then)
            culprit = callback_name(callback)
        else:
            continue
        trace.check_lengths(culprit)


def _emptied(chunks: list[dict[str, Trace]]) -> Iterator[dict[str, Trace]]:
    """Each of `chunks`, oldest first, taken out of the list as it is given."""
    while chunks:
        yield chunks.pop(0)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


class HandOver:
    """Hands `chunk`'s records on: callbacks, gathers, `results` (call it).

    Args:
        chunk: the records since the last gather.
        results: where the gathered records are kept.
        aliases, facts: the facts about sites that travel with the records (`facts`:
            what pre-save callbacks reduced, the placements of DTensors).
        config: the tracer's options (the callbacks, `gather`, `max_host_bytes`).
        hooks: the sinks' hooks (`flush`, `alias`, `reduced`, `placed`).
        group: the gathers' process group (`None`: the default group; a node's group
            with `gather="node"`; the tracer's `group=`, or a gloo group of its ranks).
    """

    def __init__(
        self,
        chunk: Chunk,
        results: Results,
        aliases: Aliases,
        facts: tuple[Reductions, Placements],
        config: TracerConfig,
        hooks: SinkHooks,
        group: Any = None,
    ) -> None:
        self._chunk = chunk
        self._results = results
        self._aliases = aliases
        self._reductions, self._placements = facts
        self._config = config
        self._flushes = hooks.flush
        self._flushes_later = hooks.flush_later
        self._behind = False  # sinks were handed gathers without waiting (flush_later)
        self._sinks: dict[str, tuple[Callable[[str, Any], None], ...]] = {
            "alias": (results.alias, *hooks.alias),
            "reduced": (results.reduced, *hooks.reduced),
            "placed": (results.placed, *hooks.placed),
        }
        self._group = group
        self._held = 0  # bytes of the records kept in the results
        self._warned_held: bool | str = False
        self._warned_colliding: set[str] = set()  # the causes of held gathers said
        # the joinable's Join setting at the start: a Join built since may leave the
        # ranks' iteration counts apart
        self._join_config = getattr(config.joinable, "_join_config", None)
        self._spill = Spill()  # the chunks held back from colliding gathers
        self._unspilled: list[dict[str, Trace]] = []  # those the spill could not take
        self._warned_spill = False

    @property
    def held(self) -> int:
        """The bytes of the records kept in the results (no saver emptied their chunks)."""
        return self._held

    def __call__(self, *, final: bool = False) -> None:
        """Hand the chunk through the gather callbacks to the results.

        `final`: the tracer's last hand-over, which also joins the gathers of ranks
        still running (see `vartrace.distributed.gathers.final_gathers`).
        """
        config = self._config
        # One process, as most steps of most runs: no gather to pair, hold or tag for.
        # (The final hand-over always gathers: it joins what earlier gathers held back.)
        alone = not final and not distributed.active()
        if not (final or alone) and self._colliding():
            self._hold()
            return
        chunk = self._chunk.take()
        aliases, reduced = self._aliases.taken(), self._reductions.taken()
        placed = self._placements.taken()
        facts: list[distributed.Fact] = (
            [
                *(("alias", name, target) for name, target in aliases),
                *(("reduced", name, origin) for name, origin in reduced),
                *(("placed", name, placement) for name, placement in placed),
            ]
            if aliases or reduced or placed
            else []  # (most gathers: no new fact, and no generator made)
        )
        if not chunk and not facts and (alone or distributed.world_size(self._group) == 1):
            self._flush_sinks(final, handed=False)
            return  # nothing to hand on, and no other rank waits for this gather
        self._declare(facts)
        known = len(facts)  # the facts declared; a gather appends the other ranks'
        if not alone:
            self._retag(chunk)
        pending = dict(chunk)  # the traces not yet in the results
        handed = False  # records went through the post-gather callbacks here
        results = self._results
        try:
            if config.pre_gather_callbacks:
                for name, trace in chunk.items():
                    run_callbacks("pre_gather", config.pre_gather_callbacks, name, trace)
            gathers = [(chunk, True)] if alone else self._gathers(chunk, final, facts)
            for gathered, merged in gathers:
                if len(facts) > known:  # other ranks' facts, come with the gather
                    self._declare(self._adopted(facts[known:]))
                    known = len(facts)
                pending = dict(gathered)
                handed = handed or merged
                # (else this rank's own records that no gather took: kept as they are)
                post_gather = config.post_gather_callbacks if merged else ()
                for name, trace in gathered.items():
                    if post_gather:
                        run_callbacks("post_gather", post_gather, name, trace)
                    if len(trace.iterations):  # (a saver's callback empties its traces)
                        results.add(name, self._kept(trace))
                    del pending[name]
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C in a callback: the records stay
            self._chunk.put_back(pending)
            raise
        self._flush_sinks(final, handed)

    def _flush_sinks(self, final: bool, handed: bool) -> None:
        """After a gather whose records went through the post-gather callbacks (`handed`),
        the sinks' `flush_later`; after the last one, their `flush`, also when it handed
        nothing but earlier gathers were handed over without waiting."""
        if final and (handed or self._behind):
            self._behind = False
            for flush in self._flushes:
                flush()
        elif handed:
            self._behind = True
            for flush in self._flushes_later:
                flush()

    def _colliding(self) -> bool:
        """Whether a gather now would collide with the training's own communication (see
        `vartrace.distributed.collisions`): on the training thread inside a pipeline
        schedule, inside a Join started after the tracer, or past such a Join when the
        gathers come every few iterations.  Every rank then holds its periodic gathers
        back (each rank's calls are inside the schedule; every rank is inside the Join
        until all leave it together, and past it for good), so the gathers still pair; the
        records wait, in a file of each rank's, for the final gather, with a warning once
        for each cause."""
        if not self._config.gather or distributed.world_size(self._group) == 1:
            return False
        joinable = self._config.joinable
        if join_live(joinable):
            why = "a torch.distributed.algorithms.Join shadows the collectives of the ranks"
            fixes = (
                "gather after the Join (gathers go on once it is over) or pass gather=False "
                "(a shard a rank, no communication)"
            )
        elif (
            self._config.gathering_interval > 1
            and join_enabled(joinable)
            and (getattr(joinable, "_join_config", None) is not self._join_config)
        ):
            why = (
                "a torch.distributed.algorithms.Join ran inside the tracer: the ranks' "
                "iteration counts may differ since, and gathers every "
                f"{self._config.gathering_interval} iterations would not pair"
            )
            fixes = "pass gathering_interval=1 (gathers go on once the Join is over)"
        elif in_pipeline_schedule():
            why = "each call of the stage runs inside a torch.distributed.pipelining schedule"
            fixes = (
                "pass optimizer= (an iteration ends at its step, after the schedule's), "
                "staging='async' (gathers on the tracer's own thread and group) or "
                "gather=False (a shard a rank, no communication)"
            )
        else:
            return False
        if why not in self._warned_colliding:
            self._warned_colliding.add(why)
            _warnings.warn(
                f"vartrace: {why}, where a gather would wait for a rank that waits for this "
                "one: each rank holds its records back, in a temporary file of its own "
                "(memory holds one gathering interval's), and gathers them when the tracer "
                f"stops.  To gather as training goes, {fixes}",
                RuntimeWarning,
            )
        return True

    def _hold(self) -> None:
        """Hold the chunk back from a colliding gather: through the pre-gather callbacks
        (as a gather would take it) into the spill file, for the final gathers.  Records
        that cannot be written there (an opaque record that does not pickle, a full disk)
        wait in memory instead, with a warning once."""
        chunk = self._chunk.take()
        if not chunk:
            return
        self._retag(chunk)
        try:
            for name, trace in chunk.items():
                run_callbacks("pre_gather", self._config.pre_gather_callbacks, name, trace)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C in a callback: the records stay
            self._chunk.put_back(chunk)
            raise
        try:
            self._spill.put(chunk)
        except Exception as error:
            self._unspilled.append(chunk)
            if not self._warned_spill:
                self._warned_spill = True
                _warnings.warn(
                    f"vartrace: the records held back from the gathers could not be written "
                    f"to a temporary file ({type(error).__name__}: {error}); they wait in "
                    "memory for the tracer's stop",
                    RuntimeWarning,
                )

    def _retag(self, chunk: dict[str, Trace]) -> None:
        """Tag `chunk` with this process's rank, if the process group started after the
        tracer did (a tracer around Lightning's `trainer.fit`): every record in it was
        captured here."""
        rank = distributed.rank()
        if rank == self._chunk.rank or distributed.world_size() == 1:
            return
        self._chunk.rank = rank
        for trace in chunk.values():
            trace.ranks = [rank] * len(trace.ranks)

    def _declare(self, facts: Sequence[distributed.Fact]) -> None:
        """Tell the results and the sinks that have the method (the HDF5 saver) facts
        about sites, before the records: `alias(name, target)` for names that read as
        another site, `reduced(name, ReducedFrom)` for what a pre-save callback replaced,
        `placed(name, Placement)` for a site that recorded a DTensor's local shards.

        With `gather=True` only rank 0 does (with `gather="node"`, each node's first
        rank): it alone receives the gathered records, and the other ranks' facts with
        them (`_adopted`).
        """
        if not facts or (self._config.gather and distributed.rank(self._group) != 0):
            return
        for method, name, fact in facts:
            for sink in self._sinks[method]:
                sink(name, fact)

    def _adopted(self, facts: Sequence[distributed.Fact]) -> list[distributed.Fact]:
        """Other ranks' facts merged into this rank's; those that changed what it declared.

        A site reduced on several ranks is described by every rank's values (the dtypes
        of all, -1 on the axes whose size differed: tensor-parallel shards).  A name
        that is an alias on another rank becomes one here unless it stored records of
        its own here: then reading it gives this rank's records, and a warning says
        where the other rank's are.
        """
        adopted: list[distributed.Fact] = []
        for method, name, fact in facts:
            if method == "reduced":
                widened = self._reductions.adopt(name, fact)
                if widened is not None:
                    adopted.append((method, name, widened))
                continue
            if method == "placed":
                if self._placements.adopt(name, fact) is not None:
                    adopted.append((method, name, fact))
                continue
            known = name in self._aliases
            if not self._aliases.adopt(name, fact):
                _warnings.warn(
                    f"vartrace: on another rank, {name} held the same tensor as {fact}: "
                    f"its records of that rank are stored under {fact}, while here it "
                    f"stored records of its own (reading {name} gives only those)",
                    UserWarning,
                )
            elif not known:
                adopted.append((method, name, fact))
        return adopted

    def _gathers(
        self, chunk: dict[str, Trace], final: bool, facts: list[distributed.Fact]
    ) -> Iterable[tuple[dict[str, Trace], bool]]:
        """What this rank holds of `chunk`'s gathers: `(records, merged)` pairs (`facts`
        travel with `chunk`; on rank 0 they grow by the other ranks').

        `merged` records go through the post-gather callbacks (rank 0's gathered chunk,
        or a rank's own chunk without gathering); the others are empty on ranks other than
        0, or this rank's own records that a final gather could not take (another rank did
        not come): kept as they are.
        """
        if not self._config.gather:
            return [(chunk, True)]
        if final:
            held = chain(_emptied(self._unspilled), self._spill.chunks())
            return distributed.final_gathers(chunk, self._group, facts=facts, held=held)
        gathered = distributed.gather_chunk(chunk, self._group, facts=facts)
        return [] if gathered is None else [(gathered, True)]

    def _kept(self, trace: Trace) -> Trace:
        """`trace` as `results` keeps it, or, past `max_host_bytes` of results, one marker
        saying so.  Records staged from an accelerator stay in their slots of the ring (no
        copy: the ring is bounded by `max_host_bytes` too); a slot goes back to the ring
        when the last view of its record dies."""
        held = held_bytes(trace.values)
        if not held:
            return trace
        bound = self._config.max_host_bytes
        if self._held + held > bound:
            marker = Unstored(
                f"dropped: {len(trace)} records ({_size(held)}) would pass max_host_bytes="
                f"{_size(bound)} of results held in memory"
            )
            self._warn_held(self._held + held, dropping=True)
            first = [int(trace.iterations[0])], [int(trace.ranks[0])], [int(trace.order[0])]
            return Trace([marker], *first)
        self._held += held
        if self._held > bound // 2:
            self._warn_held(self._held, dropping=False)
        return trace

    def _warn_held(self, total: int, *, dropping: bool) -> None:
        if self._warned_held == "dropping" or (self._warned_held and not dropping):
            return
        self._warned_held = "dropping" if dropping else True
        bound = _size(self._config.max_host_bytes)
        now = (
            f"records past max_host_bytes={bound} are dropped"
            if dropping
            else f"past max_host_bytes={bound}, records will be dropped"
        )
        _warnings.warn(
            f"vartrace: the results held in memory reached {_size(total)} "
            f"({self._config.gathering_interval} iteration(s) a gather); {now}.  Write them "
            "to a file (post_gather_callbacks=[H5PYSaverCallback(...)]), reduce them "
            "(pre_save_callbacks=[vartrace.stats()]), record fewer sites, or raise "
            "max_host_bytes",
            RuntimeWarning,
        )
