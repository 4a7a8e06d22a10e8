"""Resolving patterns against a model: which methods of which modules to patch.

Everything here is static: module paths come from `named_modules()`,
methods from each module's class (below `torch.nn.Module`), variables
from each method's code object.  A tracer resolves its patterns into
`Target` objects before the first step, so a malformed or
non-matching pattern fails at once, naming the pattern and the nearest
existing sites.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import re
import types
import typing
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import _TorchDynamoContext as _DynamoContext
from torch.nn.modules.module import _global_forward_hooks

from vartrace._support.warnings import warn
from vartrace.engine.code import (
    CALLEE_SEPARATOR,
    MethodInfo,
    Returned,
    function_info,
    method_code,
    methods_of,
    returned_calls,
    runs_later,
    source_lines,
)
from vartrace.engine.frames import binding_line
from vartrace.engine.patching import Probe, Selector, Sink
from vartrace.engine.paths import LINE_MARK, Pattern, States, is_glob, parse
from vartrace.engine.structures import children, register_container, select
from vartrace.tracing.aliases import Aliases

__all__ = [
    "Target",
    "is_compiled",
    "list_sites",
    "module_methods",
    "resolve",
    "sites_of_type",
    "unwrap",
    "wildcard_grad_sites",
]

_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def _module_children(module: nn.Module) -> Iterator[tuple[str, object]]:
    # A parameter or buffer slot set to None (``bias=False``) is no value: skip it quietly.
    yield from ((k, v) for k, v in module._parameters.items() if v is not None)
    yield from ((k, v) for k, v in module._buffers.items() if v is not None)
    yield from module._modules.items()


register_container(nn.Module, _module_children)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / FSDP / `torch.compile` wrappers.

    Example:
        ```python
        unwrap(DistributedDataParallel(net)) is net   # True
        ```
    """
    while True:
        if type(model).__name__ in _WRAPPER_NAMES and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = typing.cast(nn.Module, model.module)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = typing.cast(nn.Module, model._orig_mod)  # torch.compile's OptimizedModule
        else:
            return model


