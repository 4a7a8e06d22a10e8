"""The optional hooks of a tracer's callbacks, looked up once when it starts.

`vartrace.trace.SaverCallback` and `PreSaveCallback` declare them; a callback
defines any of them, or none.  `SinkHooks.of` finds each one (`getattr`) and keeps
what was found, so that the record path and the hand-over call hooks without
probing callbacks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vartrace._support import warnings as _warnings
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.trace import RunContext

__all__ = ["SinkHooks"]


@dataclass(frozen=True)
class SinkHooks:
    """The hooks a tracer's callbacks define.

    Attributes:
        on_start: `on_start` of every callback, in the order of the stages.
        pre_save: each pre-save callback with whether it makes fresh records
            (`fresh_records is True`).
        make_room: `make_room` of the post-gather callbacks writing on a thread of their
            own (`background is True`, or `None` with a `flush_later`): records wait
            for them.
        flush: `flush` of the post-gather callbacks (the tracer's last gather).
        flush_later: of the same callbacks, `flush_later` where defined, else `flush`
            (every other gather).
        alias: `alias` of the post-gather callbacks that define it as a method.
        reduced: `reduced` of the post-gather callbacks that define it as a method.
        placed: `placed` of the post-gather callbacks that define it as a method.
        failing: the callbacks that have a `failure` attribute, read when the tracer stops.
    """

    on_start: tuple[Callable[[RunContext], None], ...] = ()
    pre_save: tuple[tuple[Callable[[str, Any, int], Any], bool], ...] = ()
    make_room: tuple[Callable[[int], None], ...] = ()
    flush: tuple[Callable[[], None], ...] = ()
    flush_later: tuple[Callable[[], None], ...] = ()
    alias: tuple[Callable[[str, str], None], ...] = ()
    reduced: tuple[Callable[[str, ReducedFrom], None], ...] = ()
    placed: tuple[Callable[[str, Placement], None], ...] = ()
    failing: tuple[object, ...] = ()

    @classmethod
    def of(
        cls,
        pre_save: Sequence[Callable[[str, Any, int], Any]],
        post_gather: Sequence[object],
        every: Sequence[object],
    ) -> SinkHooks:
        """The hooks of `pre_save` and `post_gather` callbacks, and of `every` callback
        of the tracer (for `on_start` and `failure`)."""
        return cls(
            on_start=_found(every, "on_start"),
            pre_save=tuple(
                (callback, getattr(callback, "fresh_records", False) is True)
                for callback in pre_save
            ),
            make_room=tuple(
                callback.make_room  # type: ignore[attr-defined]
                for callback in post_gather
                if _writes_behind(callback) and hasattr(callback, "make_room")
            ),
            flush=_found(post_gather, "flush"),
            flush_later=tuple(
                later
                for callback in post_gather
                if (
                    later := getattr(callback, "flush_later", None)
                    or getattr(callback, "flush", None)
                )
                is not None
            ),
            alias=tuple(m for m in _found(post_gather, "alias") if callable(m)),
            reduced=tuple(m for m in _found(post_gather, "reduced") if callable(m)),
            placed=tuple(m for m in _found(post_gather, "placed") if callable(m)),
            failing=tuple(c for c in every if hasattr(c, "failure")),
        )

    def restate_failures(self) -> None:
        """Warn again, from the tracer's `stop`, about each callback that stopped on a
        failure during the run."""
        for callback in self.failing:
            failure = getattr(callback, "failure", None)
            if isinstance(failure, BaseException):
                _warnings.warn(
                    f"vartrace: {type(callback).__name__} stopped during this run: {failure}",
                    RuntimeWarning,
                    stacklevel=4,
                )


def _writes_behind(callback: object) -> bool:
    """Whether `callback` writes on a thread of its own what a tracer hands it: its
    `background` is `True`, or `None` and it defines `flush_later`."""
    background = getattr(callback, "background", False)
    return background is True or (
        background is None and getattr(callback, "flush_later", None) is not None
    )


def _found(callbacks: Sequence[object], name: str) -> tuple[Any, ...]:
    """The attribute `name` of each of `callbacks` that has one (not `None`)."""
    found = (getattr(callback, name, None) for callback in callbacks)
    return tuple(hook for hook in found if hook is not None)
