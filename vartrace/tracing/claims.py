"""Which site keeps a value several patterns reach: the first site to capture a tensor owns it
(`Claims`), and the selectors that apply that rule and the call-time conditions of a site.

Example:
    ```python
    claims = Claims(aliases)
    claims.admit(sink, "layers.0.forward", tensor, grad=False)
    ```
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from vartrace.engine.frames import binding_line
from vartrace.engine.patching import Selector, Sink
from vartrace.engine.paths import LINE_MARK
from vartrace.tracing.aliases import Aliases


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for an inference tensor, which keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


class Claims:
    """Which site first captured each tensor, for the selectors of one `**` pattern.

    A tensor handed up through return values (a router's logits, returned by its
    layer, collected in the model's output, in the output of the model around it)
    matches `**.router_logits` at every level: it is stored once, under the site
    that captured it first (where it was computed), until it changes in place; the
    other names read as that site (`aliases`).
    """

    def __init__(self, aliases: Aliases | None = None) -> None:
        self._held: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = {}
        self._aliases = Aliases() if aliases is None else aliases

    def admit(self, sink: Sink, name: str, leaf: Any, grad: bool) -> None:
        """Pass `leaf` on to `sink` unless another site holds the same tensor, unchanged
        (then `name` becomes an alias of that site)."""
        holder = self._holder(name, leaf)
        if holder is not None and self._aliases.share(name, holder):
            return
        self.stored(name, leaf)
        sink(name, leaf, grad)

    def stored(self, name: str, leaf: Any) -> None:
        """Note that `name` stores `leaf` (also when another pattern's selector, listed
        before, stored it): the pattern's other names holding it become its aliases."""
        if isinstance(leaf, torch.Tensor):
            key = id(leaf)
            ref = weakref.ref(leaf, functools.partial(self._forget, key))
            self._held[key] = (ref, name, _version(leaf))
        self._aliases.own(name)

    def sent_again(self, name: str, leaf: Any) -> None:
        """`name` holds `leaf` once more in one call: unless it reads as an alias, the
        selector of another pattern, listed before, stored it."""
        if name not in self._aliases:
            self.stored(name, leaf)

    def _holder(self, name: str, leaf: Any) -> str | None:
        """The other site that stored `leaf` (a tensor), unchanged since, if any."""
        if not isinstance(leaf, torch.Tensor):
            return None
        held = self._held.get(id(leaf))
        if held is None or held[0]() is not leaf or held[1] == name:
            return None
        return held[1] if held[2] == _version(leaf) else None

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        held = self._held.get(key)
        if held is not None and held[0] is ref:
            del self._held[key]


@dataclass(frozen=True)
class FirstSite(Selector):
    """A selector of a `**` pattern: a tensor that another site of the pattern captured
    first is not stored again (see `Claims`)."""

    claims: Claims = field(default_factory=Claims, compare=False, repr=False)

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        def admit(name: str, leaf: Any, grad: bool) -> None:
            if seen is not None:
                if name in seen:  # sent before in this call: an alias, or stored
                    self.claims.sent_again(name, leaf)
                    return
                seen.add(name)
            self.claims.admit(sink, name, leaf, grad)

        super().emit(value, admit, None)


@dataclass(frozen=True)
class Bound(Selector):
    """A selector of an `@every` pattern: each value goes under its key and the source line
    that bound it (`scores@every:L73`, see `binding_line`), one series per assignment;
    with `line` (`@every:L73`), only the values that line binds."""

    line: int | None = None

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        line = binding_line()
        if self.line is not None and line != self.line:
            return
        mark = f"{LINE_MARK}{line}"
        super().emit(value, lambda name, leaf, grad: sink(name + mark, leaf, grad), seen)


@dataclass(frozen=True)
class BoundFirstSite(FirstSite, Bound):
    """A selector of a `**` pattern read `@every`: each tensor stored under one of its
    per-line names (`Claims` sees the names with their lines)."""


@dataclass(frozen=True)
class CalleeRan(Selector):
    """Selects nothing from a called function's return; notes that it returned, so that
    a function never called is told from a variable never bound."""

    ran: list[bool] = field(default_factory=lambda: [False], compare=False, repr=False)

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        self.ran[0] = True
