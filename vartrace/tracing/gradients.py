"""Gradients of traced tensors (the `@grad` timing).

`GradientWatcher` receives live tensors captured at `@grad` sites
and records the gradient that reaches each one during backward, tagged
with the iteration of the forward that produced it.  Two kinds of tensors
are watched differently:

* a tensor computed by the forward (a local, an argument, a return value,
  a nested key, a module output) gets a one-shot `register_hook`: the
  gradient w.r.t. that tensor is recorded when backward reaches it, and
  the hook removes itself;
* a parameter (an `nn.Parameter`, or a leaf tensor requiring grad
  reached through `self`) gets one `register_post_accumulate_grad_hook`
  for the life of the watcher: after each backward that follows a traced
  forward using it, its accumulated `.grad` is recorded once.  Under FSDP2
  (`fully_shard`) the forward computes with an unsharded copy of each parameter
  (in the `MixedPrecisionPolicy`'s `param_dtype`); what the optimizer uses is the
  sharded parameter's `.grad` (a DTensor, after the reduce-scatter), recorded when
  the backward ends, after FSDP2's own end-of-backward work.

Only hook handles are kept, never the tensors themselves, so the autograd
graph of a step is freed as soon as the step is done with it.

Inside a reentrant activation checkpoint (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=True)`, HF's `gradient_checkpointing_enable`` with those kwargs) the
forward runs under `torch.no_grad()`: what it computes has no gradient yet.  Such a
site is remembered with the checkpoint's autograd context and the forward's iteration,
and watched when backward recomputes the region with grad enabled
(`GradientWatcher.recomputed`); the inputs of the region, which do require grad
in the forward, are watched there, as without checkpointing.

Example:
    ```python
    with ModelTracer(model, ["layers.*.attn.forward.scores@grad",
                             "head.forward.self.weight@grad"]) as tracer:
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
    tracer.results["layers.0.attn.forward.scores@grad"].values[0]   # d loss / d scores
    tracer.results["head.forward.self.weight@grad"].values[0]       # head.weight.grad
    ```
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.hooks import RemovableHandle

from vartrace._support.warnings import warn

__all__ = ["GradientWatcher"]

Store = Callable[[str, Any, int], None]
"""`store(site, gradient, iteration)`: the tracer's record path."""

_MIN_PRUNE = 64


class _ParameterWatch:
    """The post-accumulate hook of one parameter and the sites waiting for its gradient."""

    __slots__ = ("handle", "pending", "ref", "sharded")

    def __init__(self, parameter: torch.Tensor, sharded: torch.Tensor | None) -> None:
        self.ref = weakref.ref(parameter)
        self.handle: RemovableHandle | None = None
        # FSDP2's sharded parameter that `parameter` is the unsharded copy of
        self.sharded = None if sharded is None else weakref.ref(sharded)
        # site -> iteration of the latest traced forward that used the parameter
        self.pending: dict[str, int] = {}


def _through_self(site: str) -> bool:
    return ".self." in site


