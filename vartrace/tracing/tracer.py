"""ModelTracer: record values of a model's code while it runs, without editing it.

Data flows one way: the engine captures leaves from patched methods ->
pre-save callbacks -> the staging (`vartrace.staging`: a detached copy) ->
the chunk (`vartrace.tracing.chunk`: change detection, the records since the
last gather) -> the hand-over (`vartrace.tracing.handover`: pre-gather
callbacks -> gather to rank 0 -> post-gather callbacks) ->
[`ModelTracer.results`][vartrace.ModelTracer.results], and post-trace
callbacks at the end.  The tracer speaks to its staging through one
interface: synchronous staging copies on the thread that captures; with
asynchronous staging (the default for a model on an accelerator) the
capturing thread only admits each record, and everything from the copy to
the host on runs on the stager's thread, in capture order.  This module is
the facade: options (`vartrace.tracing.config`), patching the model and
undoing it, iterations, and the record path up to admission.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from vartrace._support import exit as _exit
from vartrace._support import forks as _forks
from vartrace._support import warnings as _warnings
from vartrace.distributed import gathers as distributed
from vartrace.engine.frames import set_change_test
from vartrace.engine.patching import Hook, attach, detach
from vartrace.engine.structures import leaves
from vartrace.errors import CallbackError
from vartrace.markers import DROP
from vartrace.placements import Placements
from vartrace.reduced import Reductions
from vartrace.staging import OnFull, Staging, StagingStats
from vartrace.statistics.rows import SiteRows, build_kernel
from vartrace.tensors import (
    is_distributed,
    is_transformed,
    local_shard,
    snapshot,
    split_object,
    unchanged,
    untransformed,
)
from vartrace.trace import report_during
from vartrace.tracing import registry
from vartrace.tracing.aliases import Aliases
from vartrace.tracing.chunk import Chunk, staging_for
from vartrace.tracing.config import (
    Gather,
    GatherCallback,
    Mode,
    PreSave,
    StagingMode,
    TracerConfig,
    warn_unused_savers,
)
from vartrace.tracing.counting import CallsBeforeStart, counting_hooks, never_started
from vartrace.tracing.display import TracerSummary
from vartrace.tracing.eager import eager
from vartrace.tracing.gradients import GradientWatcher
from vartrace.tracing.graphs import GraphOutputs, in_fullgraph, warn_compiled
from vartrace.tracing.handover import HandOver, gathers_at_start, pre_saved, run_callbacks
from vartrace.tracing.hooks import SinkHooks
from vartrace.tracing.iterations import IterationCounter
from vartrace.tracing.manual import subscribe, unsubscribe
from vartrace.tracing.outputs import OutputWatch
from vartrace.tracing.results import Results
from vartrace.tracing.silence import SilenceWatch
from vartrace.tracing.sites import Target, resolve, wildcard_grad_sites

__all__ = ["CallbackError", "ModelTracer"]

# ``@every`` sees in-place changes (``.data`` writes, numpy writes, list appends), not only
# rebinding and version bumps.
set_change_test(snapshot, unchanged)

_graph_task_id = torch._C._current_graph_task_id  # -1 outside autograd's backward


def _in_backward() -> bool:
    """Whether autograd's backward runs now (a checkpointed forward being recomputed)."""
    return _graph_task_id() != -1


def _option(name: str) -> Any:
    """A read-only attribute of the tracer: its option `name`, as validated."""
    return property(
        lambda self: getattr(self._config, name),
        doc=f"The `{name}` option, as validated (see the arguments of `ModelTracer`).",
    )


