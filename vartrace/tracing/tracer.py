"""ModelTracer: record values of a model's code while it runs, without editing it.

Data flows one way: the engine captures leaves from patched methods ->
pre-save callbacks -> a detached copy -> change detection -> the chunk
buffer -> pre-gather callbacks -> gather to rank 0 -> post-gather
callbacks -> [`ModelTracer.results`][vartrace.ModelTracer.results], and post-trace callbacks at the
end.  With asynchronous staging (`vartrace.staging`, the default for a
model on an accelerator) the capturing thread only admits each record;
everything from the copy to the host on runs on the stager's thread, in
capture order.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vartrace._support import exit as _exit
from vartrace._support import forks as _forks
from vartrace._support import warnings as _warnings
from vartrace._support.memory import held_bytes
from vartrace.distributed import gathers as distributed
from vartrace.engine.frames import set_change_test
from vartrace.engine.patching import Hook, attach, detach, filter_state
from vartrace.engine.structures import leaves
from vartrace.errors import CallbackError
from vartrace.markers import DROP, Unstored
from vartrace.reduced import Reductions
from vartrace.staging import (
    OnFull,
    Stager,
    StagingStats,
    check_device_bytes,
)
from vartrace.statistics.records import stats
from vartrace.tensors import (
    copy_leaf,
    is_transformed,
    same,
    snapshot,
    split_object,
    unchanged,
    untransformed,
)
from vartrace.trace import RunContext, Trace, report_during, unstacked
from vartrace.tracing.aliases import Aliases
from vartrace.tracing.gradients import GradientWatcher
from vartrace.tracing.iterations import IterationCounter
from vartrace.tracing.manual import subscribe, unsubscribe
from vartrace.tracing.modules import fullgraph_regions, is_compiled, unwrap
from vartrace.tracing.results import Results
from vartrace.tracing.silence import SilenceWatch
from vartrace.tracing.sites import Target, resolve, wildcard_grad_sites

__all__ = ["CallbackError", "ModelTracer"]

PreSave = Callable[[str, Any, int], Any]
GatherCallback = Callable[[str, Trace], None]
Mode = Literal["train", "eval", "any"]
Staging = Literal["auto", "async", "sync"]
_MISSING = object()

# ``@every`` sees in-place changes (``.data`` writes, numpy writes, list appends), not only
# rebinding and version bumps.
set_change_test(snapshot, unchanged)


def _name(callback: object) -> str:
    return getattr(callback, "__qualname__", None) or repr(callback)


def _failed(stage: str, callback: object, site: str, error: Exception) -> CallbackError:
    return CallbackError(
        f"{stage} callback {_name(callback)} raised on site {site!r}: "
        f"{type(error).__name__}: {error}"
    )


def _run_callbacks(
    stage: str, callbacks: Sequence[GatherCallback], name: str, trace: Trace
) -> None:
    for callback in callbacks:
        try:
            callback(name, trace)
        except Exception as error:
            raise _failed(stage, callback, name, error) from error
        trace.check_lengths(_name(callback))


_graph_task_id = torch._C._current_graph_task_id  # -1 outside autograd's backward


def _in_backward() -> bool:
    """Whether autograd's backward runs now (a checkpointed forward being recomputed)."""
    return _graph_task_id() != -1


def _check_callbacks(stage: str, callbacks: list[Any], arguments: tuple[str, ...]) -> None:
    """Raise `TypeError` naming a callback that cannot be called with `arguments`."""
    for index, callback in enumerate(callbacks):
        if not callable(callback):
            raise TypeError(f"{stage}[{index}] is a {type(callback).__name__}, not callable")
        try:
            signature = inspect.signature(callback)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            wanted = f"cb({', '.join(arguments)})"
            hint = ""
            if stage == "pre_save_callbacks" and _binds(signature, 2):
                hint = _two_arguments_hint(signature)
            elif stage != "pre_save_callbacks" and _binds(signature, 3):
                hint = "; it takes (name, value, iteration): pass it in pre_save_callbacks"
            raise TypeError(
                f"{stage}[{index}] {_name(callback)} cannot be called as {wanted}{hint}"
            ) from None