def _fsdp2_sharded(model: nn.Module | None, parameter: torch.Tensor) -> torch.Tensor | None:
    """The sharded parameter (a DTensor) that FSDP2 (`fully_shard`) unshards into
    `parameter` for the forward; `None` when no FSDP2 module of `model` does (or FSDP2's
    internals are not what this torch had: with a warning, the unsharded copy's `.grad`
    is recorded)."""
    if model is None or "torch.distributed.fsdp" not in sys.modules:
        return None
    try:
        return _fsdp2_lookup(model, parameter)
    except Exception as error:
        warn(
            f"vartrace: FSDP2's sharded parameters could not be looked up ({error!r}): a "
            "parameter's @grad is its unsharded copy's gradient, before the reduce-scatter",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _fsdp2_lookup(model: nn.Module, parameter: torch.Tensor) -> torch.Tensor | None:
    """`_fsdp2_sharded`'s walk through FSDP2's states (private to torch)."""
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        state = state_of()
        groups = getattr(state, "_fsdp_param_groups", None) or [
            getattr(state, "_fsdp_param_group", None)
        ]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                if getattr(fsdp_param, "_unsharded_param", None) is parameter:
                    return cast(torch.Tensor, fsdp_param.sharded_param)
    return None


_engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
_graph_task_id = torch._C._current_graph_task_id
_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_CHECKPOINT_BACKWARD = CheckpointFunction.backward.__code__
_CHECKPOINTED = (
    "{} inside a reentrant activation checkpoint (use_reentrant=True), whose forward runs "
    "under torch.no_grad(), and no backward recomputed it"
)


class _Checkpoint:
    """One call of a reentrant checkpoint: the iteration its forward belongs to and the
    sites its forward captured under `torch.no_grad()`, watched when it is recomputed."""

    __slots__ = ("iteration", "sites")

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.sites: set[str] = set()


def _checkpoint_frames() -> Iterator[tuple[Any, bool]]:
    """The reentrant checkpoints running on this thread's stack, innermost first: each
    one's autograd context and whether it runs its backward (the recomputation)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _CHECKPOINT_FORWARD or code is _CHECKPOINT_BACKWARD:
            yield frame.f_locals["ctx"], code is _CHECKPOINT_BACKWARD
        frame = frame.f_back


class GradientWatcher:
    """Registers autograd hooks on captured tensors and stores their gradients.

    A [`ModelTracer`][vartrace.ModelTracer] owns one and calls `watch`
    for every leaf captured at an `@grad` site, with the site name (ending
    in `@grad`) and the iteration of the forward running; `close`
    at stop removes every hook still registered.  Gradients reach `store`
    in the order backward produces them, each tagged with the iteration of
    the forward that produced its tensor; a parameter's record is tagged
    with the iteration of the latest traced forward before the backward
    (several forwards before one backward: the last one).

    Example:
        ```python
        records = []
        watcher = GradientWatcher(lambda site, grad, it: records.append((site, grad, it)))
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        watcher.watch("f.y@grad", y, iteration=1)
        (y * 3).sum().backward()
        records   # [("f.y@grad", tensor([3., 3., 3.]), 1)]
        watcher.close()
        ```
    """

    def __init__(
        self, store: Store, quiet: frozenset[str] = frozenset(), model: nn.Module | None = None
    ) -> None:
        self._store = store
        self._model = model  # where FSDP2's sharded parameters are looked up
        # id of a parameter -> (it, weakly; FSDP2's sharded parameter it is a copy of)
        self._sharded: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor | None]] = {}
        self._quiet = quiet  # sites (and the keys below them) that never warn
        self._lock = threading.RLock()
        self._handles: dict[int, RemovableHandle] = {}
        self._prune_at = _MIN_PRUNE
        self._parameters: dict[int, _ParameterWatch] = {}
        self._warned: set[str] = set()
        self._watched: set[str] = set()  # sites that registered a hook at least once
        self._unwatched: dict[str, str] = {}  # site -> why a call could not watch it
        # The reentrant checkpoint calls whose forward deferred a site, by autograd context.
        self._checkpoints: weakref.WeakKeyDictionary[Any, _Checkpoint] = weakref.WeakKeyDictionary()
        # Per running backward: the parameters of recomputed regions recorded when it ends.
        self._at_end: dict[int, dict[tuple[int, str], tuple[torch.Tensor, int]]] = {}
        self._closed = False

    def watch(self, site: str, value: Any, iteration: int) -> None:
        """Record the gradient of `value` under `site` when backward reaches it.

        `iteration` is the iteration of the forward that produced `value`.
        A value that cannot receive a gradient (not a tensor, a tensor that
        does not require grad, a parameter used under `torch.no_grad()`)
        records nothing and warns once per site at `close` (not for the `quiet` sites
        given at construction, nor the keys below them), and only if the site never
        received a gradient hook: a GAN's discriminator input has no gradient when the
        discriminator sees real data, and one when it sees the generator's output;
        `mode="any"` runs evaluate under `torch.no_grad()` and also train.
        Inside the forward of a reentrant activation checkpoint, a value without a
        gradient yet waits for `recomputed`.
        """
        if self._closed:
            return
        if (
            not torch.is_grad_enabled()
            and isinstance(value, torch.Tensor)
            and self._defer(site, value, iteration)
        ):
            return
        if not isinstance(value, torch.Tensor):
            self._warn(site, f"it holds a {type(value).__name__}, not a tensor")
            return
        if not value.requires_grad:
            self._warn(
                site,
                "the tensor does not require grad (computed under torch.no_grad() or "
                "torch.inference_mode(), detached, or not a floating-point tensor)",
            )
            return
        if self._parameter(site, value):
            if not torch.is_grad_enabled():
                self._warn(site, "the parameter was used under torch.no_grad()")
                return
            self._watch_parameter(site, value, iteration)
        else:
            self._watch_tensor(site, value, iteration)

    def recomputed(self, site: str, value: Any) -> None:
        """A forward recomputed during backward (activation checkpointing) captured `value`
        at `site`: watch it if the checkpoint's forward deferred the site (its forward
        ran under `torch.no_grad()`), tagged with that forward's iteration.

        Other sites were watched in the forward (a non-reentrant checkpoint, the
        region's inputs) and record nothing twice.
        """
        if self._closed:
            return
        frames = _checkpoint_frames()
        innermost = next(frames, None)
        if innermost is None:
            return  # a non-reentrant checkpoint: watched in the forward
        ctx, backward = innermost
        if not backward:
            # A reentrant checkpoint inside one being recomputed: its forward belongs to
            # the iteration of the enclosing call's forward.
            for outer, outer_backward in frames:
                with self._lock:
                    call = self._checkpoints.get(outer) if outer_backward else None
                if call is not None:
                    self.watch(site, value, call.iteration)
                    return
            return
        with self._lock:
            call = self._checkpoints.get(ctx)
        if call is None or site not in call.sites:
            return
        if isinstance(value, torch.Tensor) and self._parameter(site, value):
            self._watch_to_the_end(site, value, call.iteration)
        else:
            self.watch(site, value, call.iteration)

    def close(self) -> None:
        """Remove every hook this watcher registered; later backwards record nothing.

        Warns for the sites that never received a gradient hook, saying why.
        """
        for site, reason in self._unwatched.items():
            if site not in self._watched:
                self._say(site, reason)
        self._unwatched.clear()
        with self._lock:
            self._closed = True
            handles = list(self._handles.values())
            handles.extend(w.handle for w in self._parameters.values() if w.handle is not None)
            self._handles.clear()
            self._parameters.clear()
            self._checkpoints.clear()
            self._at_end.clear()
            self._sharded.clear()
        for handle in handles:
            handle.remove()

    def _parameter(self, site: str, value: torch.Tensor) -> bool:
        """Whether `value` is watched as a parameter (its accumulated `.grad`)."""
        return value.is_leaf and (isinstance(value, nn.Parameter) or _through_self(site))

    def _defer(self, site: str, value: torch.Tensor, iteration: int) -> bool:
        """Leave `site` to the recomputation of the reentrant checkpoint whose forward runs
        now (see `recomputed`), if `value` has no gradient there (a parameter, or a
        tensor computed under its `torch.no_grad()`); `False` otherwise."""
        parameter = self._parameter(site, value)
        if value.requires_grad and not parameter:
            return False  # an input of the region: its gradient reaches it as it is
        innermost = next(_checkpoint_frames(), None)
        if innermost is None or innermost[1]:
            return False
        with self._lock:
            call = self._checkpoints.get(innermost[0])
            if call is None:
                call = self._checkpoints[innermost[0]] = _Checkpoint(iteration)
            call.sites.add(site)
        used = "the parameter was used" if parameter else "it was computed"
        self._unwatched.setdefault(site, _CHECKPOINTED.format(used))  # at close, if never watched
        return True

    # -- tensors computed by the forward ------------------------------------------------------

    def _watch_tensor(self, site: str, value: torch.Tensor, iteration: int) -> None:
        store, lock, handles = self._store, self._lock, self._handles
        self._watched.add(site)

        def hook(grad: torch.Tensor) -> None:
            with lock:
                if handles.pop(handle.id, None) is None:
                    return  # closed meanwhile
            handle.remove()
            # Outside the lock: a store that waits for memory in flight (asynchronous
            # staging) must not hold up the other autograd threads' hooks.
            store(site, grad, iteration)

        handle = value.register_hook(hook)
        with lock:
            handles[handle.id] = handle
            if len(handles) + len(self._parameters) >= self._prune_at:
                self._prune()

    def _prune(self) -> None:
        """Forget hooks of tensors that died without a backward (eval, discarded graphs)."""
        dead = [key for key, h in self._handles.items() if h.hooks_dict_ref() is None]
        for key in dead:
            del self._handles[key]
        gone = [key for key, w in self._parameters.items() if w.ref() is None]
        for key in gone:
            del self._parameters[key]
        self._prune_at = max(_MIN_PRUNE, 2 * (len(self._handles) + len(self._parameters)))

    # -- parameters -----------------------------------------------------------------------------

    def _watch_parameter(self, site: str, parameter: torch.Tensor, iteration: int) -> None:
        self._watched.add(site)
        with self._lock:
            watch = self._parameters.get(id(parameter))
            if watch is None or watch.ref() is not parameter:
                sharded = self._sharded_of(parameter)
                watch = self._parameters[id(parameter)] = _ParameterWatch(parameter, sharded)
                watch.handle = parameter.register_post_accumulate_grad_hook(self._on_accumulated)
                if len(self._handles) + len(self._parameters) >= self._prune_at:
                    self._prune()
            watch.pending[site] = iteration

    def _watch_to_the_end(self, site: str, parameter: torch.Tensor, iteration: int) -> None:
        """Record `parameter.grad` when the running backward ends.

        A recomputed region runs a backward of its own, which accumulates into
        `.grad` once per checkpoint call: the gradient of the step is complete only
        when the outer backward ends.  One record per backward, tagged with the latest
        of the forwards that used the parameter, as without checkpointing.
        """
        self._watched.add(site)
        sharded = self._sharded_of(parameter)
        self._at_backward_end(site, parameter if sharded is None else sharded, iteration)

    def _sharded_of(self, parameter: torch.Tensor) -> torch.Tensor | None:
        """FSDP2's sharded parameter that `parameter` is the unsharded copy of, looked up
        once a parameter (each lookup walks the model's modules)."""
        found = self._sharded.get(id(parameter))
        if found is None or found[0]() is not parameter:
            found = (weakref.ref(parameter), _fsdp2_sharded(self._model, parameter))
            self._sharded[id(parameter)] = found
        return found[1]

    def _at_backward_end(self, site: str, parameter: torch.Tensor, iteration: int) -> None:
        """Record `parameter.grad` at `site` when the running backward ends (once, tagged
        with the latest `iteration` asked for)."""
        task = _graph_task_id()
        with self._lock:
            ending = self._at_end.get(task)
            if ending is None:
                ending = self._at_end[task] = {}
                _engine.queue_callback(functools.partial(self._backward_ended, task))
            kept = ending.get((id(parameter), site))
            if kept is None or kept[1] < iteration:
                ending[(id(parameter), site)] = (parameter, iteration)

    def _backward_ended(self, task: int) -> None:
        with self._lock:
            ending = self._at_end.pop(task, {})  # nothing left after close()
        for (_, site), (parameter, iteration) in ending.items():
            self._store(site, parameter.grad, iteration)

    def _on_accumulated(self, parameter: torch.Tensor) -> None:
        with self._lock:
            watch = self._parameters.get(id(parameter))
            if watch is None or watch.ref() is not parameter or not watch.pending:
                return
            pending = list(watch.pending.items())
            watch.pending.clear()
            sharded = None if watch.sharded is None else watch.sharded()
        for site, iteration in pending:
            if sharded is not None:  # FSDP2: the sharded .grad, after the reduce-scatter
                self._at_backward_end(site, sharded, iteration)
            else:
                self._store(site, parameter.grad, iteration)

    # -- warnings -------------------------------------------------------------------------------

    def _warn(self, site: str, reason: str) -> None:
        """Note why `site` got no gradient at this call: said at close if no call of it
        ever did (another call, another step may still record it)."""
        if not _below(site, self._quiet):
            self._unwatched.setdefault(site, reason)

    def _say(self, site: str, reason: str) -> None:
        if site in self._warned:
            return
        self._warned.add(site)
        warn(f"vartrace: no gradient is recorded for {site}: {reason}", UserWarning, stacklevel=3)


def _below(site: str, sites: frozenset[str]) -> bool:
    """Whether `site` (`model.rotary_emb.forward.0@grad`) is one of `sites` or a key below
    one (`model.rotary_emb.forward`)."""
    name = site.partition("@")[0]
    while name:
        if name in sites:
            return True
        name = name.rpartition(".")[0]
    return False
