"""Binding a patched call's arguments to the names of the traced function's parameters.

`ArgumentBinder` gives `_Patch` the arguments a probe reads at entry
(`forward.x`), cheaply for a plain signature and, for a call made through a
decorator whose signature differs, by position and name with one warning.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vartrace._support.warnings import warn

__all__ = ["ArgumentBinder"]


class ArgumentBinder:
    """Maps a call's arguments to the names of the traced function's parameters.

    Those are the names sites use (`forward.x`), read from the function behind
    decorators.  A decorator whose own signature differs (a `functools.wraps`
    wrapper that takes a keyword of its own) is checked with its signature, the
    one the call is made with; the arguments the traced function's signature
    cannot bind are left out, once with a warning, never with an error: a call
    that neither signature accepts raises its own `TypeError` when it runs.
    """

    __slots__ = ("_called", "_positional", "_signature", "_warned", "name")

    def __init__(self, bound_method: Callable[..., Any], name: str) -> None:
        self.name = name
        self._signature = inspect.signature(bound_method)
        called = inspect.signature(bound_method, follow_wrapped=False)
        self._called = None if called == self._signature else called
        params = list(self._signature.parameters.values())
        simple = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self._positional = tuple(p.name for p in params) if simple else None
        self._warned = False

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Parameter name -> argument of one call, defaults filled in:
        `binder.bind((x,), {})` of `forward(self, x, mask=None)` bound to a module gives
        `{"x": x, "mask": None}`."""
        names = self._positional
        if names is not None and not kwargs and len(args) == len(names):
            return dict(zip(names, args, strict=True))
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return self._partial(args, kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of a call that the traced function's signature does not accept
        but a decorator's does: positional ones in order, keywords by name."""
        if self._called is None:
            return {}  # the call fails as it runs
        try:
            self._called.bind(*args, **kwargs)
        except TypeError:
            return {}
        params = list(self._signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        arguments: dict[str, Any] = {p.name: a for p, a in zip(positional, args, strict=False)}
        by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        arguments.update((k, v) for k, v in kwargs.items() if k in by_name and k not in arguments)
        for p in params:
            if p.name not in arguments and p.default is not p.empty:
                arguments[p.name] = p.default
        if not self._warned:
            self._warned = True
            left = sorted(k for k in kwargs if k not in by_name)
            if len(args) > len(positional):
                left.append(f"{len(args) - len(positional)} more positional")
            plain = self._called.replace(return_annotation=inspect.Signature.empty)
            own = self._signature.replace(return_annotation=inspect.Signature.empty)
            warn(
                f"vartrace: {self.name} is called through a decorator whose signature "
                f"{plain} differs from the traced function's {own}: its arguments are read "
                "by position and name"
                + (
                    f"; those the function does not take ({', '.join(left)}) are not recorded"
                    if left
                    else ""
                ),
                UserWarning,
                stacklevel=5,
            )
        return arguments
