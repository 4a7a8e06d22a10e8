"""The keys a method's return value holds, read statically from its code, and the check
that a pattern's keys (`forward.0`, `forward.logits`) exist in the value it returned.

Example:
    ```python
    keys = ReturnKeys().of_module(model.attn)   # e.g. {"0", "1"} for a tuple of two
    ```
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

from vartrace._support.warnings import warn
from vartrace.engine.code import (
    MethodInfo,
    Returned,
    function_info,
    method_code,
    returned_calls,
)
from vartrace.engine.patching import Selector, Sink
from vartrace.engine.structures import children, select
from vartrace.tracing.modules import module_methods

_INDICES = frozenset(str(i) for i in range(8))
Keys = frozenset[str] | None
"""The keys a returned value can have, or `None` where only the run can tell."""


@cache
def tensor_keys() -> frozenset[str]:
    """What a pattern may name below what a torch function returns: an index, a field of
    torch's named result tuples (`values`, `indices`), a tensor attribute (`shape`)."""
    fields = {
        name
        for kind in vars(torch.return_types).values()
        if isinstance(kind, type)
        for name in getattr(kind, "__match_args__", ())
    }
    attributes = {
        name
        for name in dir(torch.Tensor)
        if not name.startswith("_") and not callable(getattr(torch.Tensor, name, None))
    }
    return _INDICES | fields | attributes


@cache
def _tensor_methods() -> frozenset[str]:
    """Tensor methods that no container, str or module has: called on a local value
    (`x.softmax(-1)`), they return a tensor."""
    others = {*dir(dict), *dir(list), *dir(tuple), *dir(str), *dir(nn.Module)}
    return frozenset(
        name
        for name in dir(torch.Tensor)
        if name not in others and callable(getattr(torch.Tensor, name, None))
    )


def _from_torch(value: object) -> bool:
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] == "torch"


def _returns_tensors(function: FunctionType) -> bool:
    """Whether `function`'s return annotation says tensors: a tensor, `None`, or a
    tuple, list or union of those (not `Any`: `torch.func.functional_call`)."""
    try:
        hint = typing.get_type_hints(function).get("return", Any)
    except Exception:  # an unresolvable annotation says nothing
        return False
    return _holds_tensors(hint)


def _holds_tensors(hint: object) -> bool:
    if hint is None or hint is type(None):
        return True
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return issubclass(hint, torch.Tensor)
    if typing.get_origin(hint) in (tuple, list, typing.Union, types.UnionType):
        return all(arg is Ellipsis or _holds_tensors(arg) for arg in typing.get_args(hint))
    return False


def _fields(cls: type) -> frozenset[str]:
    """The field names of a dataclass or namedtuple class (empty for other classes)."""
    names = set(getattr(cls, "_fields", ()))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    return frozenset(names)


