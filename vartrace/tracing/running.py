"""The public view of the running tracers: `active_tracers` lists them, `stop_all` stops them.

The registry (`vartrace.tracing.registry`) keeps them for the tracer, which enters and
leaves it at start and stop; this module, above both, gives them their type.

Example:
    ```python
    vartrace.active_tracers()   # [<ModelTracer running on GPT: ...>, ...]
    vartrace.stop_all()         # stops each, newest first; returns them
    ```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vartrace.tracing import registry

if TYPE_CHECKING:
    from vartrace.tracing.tracer import ModelTracer

__all__ = ["active_tracers", "stop_all"]


def active_tracers() -> list[ModelTracer]:
    """The tracers started and not stopped yet in this process, oldest first.

    One started by a notebook cell run twice, or whose variable was rebound, is
    listed too:

    ```python
    for tracer in vartrace.active_tracers():
        print(tracer)   # state, model, sites, records so far, where it was started
    ```
    """
    return registry.tracers()


def stop_all() -> list[ModelTracer]:
    """Stop every running tracer, newest first (each `stop()`: the model restored, its
    last records handed to its callbacks), and return them.

    ```python
    stopped = vartrace.stop_all()   # after re-running a cell that started a tracer
    ```
    """
    stopped = active_tracers()[::-1]
    failures = []
    for tracer in stopped:
        try:  # one failing (a kept warning raised under -W error) stops the others too
            tracer.stop()
        except Exception as error:
            failures.append(error)
    if failures:
        raise failures[0]
    return stopped