class ModelTracer:
    """Record the values a model's code holds, at sites named by wildcard paths.

    Example:
        ```python
        saver = H5PYSaverCallback("run.h5")
        with ModelTracer(model, ["forward.x", "layers.*.attn.forward.scores"],
                         post_gather_callbacks=[saver], gathering_interval=8) as tracer:
            for batch in loader:
                loss = model(batch).sum()
                loss.backward()
        saver.close()
        ```

    Gradient accumulation, or a trainer that never calls `model` itself:
    number iterations by optimizer steps:

    ```python
    with ModelTracer(model, ["**.scores"], optimizer=opt) as tracer:
        trainer_loop()   # every record is tagged with opt's completed steps + 1
    ```

    Args:
        model: the model; DDP / DataParallel / FSDP / compile wrappers are
            unwrapped, so paths never start with `module.`.
        paths: patterns (see the path language in docs/paths.md); each must match a
            site of the model, else `ValueError` (a warning if `strict=False`).
        pre_save_callbacks: `cb(name, value, iteration) -> value` on each
            captured leaf before it is copied; return [`vartrace.DROP`][vartrace.DROP]
            to drop the record.  A structure it returns (a dict of statistics)
            is recorded as its leaves, `<name>.<key>`.
        pre_gather_callbacks: `cb(name, trace)` on each rank's chunk.
        post_gather_callbacks: `cb(name, trace)` on the gathered chunk (rank 0).
        post_trace_callbacks: `cb(name, trace)` on each accumulated result at exit.
        gathering_interval: gather every this many iterations (and at exit).
        trace_interval: record iterations 1, 1 + k, 1 + 2k, ...
        mode: which outermost model calls are iterations: `"train"`,
            `"eval"` (by `model.training`) or `"any"`.
        optimizer: number iterations by this optimizer's steps (its
            completed `step()` calls plus one) instead of by model calls;
            see `vartrace.tracing.iterations` for every rule.  A wrapper (accelerate's
            `accelerator.prepare(opt)`, Lightning's) counts the steps of the torch
            optimizer it holds.
        change_detection: record a site only when its value changed.
        device: where recorded copies live (`"cuda"` is the current CUDA device).
        gather: `True` gathers every rank's records to rank 0; `False` keeps each
            rank's records on that rank (shard files, `run.rank3.h5`); `"node"` gathers
            each node's ranks to the node's first rank, which writes the node's shard
            (`run.node1.h5`, on that node's disk): nothing crosses nodes (docs/distributed.md).
        group: the process group to gather within (`dist.new_group(...)`), to its first
            rank, which runs the post-gather callbacks; default: the `process_group` of a
            `DistributedDataParallel` model, else every rank.
        strict: raise (`True`) or warn (`False`) on patterns matching nothing.
        staging: how records of accelerator tensors leave the step.
            `"async"`: a clone on the device and an event at capture, and
            everything else (copy to the host, change detection, gathers,
            post-gather callbacks) on a `vartrace-staging-N` thread, so that
            the step never waits for the device (see `vartrace.staging.stager`).
            `"sync"`: each record is copied where it is captured (a
            blocking device-to-host copy on a GPU).  `"auto"` (default):
            `"async"` when the model has parameters or buffers on an
            accelerator, or `device` is one.
        max_inflight_bytes: with asynchronous staging, the most bytes of
            records between capture and the host at once.
        on_full: what a record that would exceed `max_inflight_bytes` does:
            `"wait"` until earlier records land (counted in
            [`staging_stats`][vartrace.ModelTracer.staging_stats], warned once), or `"drop"`
            (counted per site; an [`Unstored`][vartrace.Unstored] marker takes its place).
        statistics: statistics mode in one word: `True` reduces every tensor record but
            a scalar (kept whole) to its float64 statistics ([`vartrace.stats`][vartrace.stats]),
            a reducer made by `vartrace.stats(...)` is used as given; it runs before the
            other pre-save callbacks.  The same as `pre_save_callbacks=[vartrace.stats()]`.
        max_host_bytes: the most host memory the tracer holds: the records kept in
            [`results`][vartrace.ModelTracer.results] (no saver emptied their chunks), and the
            host slots of asynchronous staging.  Crossing half of it warns once, with the
            figures and the ways out (a saver, statistics mode, fewer sites); past it, a
            gathered chunk's records are not kept: each site gets one
            [`Unstored`][vartrace.Unstored] marker saying so.  Default: a tenth of the machine's
            memory, at most 8 GiB.
        max_device_bytes: with asynchronous staging and change detection, the most
            device memory held for the comparison: each compared site's previous record
            stays on its device, first come first served, within this many bytes; a site
            past it is compared on the host instead (the same records kept, at the cost
            of a host pass on the staging thread; counted in
            `staging_stats.host_compares`).  `0` compares every site on the host.
            Default: a twentieth of the device's memory, at most 2 GiB (1 GiB where
            torch cannot tell the memory).
    """

    def __init__(
        self,
        model: nn.Module,
        paths: str | Sequence[str],
        *,
        pre_save_callbacks: Iterable[PreSave] = (),
        pre_gather_callbacks: Iterable[GatherCallback] = (),
        post_gather_callbacks: Iterable[GatherCallback] = (),
        post_trace_callbacks: Iterable[GatherCallback] = (),
        gathering_interval: int = 1,
        trace_interval: int = 1,
        mode: Mode = "train",
        change_detection: bool = True,
        device: str | torch.device = "cpu",
        gather: Gather = True,
        strict: bool = True,
        optimizer: Any = None,
        staging: StagingMode = "auto",
        max_inflight_bytes: int = 1 << 30,
        on_full: OnFull = "wait",
        max_host_bytes: int | None = None,
        max_device_bytes: int | None = None,
        statistics: bool | Callable[[str, Any, int], Any] = False,
        group: Any = None,
    ) -> None:
        self._config = config = TracerConfig.from_options(
            model,
            pre_save_callbacks=pre_save_callbacks,
            pre_gather_callbacks=pre_gather_callbacks,
            post_gather_callbacks=post_gather_callbacks,
            post_trace_callbacks=post_trace_callbacks,
            gathering_interval=gathering_interval,
            trace_interval=trace_interval,
            mode=mode,
            change_detection=change_detection,
            device=device,
            gather=gather,
            strict=strict,
            optimizer=optimizer,
            staging=staging,
            max_inflight_bytes=max_inflight_bytes,
            on_full=on_full,
            max_host_bytes=max_host_bytes,
            max_device_bytes=max_device_bytes,
            statistics=statistics,
            group=group,
        )
        self._compiled = config.compiled
        self._aliases = Aliases()
        self._reductions = Reductions()
        self._placements = Placements()  # the DTensors' placements, noted by _store
        self._targets = resolve(self.model, paths, strict=strict, aliases=self._aliases)
        warn_unused_savers(config.callbacks)
        self._silence = SilenceWatch(self._targets, mode, self.model)
        self._results = Results()
        self._chunk = Chunk(compare=config.change_detection)
        # Until start: a staging with nothing to count or wait for (results, staging_stats).
        self._stager: Staging = staging_for(self._chunk, config.device)
        self._hooks = SinkHooks()  # the callbacks' hooks, looked up at start
        self._rows: SiteRows | None = None  # statistics rows' own path, chosen at start
        self._hand_over: HandOver | None = None  # made at start
        self._patched: list[tuple[Target, Hook]] = []
        self._outputs = OutputWatch()  # module outputs, after the modules' forward hooks
        self._graph_outputs = GraphOutputs()  # those inside fullgraph regions
        self._in_graph: set[int] = set()  # the targets recorded so, by id
        self._undo = contextlib.ExitStack()  # every undo of start, closed by _release
        # The counting hooks of the root's parts, until the root is first called.
        self._parts: contextlib.ExitStack | None = contextlib.ExitStack()
        self._iterations = IterationCounter(
            self.model,
            mode,
            trace_interval=config.trace_interval,
            gathering_interval=config.gathering_interval,
            set_enabled=self._set_enabled,
            flush=self._flush,
            end=self._end_iteration,
        )
        self._per_thread = self._iterations.per_thread  # each thread's state, read every record
        self._split_warned: set[type] = set()
        self._transformed_warned: set[str] = set()  # sites recorded under torch.func.vmap
        self._started = False
        self._finished = False
        self._where = ""  # the user's line that started it
        self._first_seen = False  # the first traced iteration ended
        self._gradients = GradientWatcher(
            self._store, wildcard_grad_sites(self._targets), self.model
        )
        counter = CallsBeforeStart()
        self._unstarted = weakref.finalize(
            self,
            never_started,
            self.model.register_forward_pre_hook(counter),
            counter,
            type(self.model).__name__,
        )

    model = _option("model")
    pre_save_callbacks = _option("pre_save_callbacks")
    pre_gather_callbacks = _option("pre_gather_callbacks")
    post_gather_callbacks = _option("post_gather_callbacks")
    post_trace_callbacks = _option("post_trace_callbacks")
    gathering_interval = _option("gathering_interval")
    trace_interval = _option("trace_interval")
    mode = _option("mode")
    change_detection = _option("change_detection")
    device = _option("device")
    gather = _option("gather")
    staging = _option("staging")
    max_inflight_bytes = _option("max_inflight_bytes")
    on_full = _option("on_full")
    max_host_bytes = _option("max_host_bytes")
    max_device_bytes = _option("max_device_bytes")

    # -- public API ---------------------------------------------------------------------------

    @property
    def results(self) -> Results:
        """What the post-gather callbacks left of every gathered record, by site.

        With asynchronous staging, reading it first waits for the records
        gathered so far to be handed over (outside the step):

        ```python
        model(x)
        tracer.results["head"].values   # complete up to the last gather
        ```
        """
        if not self._started:
            _warnings.warn(
                "vartrace: this ModelTracer was never started, so it recorded nothing: use "
                "`with ModelTracer(...) as tracer:` around the steps, or tracer.start() "
                "before them and tracer.stop() after",
                UserWarning,
            )
        self._stager.drain()
        return self._results

    @property
    def staging_stats(self) -> StagingStats | None:
        """Counts of asynchronous staging (records staged, kept, waits, drops), or `None`.

        `None` with `staging="sync"`.  Example:

        ```python
        stats = tracer.staging_stats
        print(stats.waits, stats.wait_seconds, stats.dropped_by_site)
        ```
        """
        return self._stager.stats

    @property
    def iteration(self) -> int:
        """The iteration that this thread's records are tagged with now (0 before the first)."""
        return self._iterations.state.iteration

    def set_iteration(self, iteration: int) -> None:
        """Tag every record with `iteration` until the next call (user-driven iterations).

        Example (gradient accumulation: four micro-batches per step):

        ```python
        for step, batches in enumerate(loader, 1):
            tracer.set_iteration(step)
            for batch in batches:
                model(batch).sum().backward()
        ```
        """
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            raise TypeError(f"iteration must be an int, not {type(iteration).__name__}")
        self._iterations.set_user(iteration)

    def start(self) -> ModelTracer:
        """Patch the model and start recording (`with` does this for you)."""
        if self._started:
            raise RuntimeError("this ModelTracer was already started; create a new one")
        self._started = True
        found = self._unstarted.detach()
        if found is not None:
            found[2][0].remove()  # the hook counting calls before the start
        config = self._config
        self._chunk.rank = distributed.rank()
        group, context = gathers_at_start(config)  # a collective where it makes a group
        hooks = self._hooks = SinkHooks.of(
            config.pre_save_callbacks, config.post_gather_callbacks, config.callbacks
        )
        for on_start in hooks.on_start:
            on_start(context)
        self._chunk.wait_for(hooks.make_room)  # savers writing on a thread of their own
        facts = (self._reductions, self._placements)
        self._hand_over = HandOver(
            self._chunk, self._results, self._aliases, facts, config, hooks, group
        )
        self._stager = staging_for(self._chunk, config.device, config)
        build_kernel(hooks.pre_save)  # the statistics kernel, built before any step
        self._rows = SiteRows.of(hooks.pre_save, config, self._chunk, self._reductions)
        try:
            self._attach()
        except BaseException:
            self._undo.close()
            self._stager.close()
            raise
        subscribe(self._record_manual)
        self._undo.callback(unsubscribe, self._record_manual)
        _exit.watch(self)
        self._undo.callback(_exit.unwatch, self)
        _forks.watch(self)
        self._undo.callback(_forks.unwatch, self)
        self._where = _warnings.user_line()
        registry.enter(self, [self.model, *(target.module for target in self._targets)])
        self._undo.callback(registry.leave, self)
        return self

    def stop(self, *, flush: bool = True) -> None:
        """Restore the model, hand over the last chunk and run post-trace callbacks.

        Then the warnings that a `-W error` filter turned into errors while the
        steps ran are emitted again (see `vartrace._support.warnings`): the first one
        raises here, once every record was handed over.
        """
        self._finish(flush)
        _warnings.release()

    def _stop_at_exit(self) -> None:
        """At interpreter exit, a tracer left running hands its last records on (see
        `vartrace._support.exit`); a failure then is a warning, the exit goes on.  A call
        of the model after this stop (a daemon thread still training) is said once: it is
        recorded nowhere."""
        registry.say_late_calls(self.model, lambda: self._finished)
        try:
            self._finish(flush=True)
        except Exception as error:
            _warnings.warn(
                f"vartrace: stopping a tracer left running at exit failed: "
                f"{type(error).__name__}: {error}",
                RuntimeWarning,
            )

    def _finish(self, flush: bool) -> None:
        """`stop` without emitting the warnings kept during the steps."""
        if not self._started or self._finished:
            return
        called = [target for target, hook in self._patched if hook.calls]
        self._release()
        assert self._hand_over is not None  # made at start
        try:
            last = functools.partial(self._hand_over, final=True) if flush else None
            self._stager.close(last)
            if flush:
                results = self._results
                for name in results.stored:
                    run_callbacks(
                        "post_trace", self._config.post_trace_callbacks, name, results[name]
                    )
        finally:  # after the flush: what warns here never keeps the records from the file
            counter = self._iterations
            self._silence.report(counter.in_mode_calls > 0, counter.other_mode_calls, called)
            self._hooks.restate_failures()  # (a saver's full disk)

    def _forget(self) -> None:
        """In a forked child (a DataLoader worker...): restore the model, record nothing.

        What the parent buffered is the parent's to write; the child may start a
        tracer of its own.
        """
        self._chunk.forget()
        # The stager's thread stayed in the parent; the staging's lock may have been held.
        self._stager = staging_for(self._chunk, self._config.device)
        self._release()

    def _release(self) -> None:
        """Stop recording and restore the model, its hooks and the record subscription."""
        self._finished = True
        self._undo.close()

    def __repr__(self) -> str:
        return self._summary().plain()

    def _repr_html_(self) -> str:
        return self._summary().html()

    def _summary(self) -> TracerSummary:
        state = "stopped" if self._finished else "running" if self._started else "not started"
        methods = tuple(f"{t.path or '<root>'}.{t.method.name}" for t in self._targets)
        held = self._chunk.bytes + (self._hand_over.held if self._hand_over else 0)
        model = type(self.model).__name__
        return TracerSummary(state, model, methods, self._chunk.kept, held, self._where)

    def __enter__(self) -> ModelTracer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object
    ) -> None:
        # After an exception on one rank of several, a final gather would wait
        # for ranks that are not coming: keep the chunk local instead.
        flush = exc is None or distributed.world_size() == 1
        if exc is None:
            self.stop(flush=flush)
            return
        try:
            self._finish(flush)
        except Exception as error:  # the step's exception goes on, unchanged
            report_during(exc, "the tracer's final flush failed", error)
        _warnings.release(during=exc)

    # -- patching (every undo goes on self._undo) ---------------------------------------------

    def _attach(self) -> None:
        # A frame tracer sees nothing inside compiled code: traced methods always run
        # eagerly, whether the model is compiled before or after the tracer starts; inside
        # fullgraph=True regions only module outputs are recorded, from the graph.
        in_graph = self._in_graph = in_fullgraph(self.model, self._config.fullgraph, self._targets)
        undo = self._undo
        undo.callback(self._gradients.close)
        if self._compiled:
            warn_compiled(self._targets, self._in_graph)
        counter = self._iterations
        undo.callback(self._patched.clear)
        counting: dict[int, list[int]] = {}  # the counting forward hooks, by module
        for target in self._targets:
            if id(target) in in_graph:
                hook = Hook(target.probe(), self._capture)
                self._graph_outputs.attach(undo, target, hook)
                self._patched.append((target, hook))
                continue
            # The root's own forward counts even when called as ``model.forward(x)``.
            is_root = target.module is self.model and target.method.name == "forward"
            enter = functools.partial(self._enter_root, False) if is_root else self._enter_method
            probe = self._outputs.probe(undo, target, counting)
            hook = Hook(probe, self._capture, enter, counter.exit)
            attach(target.module, target.method.name, target.method.code, hook, eager)
            undo.callback(detach, target.module, target.method.name, hook)
            self._patched.append((target, hook))
        enter_root = eager(self._enter_root)
        enter_part = eager(self._enter_method)
        leave = eager(self._leave)

        def before_root(module: nn.Module, args: Any) -> None:
            enter_root(torch.compiler.is_compiling(), module)

        def before_part(module: nn.Module, args: Any) -> None:
            enter_part(module)

        def after(module: nn.Module, args: Any, output: Any) -> None:
            leave(module)

        counting[id(self.model)] = counting_hooks(undo, self.model, self, before_root, after)
        assert self._parts is not None  # closed only once the root runs
        parts = undo.enter_context(self._parts)
        for part in self._counting_parts():
            counting[id(part)] = counting_hooks(parts, part, self, before_part, after)
        if self._config.optimizer is not None:
            counter.follow_steps()
            handle = self._config.optimizer.register_step_post_hook(lambda *_: counter.stepped())
            undo.callback(handle.remove)

    def _counting_parts(self) -> list[nn.Module]:
        """The root's children that hold traced sites: their outermost calls count until
        the root itself is called (a LightningModule's `self.model`)."""
        heads = {t.path.split(".", 1)[0] for t in self._targets if t.path}
        return [child for name, child in self.model.named_children() if name in heads]

    # -- iterations (rules: vartrace.tracing.iterations) --------------------------------------

    def _set_enabled(self, enabled: bool) -> None:
        for _, hook in self._patched:
            hook.enabled = enabled

    # Each returns whether it entered a call that the counter's ``exit`` must end.

    def _enter_root(self, compiling: bool, module: nn.Module | None = None) -> bool:
        if compiling and not self._compiled:
            self._compiled = True  # compiled after the tracer started
            warn_compiled(self._targets, self._in_graph)
        if module is None and self._iterations.nested():
            return False  # the root's patched forward, inside the call its module hooks counted
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.close()  # the root is called: only its calls count from now on
        self._iterations.enter(root=True, replay=_in_backward(), module=module)
        return True

    def _enter_method(self, module: nn.Module | None = None) -> bool:
        if module is None and self._per_thread.state.depth > 0:
            return False  # a traced method inside a call this thread runs: nothing to count
        self._iterations.enter(root=False, replay=_in_backward(), module=module)
        return True

    def _leave(self, module: nn.Module) -> None:
        # A forward hook registered with always_call runs inside ``except`` when forward raised.
        self._iterations.exit(failed=sys.exc_info()[0] is not None, module=module)

    # -- the record path, up to admission -----------------------------------------------------

    def _capture(self, site: str, value: Any, grad: bool) -> None:
        silence = self._silence  # SilenceWatch.saw, without its call
        (silence.nones if value is None else silence.values).add(site)
        if _graph_task_id() != -1:  # _in_backward(), on the record path without its call
            # A forward recomputed during backward (activation checkpointing) records
            # nothing twice; a reentrant checkpoint's forward left @grad sites to it.
            if grad:
                self._gradients.recomputed(site, value)
            return
        iteration = self._per_thread.state.records_as  # IterationCounter.capturing, without a call
        if iteration is None:
            return  # another thread's iteration enabled the hooks
        if grad:
            self._gradients.watch(site, value, iteration)
        elif type(value) is torch.Tensor and not self._hooks.pre_save and not is_transformed(value):
            # The common case, a plain tensor and no pre-save callback: what `_store` would
            # do with it after its checks (no DTensor, nothing to transform or call back).
            self._stager.admit_plain(site, value, iteration)
        elif type(value) is torch.Tensor and self._rows is not None and not is_transformed(value):
            if not self._rows.record(site, value, iteration):  # (statistics mode's own path)
                self._store(site, value, iteration)
        elif isinstance(value, torch.Tensor):
            self._store(site, value, iteration)
        else:
            for name, leaf in split_object(site, value, self._split_warned):
                self._store(name, leaf, iteration)

    def _store(self, site: str, value: Any, iteration: int, *, saved: bool = False) -> None:
        """Record `value` at `site`; `saved`: the pre-save callbacks already ran."""
        if self._rows is not None:
            self._rows.forget(site)
        if isinstance(value, torch.Tensor) and is_distributed(value):
            self._placements.note(site, value)  # how the ranks' shards join
            value = local_shard(value, site)  # a DTensor: this rank's shard, no collective
        if isinstance(value, torch.Tensor) and is_transformed(value):
            with torch._C._DisableFuncTorch():  # copies made under torch.func stay plain
                plain = untransformed(value, site, self._transformed_warned)
                self._store(site, plain, iteration, saved=saved)
            return
        fresh = False  # a new tensor a callback made (a statistics row): nothing to clone
        pre_save = self._hooks.pre_save
        if not saved and pre_save:
            captured = value
            value, fresh = pre_saved(pre_save, site, value, iteration)
            if value is DROP:
                return
            if not isinstance(value, torch.Tensor):
                # What a callback returns is split like a captured value: a dict of
                # tensors gives the leaves <site>.<key>.
                for name, leaf in leaves(value, site):
                    for part, piece in split_object(name, leaf, self._split_warned):
                        self._store(part, piece, iteration, saved=True)
                return
            if value is not captured and isinstance(captured, (torch.Tensor, np.ndarray)):
                self._reductions.note(site, captured)
        self._stager.admit(site, value, iteration, fresh=fresh)

    def _record_manual(self, name: str, value: Any) -> None:
        if self._iterations.records_manual():
            iteration = self._iterations.state.iteration
            for site, leaf in leaves(value, name):
                for part, piece in split_object(site, leaf, self._split_warned):
                    self._store(part, piece, iteration)

    # -- the hand-over (vartrace.tracing.handover) --------------------------------------------

    def _end_iteration(self) -> None:
        """An outermost call ended without a gather: its records start for the host."""
        self._after_first_iteration()
        self._stager.flush()

    def _after_first_iteration(self) -> None:
        """Once the first traced iteration ended: say which patterns' methods it never called."""
        if self._first_seen or self._finished or not self._iterations.in_mode_calls:
            return
        self._first_seen = True
        self._silence.after_first_iteration(
            [target for target, hook in self._patched if hook.calls]
        )
        stats = self._stager.stats
        if stats is not None and stats.admitted and not stats.staged:
            _warnings.warn(
                "vartrace: staging='async', but no record of iteration 1 was an accelerator "
                "tensor: records are copied on the thread that captures them, as with "
                "'sync'; only change detection, gathers and callbacks run on the staging "
                "thread",
                UserWarning,
            )

    def _flush(self) -> None:
        """A gather: the chunk is handed over after every record captured before."""
        self._after_first_iteration()
        assert self._hand_over is not None  # iterations end only once started
        self._stager.call(self._hand_over)
