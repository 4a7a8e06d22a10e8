"""Recording values by hand, from anywhere, into every active tracer.

Example:
    ```python
    import vartrace

    def my_loss(logits, target):
        loss = F.cross_entropy(logits, target)
        vartrace.record("loss.value", loss)   # no-op when no tracer is active
        return loss
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["record", "subscribe", "unsubscribe"]


_sinks: list[Callable[[str, Any], None]] = []


def record(name: str, value: Any) -> None:
    """Record `value` under the site `name` in every active tracer.

    Nested structures are split into leaf sites (`name.0`, `name.key`)
    as for captured variables.  Near-free when no tracer is active.
    """
    if _sinks:
        for sink in tuple(_sinks):
            sink(name, value)


def subscribe(sink: Callable[[str, Any], None]) -> None:
    """Add a tracer's sink (called by ModelTracer.start)."""
    _sinks.append(sink)


def unsubscribe(sink: Callable[[str, Any], None]) -> None:
    """Remove a sink added by `subscribe`."""
    if sink in _sinks:
        _sinks.remove(sink)
