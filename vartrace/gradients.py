"""Gradients of traced tensors (the ``@grad`` timing).

:class:`GradientWatcher` receives live tensors captured at ``@grad`` sites
and records the gradient that reaches each one during backward, tagged
with the iteration of the forward that produced it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GradientWatcher"]

Store = Callable[[str, Any, int], None]
"""``store(site, gradient, iteration)``: the tracer's record path."""


class GradientWatcher:
    """Registers autograd hooks on captured tensors and stores their gradients."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def watch(self, site: str, value: Any, iteration: int) -> None:
        """Record the gradient of ``value`` under ``site`` when backward reaches it."""
        raise NotImplementedError("@grad lands with the gradients issue")

    def close(self) -> None:
        """Remove every hook this watcher registered."""
