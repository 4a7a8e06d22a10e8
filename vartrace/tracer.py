"""ModelTracer: record values of a model's code while it runs, without editing it.

Data flows one way: the engine captures leaves from patched methods ->
pre-save callbacks -> a detached copy -> change detection -> the chunk
buffer -> pre-gather callbacks -> gather to rank 0 -> post-gather
callbacks -> :attr:`ModelTracer.results`, and post-trace callbacks at the
end.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from vartrace import distributed
from vartrace.engine.code import MethodInfo
from vartrace.engine.frames import set_change_test
from vartrace.engine.patching import Hook, Probe, attach, detach
from vartrace.engine.structures import leaves
from vartrace.gradients import GradientWatcher
from vartrace.record import DROP, subscribe, unsubscribe
from vartrace.results import Results
from vartrace.silence import SilenceWatch
from vartrace.sites import Target, is_compiled, module_methods, resolve, unwrap
from vartrace.tensors import copy_leaf, same, snapshot, unchanged
from vartrace.trace import RunContext, Trace, report_during

__all__ = ["CallbackError", "ModelTracer"]

PreSave = Callable[[str, Any, int], Any]
GatherCallback = Callable[[str, Trace], None]
Mode = Literal["train", "eval", "any"]
_MISSING = object()

# ``@every`` sees in-place changes (``.data`` writes, numpy writes, list appends), not only
# rebinding and version bumps.
set_change_test(snapshot, unchanged)


class CallbackError(RuntimeError):
    """A callback raised: the message names the callback, its stage and the site.

    The callback's own exception is ``__cause__``.

    Example::

        try:
            with ModelTracer(model, ["head"], pre_save_callbacks=[reduce_scores]):
                model(x)
        except vartrace.CallbackError as error:
            original = error.__cause__
    """


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


def _check_callbacks(stage: str, callbacks: list[Any], arguments: tuple[str, ...]) -> None:
    """Raise ``TypeError`` naming a callback that cannot be called with ``arguments``."""
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
                hint = "; it takes (name, trace): pass it in post_gather_callbacks"
            elif stage != "pre_save_callbacks" and _binds(signature, 3):
                hint = "; it takes (name, value, iteration): pass it in pre_save_callbacks"
            raise TypeError(
                f"{stage}[{index}] {_name(callback)} cannot be called as {wanted}{hint}"
            ) from None


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def _warn_unused_savers(callbacks: list[Any]) -> None:
    """Warn about savers created but given to no tracer: they would write nothing."""
    writer = sys.modules.get("vartrace.storage.writer")
    if writer is None:
        return
    for saver in writer.unused_savers():
        if not any(saver is callback for callback in callbacks):
            warnings.warn(
                f"vartrace: {saver!r} is not among this tracer's callbacks, so it will write "
                "nothing; pass it as ModelTracer(..., post_gather_callbacks=[saver])",
                stacklevel=4,
            )


def _check_device(device: torch.device) -> None:
    """Refuse a device this torch cannot put tensors on, before the first record."""
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


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


class ModelTracer:
    """Record the values a model's code holds, at sites named by wildcard paths.

    Example::

        saver = H5PYSaverCallback("run.h5")
        with ModelTracer(model, ["forward.x", "layers.*.attn.forward.scores"],
                         post_gather_callbacks=[saver], gathering_interval=8) as tracer:
            for batch in loader:
                loss = model(batch).sum()
                loss.backward()
        saver.close()

    Args:
        model: the model; DDP / DataParallel / FSDP / compile wrappers are
            unwrapped, so paths never start with ``module.``.
        paths: patterns (see the README's path language); each must match a
            site of the model, else ``ValueError`` (a warning if ``strict=False``).
        pre_save_callbacks: ``cb(name, value, iteration) -> value`` on each
            captured leaf before it is copied; return :data:`vartrace.DROP`
            to drop the record.
        pre_gather_callbacks: ``cb(name, trace)`` on each rank's chunk.
        post_gather_callbacks: ``cb(name, trace)`` on the gathered chunk (rank 0).
        post_trace_callbacks: ``cb(name, trace)`` on each accumulated result at exit.
        gathering_interval: gather every this many iterations (and at exit).
        trace_interval: record iterations 1, 1 + k, 1 + 2k, ...
        mode: which outermost model calls are iterations: ``"train"``,
            ``"eval"`` (by ``model.training``) or ``"any"``.
        change_detection: record a site only when its value changed.
        device: where recorded copies live.
        gather: ``False`` keeps each rank's records on that rank (shard files).
        strict: raise (``True``) or warn (``False``) on patterns matching nothing.
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if mode not in ("train", "eval", "any"):
            raise ValueError(f"mode must be 'train', 'eval' or 'any', not {mode!r}")
        self.model = unwrap(model)
        self._compiled = is_compiled(model)
        self.pre_save_callbacks = list(pre_save_callbacks)
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
        self.device = torch.device(device)
        _check_device(self.device)
        self.gather = gather
        self._targets = resolve(self.model, paths, strict=strict)
        _warn_unused_savers(self._all_callbacks())
        self._silence = SilenceWatch(self._targets, mode, self.model)
        self._other_mode_calls = 0
        self.results = Results()
        self._hooks: list[tuple[Target | None, Hook]] = []
        self._chunk: dict[str, Trace] = {}
        self._last: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._calls = 0
        self._depth = 0
        self._in_mode = False
        self._iteration = 0
        self._user_iteration: int | None = None
        self._recording = True
        self._order = 0
        self._rank = 0
        self._started = False
        self._finished = False
        self._gradients = GradientWatcher(self._store)

    # -- public API ---------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """The iteration that records are tagged with now (0 before the first)."""
        return self._iteration

    def set_iteration(self, iteration: int) -> None:
        """Tag every record with ``iteration`` until the next call (user-driven iterations).

        Example (gradient accumulation: four micro-batches per step)::

            for step, batches in enumerate(loader, 1):
                tracer.set_iteration(step)
                for batch in batches:
                    model(batch).sum().backward()
        """
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            raise TypeError(f"iteration must be an int, not {type(iteration).__name__}")
        self._user_iteration = iteration
        self._set_iteration(iteration)

    def start(self) -> ModelTracer:
        """Patch the model and start recording (``with`` does this for you)."""
        if self._started:
            raise RuntimeError("this ModelTracer was already started; create a new one")
        self._started = True
        self._rank = distributed.rank()
        world = distributed.world_size()
        context = RunContext(self._rank, world, sharded=not self.gather and world > 1)
        for callback in self._all_callbacks():
            on_start = getattr(callback, "on_start", None)
            if on_start is not None:
                on_start(context)
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        subscribe(self._record_manual)
        return self

    def stop(self, *, flush: bool = True) -> None:
        """Restore the model, hand over the last chunk and run post-trace callbacks."""
        if not self._started or self._finished:
            return
        self._finished = True
        unsubscribe(self._record_manual)
        self._detach()
        self._gradients.close()
        self._silence.report(bool(self._counts), self._other_mode_calls)
        if flush:
            self._flush()
            for name in list(self.results):
                _run_callbacks("post_trace", self.post_trace_callbacks, name, self.results[name])

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
            self.stop(flush=flush)
        except Exception as error:  # the step's exception goes on, unchanged
            report_during(exc, "the tracer's final flush failed", error)

    # -- patching -----------------------------------------------------------------------------

    def _all_callbacks(self) -> list[object]:
        return [
            *self.pre_save_callbacks,
            *self.pre_gather_callbacks,
            *self.post_gather_callbacks,
            *self.post_trace_callbacks,
        ]

    def _attach(self) -> None:
        decorate = None
        if self._compiled:
            # A frame tracer sees nothing inside compiled code: run the traced methods eagerly.
            decorate = torch._dynamo.disable
            names = ", ".join(f"{t.path or '<root>'}.{t.method.name}" for t in self._targets)
            warnings.warn(
                f"vartrace: the model is compiled; these traced methods run eagerly while "
                f"tracing (excluded from torch.compile): {names}",
                stacklevel=4,
            )
        root_forward: MethodInfo | None = None
        for target in self._targets:
            is_root = target.module is self.model and target.method.name == "forward"
            hook = Hook(
                target.probe(),
                self._capture,
                self._enter if is_root else self._silence.entered(target),
                self._exit if is_root else None,
            )
            attach(target.module, target.method.name, target.method.code, hook, decorate)
            self._hooks.append((target, hook))
            if is_root:
                root_forward = target.method
        if root_forward is None:
            methods = module_methods(self.model)
            if "forward" not in methods:
                raise TypeError(f"{type(self.model).__name__} has no forward method to trace")
            info = methods["forward"]
            hook = Hook(Probe(), self._capture, self._enter, self._exit)
            attach(self.model, "forward", info.code, hook, decorate)
            self._hooks.append((None, hook))

    def _detach(self) -> None:
        while self._hooks:
            target, hook = self._hooks.pop()
            module = self.model if target is None else target.module
            name = "forward" if target is None else target.method.name
            detach(module, name, hook)

    # -- iterations ---------------------------------------------------------------------------

    def _set_iteration(self, iteration: int) -> None:
        self._iteration = iteration
        self._recording = (iteration - 1) % self.trace_interval == 0
        for _, hook in self._hooks:
            hook.enabled = self._recording

    def _enter(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        mode = self.mode
        self._in_mode = mode == "any" or self.model.training == (mode == "train")
        if not self._in_mode:
            self._other_mode_calls += 1
            for _, hook in self._hooks:
                hook.enabled = False
            return
        self._counts[mode] = self._counts.get(mode, 0) + 1
        iteration = self._user_iteration
        self._set_iteration(self._counts[mode] if iteration is None else iteration)

    def _exit(self, failed: bool) -> None:
        self._depth -= 1
        if self._depth or not self._in_mode:
            return
        self._calls += 1
        if not failed and self._calls % self.gathering_interval == 0:
            self._flush()

    # -- the record path ----------------------------------------------------------------------

    def _capture(self, site: str, value: Any, grad: bool) -> None:
        self._silence.saw(site, value)
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed during backward (activation checkpointing)
        if grad:
            self._gradients.watch(site, value, self._iteration)
        else:
            self._store(site, value, self._iteration)

    def _store(self, site: str, value: Any, iteration: int) -> None:
        for callback in self.pre_save_callbacks:
            try:
                value = callback(site, value, iteration)
            except Exception as error:
                raise _failed("pre_save", callback, site, error) from error
            if value is DROP:
                return
        record = copy_leaf(value, self.device)
        if self.change_detection:
            last = self._last.get(site, _MISSING)
            if last is not _MISSING and same(record, last):
                return
            self._last[site] = record
        self._order += 1
        trace = self._chunk.get(site)
        if trace is None:
            trace = self._chunk[site] = Trace()
        trace.append(record, iteration, self._rank, self._order)

    def _record_manual(self, name: str, value: Any) -> None:
        if self._recording and (self._depth == 0 or self._in_mode):
            for site, leaf in leaves(value, name):
                self._store(site, leaf, self._iteration)

    def _flush(self) -> None:
        chunk, self._chunk = self._chunk, {}
        for name, trace in chunk.items():
            _run_callbacks("pre_gather", self.pre_gather_callbacks, name, trace)
        gathered = distributed.gather_chunk(chunk) if self.gather else chunk
        if gathered is None:
            return
        for name, trace in gathered.items():
            _run_callbacks("post_gather", self.post_gather_callbacks, name, trace)
            self.results.add(name, trace)
        for callback in self.post_gather_callbacks:
            flush = getattr(callback, "flush", None)
            if flush is not None:
                flush()