def _two_arguments_hint(signature: inspect.Signature) -> str:
    """Advice for a pre-save callback that takes two arguments: a gather callback misplaced
    (its second parameter is a trace), or a pre-save callback without `iteration`."""
    second = list(signature.parameters.values())[1:2]
    if second and (
        second[0].name in ("trace", "chunk") or second[0].annotation in (Trace, "Trace")
    ):
        return "; it takes (name, trace): pass it in post_gather_callbacks"
    return (
        "; a pre-save callback is called with the iteration too: add a third parameter,"
        " def cb(name, value, iteration)"
    )


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def _warn_unused_savers(callbacks: list[Any]) -> None:
    """Warn about savers created but given to no tracer, when this tracer has none: they
    would write nothing.  (A tracer given a saver may leave others to later tracers.)"""
    writer = sys.modules.get("vartrace.storage.writer")
    if writer is None:
        return
    if any(isinstance(callback, writer.H5PYSaverCallback) for callback in callbacks):
        return
    for saver in writer.unused_savers():
        if not any(saver is callback for callback in callbacks):
            _warnings.warn(
                f"vartrace: {saver!r} is not among this tracer's callbacks, so it will write "
                "nothing; pass it as ModelTracer(..., post_gather_callbacks=[saver])",
                stacklevel=3,
            )