class ReturnKeys:
    """Follows the calls a method returns (`return self.proj(h)`) to the keys the result
    can have: a submodule's own return keys, a function's, a dataclass's fields; torch
    functions and tensor methods return tensors.  `None` where only the run can tell
    (a wrapper's `self.model(*args, **kwargs)` through a hook, a local function)."""

    _DEPTH = 24

    def __init__(self) -> None:
        self._memo: dict[tuple[int, object], Keys] = {}
        self._busy: set[tuple[int, object]] = set()

    def of_method(self, module: nn.Module | None, info: MethodInfo) -> Keys:
        """The keys of what `info` (a method of `module`, or a function) returns."""
        if info.annotated or info.function is None:
            return info.return_keys
        key = (id(module), info.code)
        if key in self._memo:
            return self._memo[key]
        if key in self._busy or len(self._busy) >= self._DEPTH:
            return frozenset()  # a recursive call adds no keys of its own
        self._busy.add(key)
        try:
            calls = returned_calls(info.function)
            found = self._union(self._of_call(module, info, call) for call in calls)
        finally:
            self._busy.discard(key)
        found = None if found is None else found | info.return_keys
        self._memo[key] = found
        return found

    def of_module(self, module: nn.Module) -> Keys:
        """The keys of what calling `module` returns (its forward, unless a hook, an
        instance attribute or a `__call__` of its class may change it)."""
        if (
            module._forward_hooks
            or _global_forward_hooks
            or "forward" in vars(module)
            or type(module).__call__ is not nn.Module.__call__
        ):
            return None
        forward = module_methods(module).get("forward")
        return None if forward is None else self.of_method(module, forward)

    def _of_call(self, module: nn.Module | None, info: MethodInfo, call: Returned) -> Keys:
        if call.kind == "value":
            return tensor_keys() if call.names[0] in _tensor_methods() else None
        if call.kind == "global":
            return self._of_target(call.target, call.keywords)
        if module is None:
            return None
        if call.kind == "self":
            return self._of_attribute(module, call.names)
        if call.kind == "super":
            return self._of_super(module, info, call.names[0])
        if call.kind == "loop":
            container = _walk(module, call.names)
            if isinstance(container, (nn.ModuleList, nn.Sequential)) and len(container):
                return self._union(self.of_module(m) for m in container)
        return None

    def _of_attribute(self, module: nn.Module, names: tuple[str, ...]) -> Keys:
        if not names:
            return self.of_module(module)  # self(...)
        owner = _walk(module, names[:-1])
        last = names[-1]
        if not isinstance(owner, nn.Module):
            return None
        if last in vars(owner):  # a function held by the instance (self.act = F.gelu)
            held = vars(owner)[last]
            if getattr(held, "__self__", None) is owner:  # a bound method of its own
                return self._of_target(held.__func__, False, owner)
            return self._of_target(held, False)
        if last in owner._modules:
            child = owner._modules[last]
            return None if child is None else self.of_module(child)
        method = module_methods(owner).get(last)
        return None if method is None else self.of_method(owner, method)

    def _of_super(self, module: nn.Module, info: MethodInfo, name: str) -> Keys:
        mro = type(module).__mro__
        here = [i for i, c in enumerate(mro) if method_code(vars(c).get(info.name)) is info.code]
        for klass in mro[here[0] + 1 :] if here else ():
            if klass is nn.Module:
                return None
            attr = vars(klass).get(name)
            if attr is not None:
                found = inspect.unwrap(attr)
                if not isinstance(found, FunctionType):
                    return None
                return self.of_method(module, function_info(found))
        return None

    def _of_target(self, target: object, keywords: bool, owner: nn.Module | None = None) -> Keys:
        """The keys of what calling `target` returns (`keywords`: with keyword names
        only); `owner` is the module a method of its own is bound to."""
        if isinstance(target, type):
            fields = _fields(target)
            if fields:
                return _INDICES | fields
            # A structure built with keyword names (dict(loss=...)): they are constants.
            return frozenset() if keywords else None
        if isinstance(target, FunctionType):
            info = function_info(inspect.unwrap(target))
            if not _from_torch(target):
                return self.of_method(owner, info)
            if info.annotated:
                return tensor_keys() | info.return_keys
            return tensor_keys() if _returns_tensors(target) else None
        return tensor_keys() if callable(target) and _from_torch(target) else None

    @staticmethod
    def _union(parts: Iterable[Keys]) -> Keys:
        keys: set[str] = set()
        for part in parts:
            if part is None:
                return None
            keys.update(part)
        return frozenset(keys)


def _walk(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The submodule `module.<names...>`, or `None` where a name is no submodule."""
    for name in names:
        found = module._modules.get(name)
        if found is None:
            return None
        module = found
    return module


@dataclass(frozen=True)
class CheckedReturn(Selector):
    """A key below a return value that only the run can tell (a wrapper's
    `self.model(*args, **kwargs)`): at the method's first return, a key absent from the
    value warns right then, naming the value's type, its keys and the closest ones."""

    first: list[bool] = field(default_factory=lambda: [True], compare=False, repr=False)
    missing: list[bool] = field(default_factory=lambda: [False], compare=False, repr=False)

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        if self.first[0]:
            self.first[0] = False
            self.missing[0] = _check_keys(self, value)
        super().emit(value, sink, seen)


def comma_hint(text: str) -> str:
    """For a pattern holding a comma, how to pass what it seems to list."""
    if "," not in text:
        return ""
    parts = [part.strip() for part in text.split(",")]
    return f"; a pattern names one path: pass several as a list, {parts!r}"


def _check_keys(selector: Selector, value: Any) -> bool:
    """Warn (and return `True`) when the key that `selector` names next is not in
    `value`."""
    wanted = sorted(selector.pattern.literal_next(selector.states))
    if not wanted or next(select(value, selector.pattern, selector.states, selector.site), None):
        return False
    kids = children(value)
    if kids is None:  # plain attributes of an object
        keys = [k for k in getattr(value, "__dict__", {}) if not k.startswith("_")]
    else:
        keys = [key for key, _ in kids]
    if _fields(type(value)).intersection(wanted):
        return False  # a field that is None at this call (a loss without labels)
    close = dict.fromkeys(c for w in wanted for c in difflib.get_close_matches(w, keys, 3, 0.6))
    has = f"with keys {', '.join(keys[:20])}" if keys else "which has no keys"
    warn(
        f"vartrace: pattern {selector.pattern.text!r}: {selector.site} returned a "
        f"{type(value).__name__} {has}; no key {', '.join(map(repr, wanted))}"
        + (f"; closest: {', '.join(close)}" if close else "")
        + " (it records nothing under this name)"
        + comma_hint(selector.pattern.text),
        UserWarning,
        stacklevel=2,
    )
    return True
