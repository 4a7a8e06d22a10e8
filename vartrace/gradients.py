"""Gradients of traced tensors (the ``@grad`` timing).

:class:`GradientWatcher` receives live tensors captured at ``@grad`` sites
and records the gradient that reaches each one during backward, tagged
with the iteration of the forward that produced it.  Two kinds of tensors
are watched differently:

* a tensor computed by the forward (a local, an argument, a return value,
  a nested key, a module output) gets a one-shot ``register_hook``: the
  gradient w.r.t. that tensor is recorded when backward reaches it, and
  the hook removes itself;
* a parameter (an ``nn.Parameter``, or a leaf tensor requiring grad
  reached through ``self``) gets one ``register_post_accumulate_grad_hook``
  for the life of the watcher: after each backward that follows a traced
  forward using it, its accumulated ``.grad`` is recorded once.

Only hook handles are kept, never the tensors themselves, so the autograd
graph of a step is freed as soon as the step is done with it.

Example::

    with ModelTracer(model, ["layers.*.attn.forward.scores@grad",
                             "head.forward.self.weight@grad"]) as tracer:
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
    tracer.results["layers.0.attn.forward.scores@grad"].values[0]   # d loss / d scores
    tracer.results["head.forward.self.weight@grad"].values[0]       # head.weight.grad
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vartrace._warnings import warn

__all__ = ["GradientWatcher"]

Store = Callable[[str, Any, int], None]
"""``store(site, gradient, iteration)``: the tracer's record path."""

_MIN_PRUNE = 64


class _ParameterWatch:
    """The post-accumulate hook of one parameter and the sites waiting for its gradient."""

    __slots__ = ("handle", "pending", "ref")

    def __init__(self, parameter: torch.Tensor) -> None:
        self.ref = weakref.ref(parameter)
        self.handle: RemovableHandle | None = None
        # site -> iteration of the latest traced forward that used the parameter
        self.pending: dict[str, int] = {}


def _through_self(site: str) -> bool:
    return ".self." in site


class GradientWatcher:
    """Registers autograd hooks on captured tensors and stores their gradients.

    A :class:`~vartrace.tracer.ModelTracer` owns one and calls :meth:`watch`
    for every leaf captured at an ``@grad`` site, with the site name (ending
    in ``@grad``) and the iteration of the forward running; :meth:`close`
    at stop removes every hook still registered.  Gradients reach ``store``
    in the order backward produces them, each tagged with the iteration of
    the forward that produced its tensor; a parameter's record is tagged
    with the iteration of the latest traced forward before the backward
    (several forwards before one backward: the last one).

    Example::

        records = []
        watcher = GradientWatcher(lambda site, grad, it: records.append((site, grad, it)))
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        watcher.watch("f.y@grad", y, iteration=1)
        (y * 3).sum().backward()
        records   # [("f.y@grad", tensor([3., 3., 3.]), 1)]
        watcher.close()
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.RLock()
        self._handles: dict[int, RemovableHandle] = {}
        self._prune_at = _MIN_PRUNE
        self._parameters: dict[int, _ParameterWatch] = {}
        self._warned: set[str] = set()
        self._watched: set[str] = set()  # sites that registered a hook at least once
        self._no_grad: dict[str, str] = {}  # site -> why, seen with grad mode off
        self._closed = False

    def watch(self, site: str, value: Any, iteration: int) -> None:
        """Record the gradient of ``value`` under ``site`` when backward reaches it.

        ``iteration`` is the iteration of the forward that produced ``value``.
        A value that cannot receive a gradient (not a tensor, a tensor that
        does not require grad, a parameter used under ``torch.no_grad()``)
        records nothing and warns once per site; with grad mode off (an
        evaluation under ``torch.no_grad()``) only at :meth:`close`, and only if
        the site never received a gradient hook (``mode="any"`` runs that also train).
        """
        if self._closed:
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
        if value.is_leaf and (isinstance(value, nn.Parameter) or _through_self(site)):
            if not torch.is_grad_enabled():
                self._warn(site, "the parameter was used under torch.no_grad()")
                return
            self._watch_parameter(site, value, iteration)
        else:
            self._watch_tensor(site, value, iteration)

    def close(self) -> None:
        """Remove every hook this watcher registered; later backwards record nothing.

        Warns for the sites seen only with grad mode off.
        """
        for site, reason in self._no_grad.items():
            if site not in self._watched:
                self._say(site, reason)
        self._no_grad.clear()
        with self._lock:
            self._closed = True
            handles = list(self._handles.values())
            handles.extend(w.handle for w in self._parameters.values() if w.handle is not None)
            self._handles.clear()
            self._parameters.clear()
        for handle in handles:
            handle.remove()

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
                watch = self._parameters[id(parameter)] = _ParameterWatch(parameter)
                watch.handle = parameter.register_post_accumulate_grad_hook(self._on_accumulated)
                if len(self._handles) + len(self._parameters) >= self._prune_at:
                    self._prune()
            watch.pending[site] = iteration

    def _on_accumulated(self, parameter: torch.Tensor) -> None:
        with self._lock:
            watch = self._parameters.get(id(parameter))
            if watch is None or watch.ref() is not parameter or not watch.pending:
                return
            pending = list(watch.pending.items())
            watch.pending.clear()
        for site, iteration in pending:
            self._store(site, parameter.grad, iteration)

    # -- warnings -------------------------------------------------------------------------------

    def _warn(self, site: str, reason: str) -> None:
        if torch.is_grad_enabled():
            self._say(site, reason)
        else:  # decided at close: a training step may still record it
            self._no_grad.setdefault(site, reason)

    def _say(self, site: str, reason: str) -> None:
        if site in self._warned:
            return
        self._warned.add(site)
        warn(f"vartrace: no gradient is recorded for {site}: {reason}", UserWarning, stacklevel=3)