def _record_device(device: str | torch.device) -> torch.device:
    """`device` with its index (`"cuda"` is the current CUDA device), or a clear error.

    Devices compare by type and index: `torch.device("cuda") != torch.device("cuda", 0)`,
    so an index left out would send every record through a copy.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "device='meta' would keep only shapes and dtypes, no values: record on 'cpu' "
            "or an accelerator"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise ValueError(
                f"device={str(device)!r}: this torch ({torch.__version__}) has {build}; "
                "record on device='cpu'"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={str(device)!r}: only {count} CUDA device(s) are visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps': MPS is not available in this torch")
    if device.type != "cpu" and device.index is None:
        current = getattr(torch.get_device_module(device.type), "current_device", None)
        if current is not None:
            device = torch.device(device.type, current())
    return device


def _on_accelerator(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` lives on an accelerator."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return any(not (t.is_cpu or t.is_meta) for t in tensors)


_MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _without_hooks(ids: set[int], state: dict[str, Any]) -> dict[str, Any]:
    """A module's state without the forward hooks registered under `ids`."""
    for name in _MODULE_HOOKS:
        hooks = state.get(name)
        if hooks and not ids.isdisjoint(hooks):
            state[name] = type(hooks)((key, v) for key, v in hooks.items() if key not in ids)
    return state


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that `optimizer` is or wraps (accelerate's `AcceleratedOptimizer`
    in `.optimizer`, Lightning's `LightningOptimizer` in `._optimizer`), or `TypeError`.

    Its step post-hooks run once per step that really updates the parameters: a
    wrapper's `step` that skips the update (a gradient-accumulation micro-batch)
    counts no step.
    """
    current, seen = optimizer, set()
    while id(current) not in seen:
        seen.add(id(current))
        # A wrapper subclassing Optimizer without calling its __init__ lacks the hooks' dicts.
        if isinstance(current, torch.optim.Optimizer) and hasattr(
            current, "_optimizer_step_post_hooks"
        ):
            return current
        inner = getattr(current, "optimizer", None) or getattr(current, "_optimizer", None)
        if inner is None:
            break
        current = inner
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a wrapper holding one in .optimizer "
        f"or ._optimizer, not {type(optimizer).__name__}"
    )


def _statistics_reducer(statistics: bool | PreSave) -> list[PreSave]:
    """The pre-save reducer `ModelTracer(statistics=...)` asks for, as a list."""
    if statistics is False:
        return []
    if statistics is True:
        return [stats()]
    if callable(statistics) and not isinstance(statistics, bool):
        return [statistics]
    raise TypeError(
        f"statistics must be True, False or a reducer made by vartrace.stats(...), "
        f"not {statistics!r}"
    )


def _default_host_bytes() -> int:
    """A tenth of the machine's memory, at most 8 GiB (8 GiB where it cannot be read)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
    return min(8 << 30, memory // 10)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


class _CallsBeforeStart:
    """Counts the calls of a model whose tracer is not started yet (a forward pre-hook;
    a class of its own, so that a model saved with it still pickles)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.calls += 1


def _never_started(handle: RemovableHandle, counter: _CallsBeforeStart, model: str) -> None:
    """A tracer is collected (or the interpreter exits) without having started."""
    handle.remove()
    if counter.calls:
        _warnings.warn(
            f"vartrace: a ModelTracer of {model} was never started while the model ran "
            f"{counter.calls} time(s): nothing was recorded; use `with ModelTracer(...) as "
            "tracer:` around the steps, or tracer.start() before them and tracer.stop() after",
            UserWarning,
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
        gather: `False` keeps each rank's records on that rank (shard files).
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
        statistics: statistics mode in one word: `True` reduces every tensor record to
            its float64 statistics ([`vartrace.stats`][vartrace.stats]), a reducer made by
            `vartrace.stats(...)` is used as given; it runs before the other pre-save
            callbacks.  The same as `pre_save_callbacks=[vartrace.stats()]`.
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
        gather: bool = True,
        strict: bool = True,
        optimizer: Any = None,
        staging: Staging = "auto",
        max_inflight_bytes: int = 1 << 30,
        on_full: OnFull = "wait",
        max_host_bytes: int | None = None,
        max_device_bytes: int | None = None,
        statistics: bool | Callable[[str, Any, int], Any] = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        optimizer = None if optimizer is None else _torch_optimizer(optimizer)
        if mode not in ("train", "eval", "any"):
            raise ValueError(f"mode must be 'train', 'eval' or 'any', not {mode!r}")
        if staging not in ("auto", "async", "sync"):
            raise ValueError(f"staging must be 'auto', 'async' or 'sync', not {staging!r}")
        if on_full not in ("wait", "drop"):
            raise ValueError(f"on_full must be 'wait' or 'drop', not {on_full!r}")
        for name, flag in (
            ("change_detection", change_detection),
            ("gather", gather),
            ("strict", strict),
        ):
            if not isinstance(flag, bool):  # "no" would be true
                raise TypeError(f"{name} must be True or False, not {flag!r}")
        self.max_inflight_bytes = _positive("max_inflight_bytes", max_inflight_bytes)
        self.on_full = on_full
        self.max_host_bytes = (
            _default_host_bytes()
            if max_host_bytes is None
            else _positive("max_host_bytes", max_host_bytes)
        )
        self.max_device_bytes = check_device_bytes(max_device_bytes)
        self._held = 0  # bytes of the records kept in the results
        self._warned_held: bool | str = False
        self._fullgraph = fullgraph_regions(model)  # seen on the wrapper, before unwrap
        self.model = unwrap(model)
        self._compiled = is_compiled(model)
        self.pre_save_callbacks = [*_statistics_reducer(statistics), *pre_save_callbacks]
        self.pre_gather_callbacks = list(pre_gather_callbacks)
        self.post_gather_callbacks = list(post_gather_callbacks)
        self.post_trace_callbacks = list(post_trace_callbacks)
        _check_callbacks(
            "pre_save_callbacks", self.pre_save_callbacks, ("name", "value", "iteration")
        )
        for stage in ("pre_gather_callbacks", "post_gather_callbacks", "post_trace_callbacks"):
            _check_callbacks(stage, getattr(self, stage), ("name", "trace"))
        self.gathering_interval = _positive("gathering_interval", gathering_interval)
        self.trace_interval = _positive("trace_interval", trace_interval)
        self.mode = mode
        self.change_detection = change_detection
        self.device = _record_device(device)
        if staging == "auto":
            staging = "async" if self.device.type != "cpu" or _on_accelerator(model) else "sync"
        self.staging = staging
        self._stager: Stager | None = None
        self._group: Any = None  # the gathers' own process group, with asynchronous staging
        self.gather = gather
        self._aliases = Aliases()
        self._reductions = Reductions()
        self._targets = resolve(self.model, paths, strict=strict, aliases=self._aliases)
        _warn_unused_savers(self._all_callbacks())
        self._silence = SilenceWatch(self._targets, mode, self.model)
        self._results = Results()
        self._hooks: list[tuple[Target, Hook]] = []
        self._handles: list[RemovableHandle] = []
        self._part_handles: list[RemovableHandle] = []  # until the root is first called
        self._optimizer = optimizer
        self._iterations = IterationCounter(
            self.model,
            mode,
            trace_interval=self.trace_interval,
            gathering_interval=self.gathering_interval,
            set_enabled=self._set_enabled,
            flush=self._flush,
            end=self._end_iteration,
        )
        self._chunk: dict[str, Trace] = {}
        self._chunk_bytes = 0  # of the chunk's records, counted while `_room` is not empty
        self._room: list[Callable[[int], None]] = []  # background savers' make_room (start)
        self._last: dict[str, Any] = {}
        self._split_warned: set[type] = set()
        self._transformed_warned: set[str] = set()  # sites recorded under torch.func.vmap
        self._order = 0
        self._lock = threading.Lock()  # threads calling the model at once share the chunk
        self._flush_lock = threading.Lock()
        self._rank = 0
        self._started = False
        self._finished = False
        self._first_seen = False  # the first traced iteration ended
        self._gradients = GradientWatcher(self._store, wildcard_grad_sites(self._targets))
        counter = _CallsBeforeStart()
        self._unstarted = weakref.finalize(
            self,
            _never_started,
            self.model.register_forward_pre_hook(counter),
            counter,
            type(self.model).__name__,
        )

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
        if self._stager is not None:
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
        return None if self._stager is None else self._stager.stats

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
        self._rank = distributed.rank()
        world = distributed.world_size()
        if self.staging == "async" and self.gather and world > 1:
            # Gathers run on the stager's thread: never on the group the training
            # thread's collectives (DDP's NCCL all-reduces) use, and never on a device.
            self._group = distributed.new_host_group()
        context = RunContext(self._rank, world, sharded=not self.gather and world > 1)
        for callback in self._all_callbacks():
            on_start = getattr(callback, "on_start", None)
            if on_start is not None:
                on_start(context)
        self._room = [  # savers writing on a thread of their own: records wait for them
            callback.make_room
            for callback in self.post_gather_callbacks
            if getattr(callback, "background", False) is True and hasattr(callback, "make_room")
        ]
        if self.staging == "async":
            self._stager = Stager(
                self._keep,
                max_inflight_bytes=self.max_inflight_bytes,
                on_full=self.on_full,
                device=self.device,
                compare=self.change_detection,
                max_device_bytes=self.max_device_bytes,
                host_bytes=self.max_host_bytes,  # the chunk waits in the slots until its gather
            )
        try:
            self._attach()
        except BaseException:
            self._detach()
            if self._stager is not None:
                self._stager.close()
            raise
        subscribe(self._record_manual)
        _forks.watch(self)
        _exit.watch(self)
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
        `vartrace._support.exit`); a failure then is a warning, the exit goes on."""
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
        called = [target for target, hook in self._hooks if hook.calls]
        self._release()
        try:
            if self._stager is not None:
                last = functools.partial(self._hand_over, final=True)
                self._stager.close(last if flush else None)
            elif flush:
                self._flush(final=True)
            if flush:
                results = self._results
                for name in results.stored:
                    _run_callbacks("post_trace", self.post_trace_callbacks, name, results[name])
        finally:  # after the flush: what warns here never keeps the records from the file
            counter = self._iterations
            self._silence.report(counter.in_mode_calls > 0, counter.other_mode_calls, called)
            self._restate_failures()

    def _restate_failures(self) -> None:
        """Warn again about each callback that stopped on a failure (a saver's full disk)."""
        for callback in self._all_callbacks():
            failure = getattr(callback, "failure", None)
            if isinstance(failure, BaseException):
                _warnings.warn(
                    f"vartrace: {type(callback).__name__} stopped during this run: {failure}",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _forget(self) -> None:
        """In a forked child (a DataLoader worker...): restore the model, record nothing.

        What the parent buffered is the parent's to write; the child may start a
        tracer of its own.
        """
        # A thread of the parent may have held them at the fork.
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._chunk = {}
        self._stager = None  # its thread stayed in the parent
        self._release()

    def _release(self) -> None:
        """Stop recording and restore the model, its hooks and the record subscription."""
        self._finished = True
        _forks.unwatch(self)
        _exit.unwatch(self)
        unsubscribe(self._record_manual)
        self._detach()
        self._gradients.close()

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

    # -- patching -----------------------------------------------------------------------------

    def _all_callbacks(self) -> list[object]:
        return [
            *self.pre_save_callbacks,
            *self.pre_gather_callbacks,
            *self.post_gather_callbacks,
            *self.post_trace_callbacks,
        ]

    def _attach(self) -> None:
        # A frame tracer sees nothing inside compiled code: traced methods always run
        # eagerly, whether the model is compiled before or after the tracer starts.
        # Under fullgraph=True nothing may leave the graph, and Dynamo raises inside the
        # step at the first hook or traced method there: refused before the step.
        found = [*self._fullgraph, *fullgraph_regions(self.model)]
        regions = list({id(module): (path, module) for path, module in found}.values())
        inside = {id(module) for _, region in regions for module in region.modules()}
        blocked = [t for t in self._targets if id(t.module) in inside]
        if blocked or id(self.model) in inside:
            names = ", ".join(f"{t.path or '<root>'}.{t.method.name}" for t in blocked)
            if id(self.model) in inside:  # then every traced method is inside too
                names += " and the model, whose calls count iterations"
            raise ValueError(
                f"cannot trace under torch.compile(fullgraph=True): "
                f"{', '.join(path or '<root>' for path, _ in regions)} compiled with "
                f"fullgraph=True hold the traced methods {names}, which must "
                "run eagerly, outside the graph; compile without fullgraph=True while tracing "
                "(only the traced methods leave the graph), or trace sites outside those modules"
            )
        eager = torch._dynamo.disable
        if self._compiled:
            self._warn_compiled()
        counter = self._iterations
        for target in self._targets:
            # The root's own forward counts even when called as ``model.forward(x)``.
            is_root = target.module is self.model and target.method.name == "forward"
            enter = functools.partial(self._enter_root, False) if is_root else self._enter_method
            hook = Hook(target.probe(), self._capture, enter, counter.exit)
            attach(target.module, target.method.name, target.method.code, hook, eager)
            self._hooks.append((target, hook))
        enter_root = eager(self._enter_root)
        enter_part = eager(self._enter_method)
        leave = eager(self._leave)

        def before_root(module: nn.Module, args: Any) -> None:
            enter_root(torch.compiler.is_compiling(), module)

        def before_part(module: nn.Module, args: Any) -> None:
            enter_part(module)

        def after(module: nn.Module, args: Any, output: Any) -> None:
            leave(module)

        self._handles += self._counting_hooks(self.model, before_root, after)
        for part in self._counting_parts():
            self._part_handles += self._counting_hooks(part, before_part, after)
        if self._optimizer is not None:
            counter.follow_steps()
            self._handles.append(
                self._optimizer.register_step_post_hook(lambda *_: counter.stepped())
            )

    def _counting_hooks(
        self, module: nn.Module, before: Callable[..., None], after: Callable[..., None]
    ) -> list[RemovableHandle]:
        """Register the hooks that count calls of `module`, left out of its copies and
        pickles (`copy.deepcopy`, `torch.save`, averaged models)."""
        handles = [
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, always_call=True),
        ]
        filter_state(module, self, functools.partial(_without_hooks, {h.id for h in handles}))
        return handles

    def _counting_parts(self) -> list[nn.Module]:
        """The root's children that hold traced sites: their outermost calls count until
        the root itself is called (a LightningModule's `self.model`)."""
        heads = {t.path.split(".", 1)[0] for t in self._targets if t.path}
        return [child for name, child in self.model.named_children() if name in heads]

    def _warn_compiled(self) -> None:
        names = ", ".join(f"{t.path or '<root>'}.{t.method.name}" for t in self._targets)
        _warnings.warn(
            f"vartrace: the model is compiled; these traced methods run eagerly while "
            f"tracing (excluded from torch.compile): {names}",
            stacklevel=3,
        )

    def _remove_part_hooks(self) -> None:
        handles, self._part_handles = self._part_handles, []
        if handles:
            for handle in handles:
                handle.remove()
            for part in self._counting_parts():
                filter_state(part, self, None)

    def _detach(self) -> None:
        self._remove_part_hooks()
        while self._handles:
            self._handles.pop().remove()
        filter_state(self.model, self, None)
        while self._hooks:
            target, hook = self._hooks.pop()
            detach(target.module, target.method.name, hook)

    # -- iterations (rules: vartrace.tracing.iterations) --------------------------------------

    def _set_enabled(self, enabled: bool) -> None:
        for _, hook in self._hooks:
            hook.enabled = enabled

    # Each returns whether it entered a call that the counter's ``exit`` must end.

    def _enter_root(self, compiling: bool, module: nn.Module | None = None) -> bool:
        if compiling and not self._compiled:
            self._compiled = True  # compiled after the tracer started
            self._warn_compiled()
        if module is None and self._iterations.nested():
            return False  # the root's patched forward, inside the call its module hooks counted
        self._remove_part_hooks()  # the root is called: only its calls count from now on
        self._iterations.enter(root=True, replay=_in_backward(), module=module)
        return True

    def _enter_method(self, module: nn.Module | None = None) -> bool:
        counter = self._iterations
        if module is None and counter.nested():
            return False  # a traced method inside a call this thread runs: nothing to count
        counter.enter(root=False, replay=_in_backward(), module=module)
        return True

    def _leave(self, module: nn.Module) -> None:
        # A forward hook registered with always_call runs inside ``except`` when forward raised.
        self._iterations.exit(failed=sys.exc_info()[0] is not None, module=module)

    # -- the record path ----------------------------------------------------------------------

    def _capture(self, site: str, value: Any, grad: bool) -> None:
        self._silence.saw(site, value)
        if _graph_task_id() != -1:  # _in_backward(), on the record path without its call
            # A forward recomputed during backward (activation checkpointing) records
            # nothing twice; a reentrant checkpoint's forward left @grad sites to it.
            if grad:
                self._gradients.recomputed(site, value)
            return
        iteration = self._iterations.capturing()
        if iteration is None:
            return  # another thread's iteration enabled the hooks
        if grad:
            self._gradients.watch(site, value, iteration)
        elif isinstance(value, torch.Tensor):
            self._store(site, value, iteration)
        else:
            for name, leaf in split_object(site, value, self._split_warned):
                self._store(name, leaf, iteration)

    def _store(self, site: str, value: Any, iteration: int, *, saved: bool = False) -> None:
        """Record `value` at `site`; `saved`: the pre-save callbacks already ran."""
        if isinstance(value, torch.Tensor) and is_transformed(value):
            with torch._C._DisableFuncTorch():  # copies made under torch.func stay plain
                plain = untransformed(value, site, self._transformed_warned)
                self._store(site, plain, iteration, saved=saved)
            return
        fresh = False  # a new tensor a callback made (a statistics row): nothing to clone
        if not saved and self.pre_save_callbacks:
            captured = value
            for callback in self.pre_save_callbacks:
                try:
                    result = callback(site, value, iteration)
                except Exception as error:
                    raise _failed("pre_save", callback, site, error) from error
                if result is DROP:
                    return
                if result is not value:
                    fresh = getattr(callback, "fresh_records", False) is True
                value = result
            if not isinstance(value, torch.Tensor):
                # What a callback returns is split like a captured value: a dict of
                # tensors gives the leaves <site>.<key>.
                for name, leaf in leaves(value, site):
                    for part, piece in split_object(name, leaf, self._split_warned):
                        self._store(part, piece, iteration, saved=True)
                return
            if value is not captured and isinstance(captured, (torch.Tensor, np.ndarray)):
                self._reductions.note(site, captured)
        stager = self._stager
        if stager is not None:
            stager.admit(site, value, iteration, fresh=fresh)
            return
        nbytes = self._make_room(value) if self._room else 0
        record = copy_leaf(value, self.device, site)
        if self.change_detection:
            last = self._last.get(site, _MISSING)
            if last is not _MISSING and same(record, last):
                return
            self._last[site] = record
        with self._lock:
            self._order += 1
            self._chunk_bytes += nbytes
            trace = self._chunk.get(site)
            if trace is None:
                trace = self._chunk[site] = Trace()
            trace.append(record, iteration, self._rank, self._order)

    def _make_room(self, value: Any) -> int:
        """Wait until a saver writing on a thread of its own has room for a copy of
        `value` beside the chunk (`H5PYSaverCallback.make_room`: the step waits while
        the thread falls behind); return the copy's bytes."""
        nbytes = held_bytes([value])
        for make_room in self._room:
            make_room(self._chunk_bytes + nbytes)
        return nbytes

    def _keep(self, site: str, record: Any, iteration: int, host: Any) -> None:
        """Append a staged `record` to the chunk, unless `host` (a host copy of a value
        copied at admission) equals the site's last one; `host` is `None` for a record
        the stager already compared on the device.

        The stager's thread alone calls it, in capture order, and alone touches the
        chunk, the order numbers and the last records while staging is on: no lock.
        A record to keep first waits for a saver writing on a thread of its own to
        have room for it beside the chunk (`_make_room`): the staging thread, not the
        step, waits for the writer, and the step waits only once records in flight
        reach `max_inflight_bytes` behind it.
        """
        stats = self._stager.stats  # type: ignore[union-attr]
        if self.change_detection:
            if host is None:
                self._last.pop(site, None)  # compared on the device from now on
            else:
                last = self._last.get(site, _MISSING)
                if last is not _MISSING and same(host, last):
                    stats.unchanged += 1
                    return
                self._last[site] = host
        if self._room:
            started = time.perf_counter()
            self._chunk_bytes += self._make_room(record)
            stats.writer_wait_seconds += time.perf_counter() - started
        stats.kept += 1
        self._order += 1
        trace = self._chunk.get(site)
        if trace is None:
            trace = self._chunk[site] = Trace()
        trace.append(record, iteration, self._rank, self._order)

    def _put_back(self, traces: dict[str, Trace]) -> None:
        """Return the traces of an interrupted hand-over to the chunk, before later records.

        A callback may have stacked them before the interrupt: they go back unstacked, so
        that the steps after a caught interrupt append to them as to any chunk.
        """
        with self._lock:
            later, self._chunk = self._chunk, {}
            for name in dict.fromkeys([*traces, *later]):
                pieces = [t for t in (traces.get(name), later.get(name)) if t is not None]
                self._chunk[name] = unstacked(pieces)
            if self._room:
                self._chunk_bytes = sum(held_bytes(t.values) for t in self._chunk.values())

    def _kept(self, trace: Trace) -> Trace:
        """`trace` as `results` keeps it, or, past `max_host_bytes` of results, one marker
        saying so.  Records staged from an accelerator stay in their slots of the ring (no
        copy: the ring is bounded by `max_host_bytes` too); a slot goes back to the ring
        when the last view of its record dies."""
        held = held_bytes(trace.values)
        if not held:
            return trace
        bound = self.max_host_bytes
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
        now = (
            f"records past max_host_bytes={_size(self.max_host_bytes)} are dropped"
            if dropping
            else f"past max_host_bytes={_size(self.max_host_bytes)}, records will be dropped"
        )
        _warnings.warn(
            f"vartrace: the results held in memory reached {_size(total)} "
            f"({self.gathering_interval} iteration(s) a gather); {now}.  Write them to a "
            "file (post_gather_callbacks=[H5PYSaverCallback(...)]), reduce them "
            "(pre_save_callbacks=[vartrace.stats()]), record fewer sites, or raise "
            "max_host_bytes",
            RuntimeWarning,
        )

    def _record_manual(self, name: str, value: Any) -> None:
        if self._iterations.records_manual():
            iteration = self._iterations.state.iteration
            for site, leaf in leaves(value, name):
                for part, piece in split_object(site, leaf, self._split_warned):
                    self._store(part, piece, iteration)

    def _end_iteration(self) -> None:
        """An outermost call ended without a gather: its records start for the host."""
        self._after_first_iteration()
        if self._stager is not None:
            self._stager.flush()

    def _after_first_iteration(self) -> None:
        """Once the first traced iteration ended: say which patterns' methods it never called."""
        if self._first_seen or self._finished or not self._iterations.in_mode_calls:
            return
        self._first_seen = True
        self._silence.after_first_iteration([target for target, hook in self._hooks if hook.calls])
        stats = None if self._stager is None else self._stager.stats
        if stats is not None and stats.admitted and not stats.staged:
            _warnings.warn(
                "vartrace: staging='async', but no record of iteration 1 was an accelerator "
                "tensor: records are copied on the thread that captures them, as with "
                "'sync'; only change detection, gathers and callbacks run on the staging "
                "thread",
                UserWarning,
            )

    def _flush(self, *, final: bool = False) -> None:
        self._after_first_iteration()
        if self._stager is not None:
            self._stager.call(self._hand_over)  # after every record captured before
            return
        # Threads that end iterations at once hand their chunks to the callbacks one by one.
        # A model called under torch.func ends its iteration inside the transform: the
        # callbacks work on plain tensors, outside it.
        with self._flush_lock, torch._C._DisableFuncTorch():
            self._hand_over(final=final)

    def _retag(self, chunk: dict[str, Trace]) -> None:
        """Tag `chunk` with this process's rank, if the process group started after the
        tracer did (a tracer around Lightning's `trainer.fit`): every record in it was
        captured here."""
        rank = distributed.rank()
        if rank == self._rank or distributed.world_size() == 1:
            return
        self._rank = rank
        for trace in chunk.values():
            trace.ranks = [rank] * len(trace.ranks)

    def _hand_over(self, *, final: bool = False) -> None:
        """Hand the chunk through the gather callbacks to the results.

        `final`: the tracer's last hand-over, which also joins the gathers of ranks
        still running (see `vartrace.distributed.gathers.final_gathers`).
        """
        with self._lock:
            chunk, self._chunk = self._chunk, {}
            self._chunk_bytes = 0
        facts: list[distributed.Fact] = [
            *(("alias", name, target) for name, target in self._aliases.taken()),
            *(("reduced", name, origin) for name, origin in self._reductions.taken()),
        ]
        if not chunk and not facts and distributed.world_size() == 1:
            return  # nothing to hand on, and no other rank waits for this gather
        self._declare(facts)
        known = len(facts)  # the facts declared; a gather appends the other ranks'
        self._retag(chunk)
        pending = dict(chunk)  # the traces not yet in the results
        handed = False  # records went through the post-gather callbacks here
        try:
            for name, trace in chunk.items():
                _run_callbacks("pre_gather", self.pre_gather_callbacks, name, trace)
            for gathered, merged in self._gathers(chunk, final, facts):
                self._declare(self._adopted(facts[known:]))
                known = len(facts)
                pending = dict(gathered)
                handed = handed or merged
                for name, trace in gathered.items():
                    if merged:  # else this rank's own records that no gather took: kept
                        _run_callbacks("post_gather", self.post_gather_callbacks, name, trace)
                    self._results.add(name, self._kept(trace))
                    del pending[name]
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C in a callback: the records stay
            self._put_back(pending)
            raise
        if not handed:
            return
        for callback in self.post_gather_callbacks:
            flush = getattr(callback, "flush", None)
            if flush is not None:
                flush()

    def _declare(self, facts: Sequence[distributed.Fact]) -> None:
        """Tell the results and the post-gather callbacks that have the method (the HDF5
        saver) facts about sites, before the records: `alias(name, target)` for names
        that read as another site, `reduced(name, ReducedFrom)` for what a pre-save
        callback replaced.

        With `gather=True` only rank 0 does: it alone receives the gathered records,
        and the other ranks' facts with them (`_adopted`).
        """
        if not facts or (self.gather and distributed.rank() != 0):
            return
        for method, name, fact in facts:
            told = [getattr(c, method, None) for c in self.post_gather_callbacks]
            for sink in [getattr(self._results, method), *(s for s in told if callable(s))]:
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
        if not self.gather:
            return [(chunk, True)]
        if final:
            return distributed.final_gathers(chunk, self._group, facts=facts)
        gathered = distributed.gather_chunk(chunk, self._group, facts=facts)
        return [] if gathered is None else [(gathered, True)]
