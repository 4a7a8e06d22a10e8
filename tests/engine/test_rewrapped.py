"""Patched methods that the program re-wraps or decorates while traced (torch-free).

accelerate's mixed precision rebuilds ``model.forward`` from
``model.forward.__func__`` after the tracer patched it; a ``functools.wraps``
decorator may take a keyword the traced function does not.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from tests.engine.test_patching import Recorder, _probe
from vartrace.engine import Hook, attach, detach, methods_of
from vartrace.engine.frames import FrameCore


class Block:
    def forward(self, x: int, scale: int = 1) -> int:
        doubled = x * 2 * scale
        return doubled


def _entered(calls: list[str], function: Callable[..., Any]) -> Callable[..., Any]:
    """What accelerate's autocast decorator is to the traced code: a ``functools.wraps``
    wrapper that notes each call (``calls``) and passes it on."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append("entered")
        return function(*args, **kwargs)

    return wrapper


def _attach(obj: Any, method: str, *specs: str) -> tuple[Hook, Recorder]:
    recorder = Recorder()
    hook = Hook(_probe(method, *specs), recorder)
    attach(obj, method, methods_of(type(obj))[method].code, hook)
    return hook, recorder


def test_a_method_rebuilt_from_its_func_keeps_recording(core: FrameCore) -> None:
    """``obj.forward = MethodType(wrapper(obj.forward.__func__), obj)``, as accelerate
    does for mixed precision, once the tracer patched ``forward``."""
    block, other = Block(), Block()
    hook, rec = _attach(block, "forward", "x:entry", "doubled:exit")
    calls: list[str] = []
    block.forward = types.MethodType(_entered(calls, block.forward.__func__), block)  # type: ignore[method-assign]
    try:
        assert block.forward(3) == 6
        assert block.forward(4, scale=2) == 16
        assert types.MethodType(block.forward.__func__, other)(5) == 10, "another object: untraced"
    finally:
        detach(block, "forward", hook)
    assert calls == ["entered"] * 3
    assert rec.sites() == {"forward.x": [3, 4], "forward.doubled": [6, 16]}
    assert hook.calls == 2
    assert block.forward(6) == 12, "after the tracer stops, the rebuilt method runs untraced"
    assert rec.sites()["forward.x"] == [3, 4]


def test_the_rebuilt_method_keeps_the_signature_and_unwraps_to_a_traced_function(
    core: FrameCore,
) -> None:
    """Trainer reads ``inspect.signature(model.forward)`` to keep dataset columns; unwrapping
    a rebuilt method (accelerate's ``unwrap_model``) along ``__wrapped__`` keeps recording."""
    block = Block()
    hook, rec = _attach(block, "forward", "x:entry")
    rebuilt = types.MethodType(_entered([], block.forward.__func__), block)
    assert list(inspect.signature(rebuilt).parameters) == ["x", "scale"]
    assert block.forward.__func__.__name__ == "forward"
    block.forward = types.MethodType(inspect.unwrap(rebuilt.__func__), block)  # type: ignore[method-assign]
    try:
        block.forward(7)
    finally:
        detach(block, "forward", hook)
    assert rec.sites() == {"forward.x": [7]}


def _with_keyword(function: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that takes a keyword of its own (``factor``) and hides it from the
    function it wraps."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, factor: int = 1, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs) * factor

    return wrapper


class Decorated:
    @_with_keyword
    def forward(self, x: int, scale: int = 1) -> int:
        doubled = x * 2 * scale
        return doubled


def test_a_decorator_taking_a_keyword_of_its_own_is_bound_with_its_signature(
    core: FrameCore,
) -> None:
    """The extra keyword used to raise TypeError inside the call; now the arguments the
    traced function has are recorded, and one warning says what was left out."""
    block = Decorated()
    hook, rec = _attach(block, "forward", "x:entry", "scale:entry", "doubled:exit")
    try:
        with pytest.warns(UserWarning, match=r"Decorated\.forward .* does not take \(factor\)"):
            assert block.forward(3, factor=10) == 60
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            assert block.forward(2, scale=3, factor=2) == 24
            assert block.forward(1) == 2
    finally:
        detach(block, "forward", hook)
    assert rec.sites() == {
        "forward.x": [3, 2, 1],
        "forward.scale": [1, 3, 1],
        "forward.doubled": [6, 12, 2],
    }


def test_a_call_the_signature_refuses_raises_its_own_error(core: FrameCore) -> None:
    """Binding never raises into the call: the call itself raises, as untraced."""
    block = Block()
    hook, rec = _attach(block, "forward", "x:entry")
    try:
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            block.forward(3, bogus=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
            block.forward()  # type: ignore[call-arg]
    finally:
        detach(block, "forward", hook)
    assert rec.sites() == {}