def _without_scripted(
    modules: list[tuple[str, nn.Module]],
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """`modules` without the `torch.jit` script or traced modules and what lies below
    them (their code runs in TorchScript, outside Python), and those modules themselves."""
    kept: list[tuple[str, nn.Module]] = []
    scripted: list[tuple[str, nn.Module]] = []
    for path, module in modules:
        if any(path == top or path.startswith(f"{top}.") or not top for top, _ in scripted):
            continue
        (scripted if isinstance(module, torch.jit.ScriptModule) else kept).append((path, module))
    return kept, scripted


def _scripted_refusal(pattern: Pattern, scripted: list[tuple[str, nn.Module]]) -> str | None:
    """Why `pattern` cannot be traced, if it names a site inside a scripted module."""
    for path, module in scripted:
        states = pattern.start
        for segment in path.split(".") if path else ():
            states = pattern.step(states, segment, plain=True)
        if states and not is_glob(pattern.segments[0]):
            where = f"{path!r} is" if path else "the model is"
            return (
                f"pattern {pattern.text!r} names code inside a torch.jit module: {where} a "
                f"{type(module).__name__}, whose code TorchScript runs outside Python, where "
                "vartrace cannot see its values; trace the values the Python code around it "
                "passes in and gets back (the caller's locals), or keep the module "
                "unscripted while tracing"
            )
    return None


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` or one of its submodules runs under `torch.compile`."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in unwrap(model).modules())


def _fullgraph(compiled: Any) -> bool:
    """Whether `compiled` (an `OptimizedModule` or a `torch.compile`d function) was
    compiled with `fullgraph=True`: its Dynamo context says so."""
    context = getattr(compiled, "dynamo_ctx", None)
    if context is None and callable(compiled):
        for cell in getattr(compiled, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, _DynamoContext):
                    context = cell.cell_contents
    return bool(getattr(context, "fullgraph", False))


def fullgraph_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` that run under `torch.compile(..., fullgraph=True)`, by
    path: compiled in place (`module.compile(fullgraph=True)`) or wrapped and assigned
    back (`torch.compile(block, fullgraph=True)`: the wrapper's `_orig_mod`).

    Example:
        ```python
        model.layers[0].compile(fullgraph=True)
        [path for path, _ in fullgraph_regions(model)]   # ['layers.0']
        ```
    """
    regions = []
    for path, module in model.named_modules():
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module) and _fullgraph(module):
            # The model itself compiled: its paths start below the wrapper (sites.unwrap).
            regions.append((f"{path}._orig_mod" if path else "", inner))
        elif _fullgraph(getattr(module, "_compiled_call_impl", None)):
            regions.append((path, module))
    return regions


def module_methods(module: nn.Module) -> dict[str, MethodInfo]:
    """The methods of a module's class that a pattern can name (those below nn.Module)."""
    return methods_of(type(module), nn.Module)  # type: ignore[arg-type]  # classes hash


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _has_forward(module: nn.Module) -> bool:
    return "forward" in module_methods(module)


_INDICES = frozenset(str(i) for i in range(8))
Keys = frozenset[str] | None
"""The keys a returned value can have, or `None` where only the run can tell."""


@cache
def _tensor_keys() -> frozenset[str]:
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


class _ReturnKeys:
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
            return _tensor_keys() if call.names[0] in _tensor_methods() else None
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
                return _tensor_keys() | info.return_keys
            return _tensor_keys() if _returns_tensors(target) else None
        return _tensor_keys() if callable(target) and _from_torch(target) else None

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
class _CheckedReturn(Selector):
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


def _comma_hint(text: str) -> str:
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
        + _comma_hint(selector.pattern.text),
        UserWarning,
        stacklevel=2,
    )
    return True


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for an inference tensor, which keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


class _Claims:
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
class _FirstSite(Selector):
    """A selector of a `**` pattern: a tensor that another site of the pattern captured
    first is not stored again (see `_Claims`)."""

    claims: _Claims = field(default_factory=_Claims, compare=False, repr=False)

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
class _Bound(Selector):
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
class _BoundFirstSite(_FirstSite, _Bound):
    """A selector of a `**` pattern read `@every`: each tensor stored under one of its
    per-line names (`_Claims` sees the names with their lines)."""


@dataclass(frozen=True)
class _CalleeRan(Selector):
    """Selects nothing from a called function's return; notes that it returned, so that
    a function never called is told from a variable never bound."""

    ran: list[bool] = field(default_factory=lambda: [False], compare=False, repr=False)

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        self.ran[0] = True


@dataclass
class Target:
    """One method of one module to patch, with what to capture from it.

    `origins` maps each pattern's text to the site names of the selectors
    it contributed (a tracer uses it to say which pattern recorded nothing);
    `functions` maps each called function read from (`attn.forward>eager`)
    to a selector that notes whether it ever returned.
    """

    path: str
    module: nn.Module
    method: MethodInfo
    entry: list[Selector] = field(default_factory=list)
    exit: list[Selector] = field(default_factory=list)
    every: list[Selector] = field(default_factory=list)
    returns: list[Selector] = field(default_factory=list)
    calls: list[Selector] = field(default_factory=list)
    origins: dict[str, list[str]] = field(default_factory=dict)
    functions: dict[str, _CalleeRan] = field(default_factory=dict)

    def missing_keys(self) -> set[str]:
        """The sites of return values found at their first return without the key a
        pattern names (warned about then)."""
        return {s.site for s in self.returns if isinstance(s, _CheckedReturn) and s.missing[0]}

    def probe(self) -> Probe:
        return Probe(
            tuple(self.entry),
            tuple(self.exit),
            tuple(self.every),
            tuple(self.returns),
            tuple(self.calls),
        )


@dataclass(frozen=True)
class _Selection:
    """One static match: a variable (or return value) of a method or of a function it calls."""

    path: str
    module: nn.Module
    method: MethodInfo
    callee: MethodInfo | None
    variable: str | None
    states: States
    site: str = ""
    pattern: Pattern | None = None
    check: bool = False  # a key only the run can tell: checked at the first return


def _segment(method: MethodInfo, callee: MethodInfo | None) -> str:
    return method.name if callee is None else f"{method.name}{CALLEE_SEPARATOR}{callee.name}"


def _named_states(pattern: Pattern, states: States) -> States:
    """The states of `states` that stand on a segment other than `**`."""
    segments = pattern.segments
    return frozenset(i for i in states if i < len(segments) and segments[i] != "**")


def _replaced_on(module: nn.Module, method: MethodInfo) -> bool:
    """Whether `module` holds, under the method's name, a function of other code than the
    class's method (set on the instance: `model.forward = MethodType(f, model)`)."""
    held = vars(module).get(method.name)
    code = getattr(getattr(held, "__func__", held), "__code__", None)
    return isinstance(code, types.CodeType) and code is not method.code


class _Resolver:
    """Matches one pattern against the static sites of a model."""

    def __init__(
        self,
        modules: list[tuple[str, nn.Module]],
        pattern: Pattern,
        returns: _ReturnKeys,
        strict: bool = True,
    ) -> None:
        self.modules = modules
        self.pattern = pattern
        self.returns = returns
        self.strict = strict
        self.refused: list[str] = []  # sites a key below a returned value cannot be in

    def _module_states(self, path: str) -> States:
        states = self.pattern.start
        for segment in path.split(".") if path else ():
            states = self.pattern.step(states, segment, plain=True)
            if not states:
                break
        return states

    def _names_key(self, keys: Iterable[str], states: States) -> bool:
        """Whether one of `keys` (a constant, an index, a field) can come next."""
        return any(self.pattern.explicit(states, key) for key in keys)

    def selections(self) -> Iterator[_Selection]:
        """Every static match of the pattern, in module order."""
        p = self.pattern
        for path, module in self.modules:
            states = self._module_states(path)
            if not states:
                continue
            methods = module_methods(module)
            if p.accepts(states) and "forward" in methods:
                yield _Selection(path, module, methods["forward"], None, None, states)
            literal = p.literal_next(states)
            for name, info in methods.items():
                if (info.library or _torch_helper(module, name)) and name not in literal:
                    continue
                yield from self._code(path, module, info, None, states)
                for callee in info.callees:
                    yield from self._code(path, module, info, callee, states)
        yield from self._parameters()

    def _code(
        self,
        path: str,
        module: nn.Module,
        method: MethodInfo,
        callee: MethodInfo | None,
        states: States,
    ) -> Iterator[_Selection]:
        p = self.pattern
        segment = _segment(method, callee)
        after = p.step(states, segment)
        if not after:
            return
        if p.accepts(after):
            yield _Selection(path, module, method, callee, None, after)
            return
        info = callee or method
        for variable in info.variables:
            var_states = p.step(after, variable)
            if not var_states:
                continue
            # A variable swallowed by ``**`` matters only if the rest can name a key in it.
            if (
                p.accepts(var_states)
                or p.explicit(after, variable)
                or self._names_key(info.return_keys, var_states)
            ):
                yield _Selection(path, module, method, callee, variable, var_states)
        if self._names_key(info.return_keys, after):
            yield _Selection(path, module, method, callee, None, after)
            return
        named = segment in p.literal_next(states)
        # A name that is a variable of the method means the variable, not a key of the result.
        # Only the names after the method's own segment count: those a `**` before it could
        # also reach (`attn1` in `**.attn1.forward.hidden_states`) are not keys it names.
        keys = p.literal_next(p.step(_named_states(p, states), segment))
        if not named or (keys and keys <= set(info.variables)) or self._typo(info, after):
            return
        # The keys of a returned call's result: followed statically where it can be.
        # A method the program replaced on the module (TRL's fused LM head sets
        # `model.forward`) returns what its own function returns: only the run can tell.
        replaced = callee is None and _replaced_on(module, method)
        returned = (
            None if replaced else self.returns.of_method(module if callee is None else None, info)
        )
        if returned is not None and self._names_key(returned, after):
            yield _Selection(path, module, method, callee, None, after)
        elif returned is None or not self.strict:
            yield _Selection(path, module, method, callee, None, after, check=True)
        else:
            site = _join(path, segment)
            self.refused += [_join(site, k) for k in sorted(returned - _tensor_keys())]

    def _typo(self, info: MethodInfo, states: States) -> bool:
        """Whether the next literal segment looks like a misspelt variable of `info`."""
        return any(
            difflib.get_close_matches(name, info.variables, n=1, cutoff=0.75)
            for name in self.pattern.literal_next(states)
            if name not in info.variables
        )

    def _parameters(self) -> Iterator[_Selection]:
        """Parameters and buffers named as `named_parameters()` gives them, read through self;
        a parametrized tensor (`weight` under `weight_norm`) as the module that computes
        it returns it (`wn.parametrizations.weight`), each time the module reads it."""
        p = self.pattern
        modules = dict(self.modules)
        for path, module in self.modules:
            names = [*module._parameters, *module._buffers]
            tensors = {**module._parameters, **module._buffers}
            for name in names:
                full = _join(path, name)
                depth = full.count(".")
                if tensors[name] is None or not p.matches(full.split("."), plain=depth):
                    continue
                owner = path
                while "forward" not in module_methods(modules[owner]) and owner:
                    owner = owner.rpartition(".")[0]
                literal = parse(full + (f"@{p.when}" if p.when else ""))
                states = literal.start
                for segment in owner.split(".") if owner else ():
                    states = literal.step(states, segment, plain=True)
                forward = module_methods(modules[owner]).get("forward")
                if forward is not None:
                    found = _Selection(owner, modules[owner], forward, None, "self", states)
                    yield replace(found, site=full, pattern=literal)
            for name in _parametrized(module):
                full = _join(path, name)
                computing = modules.get(_join(path, "parametrizations", name))
                if computing is None or not p.matches(full.split("."), plain=full.count(".")):
                    continue
                literal = parse(full + (f"@{p.when}" if p.when else ""))
                states = literal.start
                for segment in full.split("."):
                    states = literal.step(states, segment, plain=True)
                forward = module_methods(computing)["forward"]
                holder = _join(path, "parametrizations", name)
                found = _Selection(holder, computing, forward, None, None, states, site=full)
                yield replace(found, pattern=literal)


def _runs_later(
    method: MethodInfo, callee: MethodInfo | None, variable: str | None, when: str | None
) -> str | None:
    """Why a variable cannot be read: its function is a generator or `async def`.

    Such a function's body runs after the call returned (when the generator is
    iterated, the coroutine awaited), outside the call the tracer brackets;
    its arguments at entry and the method's return value (the generator) can
    still be read.
    """
    info = callee or method
    kind = runs_later(info.code)
    at_entry = variable in method.arguments and when in (None, "entry", "grad")
    if kind is None or (callee is None and (variable is None or at_entry)):
        return None
    return (
        f"is in {info.name}, {kind} function: its body runs after the call returned (when "
        "it is iterated or awaited), where vartrace cannot read it; record the arguments "
        "(read at entry) or the values where they are consumed"
    )


def _add(
    target: Target, pattern: Pattern, selection: _Selection, claims: _Claims | None
) -> str | None:
    """Add one selection to `target`; return an error message for a bad timing.

    `claims`, for a `**` pattern, stores each tensor under one of its sites.
    """
    variable, states, callee = selection.variable, selection.states, selection.callee
    site = selection.site or _join(target.path, _segment(target.method, callee), variable or "")
    kind: type[Selector] = Selector
    extra: dict[str, Any] = {}
    if selection.check:
        kind = _CheckedReturn
    elif claims is not None:
        kind, extra = _FirstSite, {"claims": claims}
    if pattern.when == "every" and variable is not None:
        kind = _Bound if claims is None else _BoundFirstSite
        extra.update(tag="@every", line=pattern.line)
        if pattern.line is not None:
            info = callee or target.method
            lines = source_lines(info.code)
            if pattern.line not in lines:
                return (
                    f"{site}: line {pattern.line} runs no code of {info.name} (lines "
                    f"{min(lines)}-{max(lines)} of {info.code.co_filename}), so it binds none "
                    "of its values"
                )
    elif pattern.line is not None:
        return (
            f"{site} is a return value, read when its method returns, not bound at a line; "
            f"drop {LINE_MARK}{pattern.line}"
        )
    # A parameter selection walks from its owner module (named by its path) to the tensor.
    selector = kind(
        variable,
        target.path if selection.site and variable == "self" else site,
        selection.pattern or pattern,
        states,
        grad=pattern.when == "grad",
        callee=None if callee is None else callee.code,
        **extra,
    )
    when = pattern.when
    target.origins.setdefault(pattern.text, []).append(site)
    later = _runs_later(target.method, callee, variable, when)
    if later is not None:
        return f"{site} {later}"
    if callee is not None:
        if when == "entry" or (when == "every" and variable is None):
            return (
                f"{site} is read in a called function when it returns or @every, not "
                f"@{when}; drop @{when} to read it at return"
            )
        target.calls.append(selector)
        called = _join(target.path, _segment(target.method, callee))
        if called not in target.functions:
            ran = target.functions[called] = _CalleeRan(
                None, called, parse(called), frozenset(), callee=callee.code
            )
            target.calls.append(ran)
        return None
    if variable is None:
        if when == "entry" and selection.site:
            return (
                f"{site} is a parametrized tensor, computed by {target.path} when its module "
                "reads it and recorded then; drop @entry, or name the tensors it is computed "
                f"from ({target.path}.original*)"
            )
        if when == "entry":
            return f"{site} is a return value, which does not exist at entry; drop @entry"
        target.returns.append(selector)
        return None
    is_argument = variable in target.method.arguments
    if when == "every":
        target.every.append(selector)
    elif when == "entry" or (when in (None, "grad") and is_argument):
        if not is_argument:
            return (
                f"{site} is a local variable, not bound at entry; drop @entry to read it at return"
            )
        target.entry.append(selector)
    else:
        target.exit.append(selector)
    return None


def _tag_timings(target: Target) -> None:
    """Give distinct keys to one variable read at two timings (`x` and `x@return`).

    The variable's default timing (entry for an argument, return for a
    local; return in a called function) keeps the plain key; the other
    timing's key ends in `@entry` or `@return` (an `@every` key always ends
    in `@every:L<line>`, see `_Bound`).  Likewise a
    key of the return value named like an argument read at entry
    (`forward.cache`, transformers' cache argument and output field) ends in
    `@return`: `forward.cache` is the argument, `forward.cache@return`
    the output's.
    """
    lists = {"entry": target.entry, "return": target.exit}
    for timing, selectors in lists.items():
        for i, selector in enumerate(selectors):
            variable = selector.variable
            if variable in (None, "self") or selector.grad:
                continue
            default = "entry" if variable in target.method.arguments else "return"
            others = [
                t for t, s in lists.items() if any(o.variable == variable and not o.grad for o in s)
            ]
            if timing != default and len(others) > 1:
                selectors[i] = replace(selector, tag=f"@{timing}")
    arguments = frozenset(
        s.variable for s in target.entry if s.variable not in (None, "self") and not s.grad
    )
    if arguments:
        target.returns = [replace(s, renamed=arguments) for s in target.returns]


def _static_sites(
    modules: Iterable[tuple[str, nn.Module]], literal: frozenset[str] | set[str] = frozenset()
) -> Iterator[tuple[str, int]]:
    """Every static site with the number of its module path segments.

    Methods from an installed library's base classes and torch's own helpers
    are left out unless their name is in `literal` (the names a pattern
    spells out).
    """
    for path, module in modules:
        depth = path.count(".") + 1 if path else 0
        methods = module_methods(module)
        if path and "forward" in methods:
            yield path, depth
        for info in methods.values():
            if (info.library or _torch_helper(module, info.name)) and info.name not in literal:
                continue
            for callee in (None, *info.callees):
                segment = _segment(info, callee)
                yield _join(path, segment), depth
                for variable in (callee or info).variables:
                    if variable != "self":
                        yield _join(path, segment, variable), depth


def _parametrized(module: nn.Module) -> list[str]:
    """The names of `module`'s parametrized tensors (`torch.nn.utils.parametrize`:
    `weight_norm`, `spectral_norm`...), each computed when read."""
    if not torch.nn.utils.parametrize.is_parametrized(module):
        return []
    return list(typing.cast(nn.ModuleDict, module.parametrizations))


def _parameter_sites(
    model: nn.Module, scripted: list[tuple[str, nn.Module]]
) -> Iterator[tuple[str, int]]:
    """Parameter and buffer sites, then parametrized tensors, but those of scripted modules
    (listed in `scripted`)."""
    parametrized = [
        _join(path, name)
        for path, module in model.named_modules()
        for name in _parametrized(module)
    ]
    for name in (*dict(model.named_parameters()), *dict(model.named_buffers()), *parametrized):
        if not any(name.startswith(f"{path}.") or not path for path, _ in scripted):
            yield name, name.count(".")


def _parametrized_names(pattern: Pattern, modules: dict[str, nn.Module]) -> list[str]:
    """For a name that extends a parametrized tensor's (`wn.weight_g`, as the older
    `torch.nn.utils.weight_norm` named its parts): the tensor and the parameters it is
    computed from (`wn.weight`, `wn.parametrizations.weight.original0`...)."""
    *owner, last = pattern.segments
    path = ".".join(owner)
    module = modules.get(path)
    if module is None:
        return []
    for name in _parametrized(module):
        if last.startswith(name) and last != name:
            holder = _join(path, "parametrizations", name)
            computing = typing.cast(nn.ModuleDict, module.parametrizations)[name]
            originals = [_join(holder, n) for n in computing._parameters]
            return [_join(path, name), *originals]
    return []


def _closest(
    pattern: Pattern,
    modules: list[tuple[str, nn.Module]],
    scripted: list[tuple[str, nn.Module]],
    keys: Sequence[str] = (),
) -> list[str]:
    """The existing sites nearest to `pattern` (none inside the `scripted` modules);
    `keys` adds sites of keys below return values that the resolver found while
    refusing it."""
    body = ".".join(pattern.segments)
    parametrized = _parametrized_names(pattern, dict(modules))
    if parametrized:
        return parametrized
    sites = dict(_static_sites(modules))
    sites.update(_parameter_sites(modules[0][1], scripted))
    sites.update((k, 0) for k in keys)
    candidates = list(sites)
    close = difflib.get_close_matches(body, candidates, n=5, cutoff=0.6)
    if close and not any(is_glob(s) for s in pattern.segments):
        return close
    # A wildcard pattern: the sites it would match with its last segment spelt as a site's.
    last = pattern.segments[-1]
    tails = {c.rpartition(".")[2] for c in candidates}
    for near in difflib.get_close_matches(last, tails, n=3, cutoff=0.6):
        fixed = parse(".".join((*pattern.segments[:-1], near)))
        matched = [c for c in candidates if fixed.matches(c.split("."), plain=sites[c])]
        if matched:
            return matched[:5]
    if close:
        return close
    # Fall back on the sites below the longest prefix that still matches something.
    for cut in range(len(pattern.segments) - 1, 0, -1):
        prefix = parse(".".join(pattern.segments[:cut]) + ".**")
        below = [c for c in candidates if prefix.matches(c.split("."), plain=sites[c])]
        if below:
            return below[:5]
    return candidates[:5]


def wildcard_grad_sites(targets: Sequence[Target]) -> frozenset[str]:
    """The sites of `targets` that only `@grad` patterns ending in a wildcard reached
    (`**@grad`, `layers.*.forward.*@grad`): the user named none of them, so one that cannot
    receive a gradient (a helper returning an int, a buffer) is skipped quietly."""
    wild: set[str] = set()
    named: set[str] = set()
    for target in targets:
        for text, sites in target.origins.items():
            pattern = parse(text)
            if pattern.when == "grad":
                (wild if is_glob(pattern.segments[-1]) else named).update(sites)
    return frozenset(wild - named)


def resolve(
    model: nn.Module,
    patterns: Sequence[str],
    *,
    strict: bool = True,
    aliases: Aliases | None = None,
) -> list[Target]:
    """Resolve `patterns` into the targets to patch on `model` (already unwrapped).

    Raises `ValueError` quoting the pattern when one is malformed or, with
    `strict=True`, matches nothing (with `strict=False` it warns).  A key
    below a value a method returns from a call (`return self.proj(h)`)
    matches when the callee's result can have it, followed statically; where
    only the run can tell, or with `strict=False`, it is checked at the
    method's first return instead (a missing key warns then).  The names a `**`
    pattern matches that hold a tensor another of its sites stored are declared to
    `aliases` (see `vartrace.tracing.aliases`).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    parsed = [parse(text) for text in patterns]
    modules, scripted = _without_scripted(list(model.named_modules()))
    targets: dict[tuple[int, str], Target] = {}
    returns = _ReturnKeys()
    for pattern in parsed:
        found = 0
        errors: list[str] = []
        resolver = _Resolver(modules, pattern, returns, strict)
        claims = _Claims(aliases) if "**" in pattern.segments else None
        for selection in resolver.selections():
            key = (id(selection.module), selection.method.name)
            target = targets.get(key)
            if target is None:
                target = targets[key] = Target(selection.path, selection.module, selection.method)
            error = _add(target, pattern, selection, claims)
            if error is None:
                found += 1
            else:
                errors.append(error)
        if found:
            continue
        if errors:
            raise ValueError(f"pattern {pattern.text!r}: {errors[0]}")
        refusal = _scripted_refusal(pattern, scripted)
        if refusal is not None:
            if strict:
                raise ValueError(refusal)
            warn(refusal, stacklevel=3)
            continue
        close = ", ".join(_closest(pattern, modules, scripted, resolver.refused))
        message = (
            f"pattern {pattern.text!r} matches no site of {type(model).__name__}; "
            f"closest existing sites: {close} (see vartrace.list_sites(model))"
        )
        message += _comma_hint(pattern.text)
        if strict:
            raise ValueError(message)
        warn(message, stacklevel=3)
    for target in targets.values():
        _tag_timings(target)
    return [t for t in targets.values() if t.probe()]


def list_sites(model: nn.Module, pattern: str = "**") -> list[str]:
    """Every capturable site of `model` that `pattern` matches, in module order.

    Lists module outputs (`encoder.1`), method return values
    (`encoder.1.forward`), each method's arguments and locals
    (`encoder.1.forward.x`), the same for the functions each method calls
    by global name (`attn.forward>eager_attention_forward.attn_weights`),
    then parameters and buffers (`encoder.1.weight`); keys inside runtime
    values are not listed, nor methods inherited from an installed library's
    base classes (name those literally).  Example:

    ```python
    >>> vartrace.list_sites(model, "layers.0.attn.forward.*")
    ['layers.0.attn.forward.x', 'layers.0.attn.forward.q', ...]
    ```
    """
    parsed = parse(pattern)
    root = unwrap(model)
    modules, scripted = _without_scripted(list(root.named_modules()))
    literal = set(re.split(r"[.>@]", pattern))
    sites = [*_static_sites(modules, literal), *_parameter_sites(root, scripted)]
    return [s for s, depth in sites if parsed.matches(s.split("."), plain=depth)]


def _torch_helper(module: nn.Module, name: str) -> bool:
    """Whether `name` is a helper method of torch's own (`_get_abs_string_index` of a
    `ModuleList`, `reset_parameters`, `_conv_forward`): a method other than
    `forward` that a class of the `torch` package defines.  Wildcards skip them; a
    literal name reaches them."""
    return name != "forward" and _defined_by_torch(type(module), name)  # type: ignore[arg-type]


@cache
def _defined_by_torch(cls: type, name: str) -> bool:
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return owner.__module__.split(".")[0] == "torch"


def sites_of_type(model: nn.Module, *types: type[nn.Module]) -> list[str]:
    """The paths of the submodules of `model` that are instances of `types`.

    Example:
        ```python
        >>> vartrace.sites_of_type(model, nn.LayerNorm)
        ['layers.0.norm1', 'layers.0.norm2', ...]
        ```
    """
    if not types:
        raise TypeError("sites_of_type() needs at least one module class")
    return [
        path for path, module in unwrap(model).named_modules() if path and isinstance(module, types)
    ]
