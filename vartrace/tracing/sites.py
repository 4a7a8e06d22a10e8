"""Resolving patterns against a model: which methods of which modules to patch.

Everything here is static: module paths come from `named_modules()`,
methods from each module's class (below `torch.nn.Module`), variables
from each method's code object.  A tracer resolves its patterns into
`Target` objects before the first step, so a malformed or
non-matching pattern fails at once, naming the pattern and the nearest
existing sites.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vartrace._support.warnings import warn
from vartrace.engine.code import (
    CALLEE_SEPARATOR,
    MethodInfo,
    runs_later,
    source_lines,
)
from vartrace.engine.patching import Probe, Selector
from vartrace.engine.paths import LINE_MARK, Pattern, States, is_glob, parse
from vartrace.tracing.aliases import Aliases
from vartrace.tracing.claims import Bound, BoundFirstSite, CalleeRan, Claims, FirstSite
from vartrace.tracing.modules import (
    join_path,
    module_methods,
    scripted_refusal,
    torch_helper,
    unwrap,
    without_scripted,
)
from vartrace.tracing.returns import CheckedReturn, ReturnKeys, comma_hint, tensor_keys

__all__ = ["Target", "list_sites", "resolve", "sites_of_type", "wildcard_grad_sites"]


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
    functions: dict[str, CalleeRan] = field(default_factory=dict)

    def missing_keys(self) -> set[str]:
        """The sites of return values found at their first return without the key a
        pattern names (warned about then)."""
        return {s.site for s in self.returns if isinstance(s, CheckedReturn) and s.missing[0]}

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
        returns: ReturnKeys,
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
                if (info.library or torch_helper(module, name)) and name not in literal:
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
            site = join_path(path, segment)
            self.refused += [join_path(site, k) for k in sorted(returned - tensor_keys())]

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
                full = join_path(path, name)
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
                full = join_path(path, name)
                computing = modules.get(join_path(path, "parametrizations", name))
                if computing is None or not p.matches(full.split("."), plain=full.count(".")):
                    continue
                literal = parse(full + (f"@{p.when}" if p.when else ""))
                states = literal.start
                for segment in full.split("."):
                    states = literal.step(states, segment, plain=True)
                forward = module_methods(computing)["forward"]
                holder = join_path(path, "parametrizations", name)
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
    target: Target, pattern: Pattern, selection: _Selection, claims: Claims | None
) -> str | None:
    """Add one selection to `target`; return an error message for a bad timing.

    `claims`, for a `**` pattern, stores each tensor under one of its sites.
    """
    variable, states, callee = selection.variable, selection.states, selection.callee
    site = selection.site or join_path(target.path, _segment(target.method, callee), variable or "")
    kind: type[Selector] = Selector
    extra: dict[str, Any] = {}
    if selection.check:
        kind = CheckedReturn
    elif claims is not None:
        kind, extra = FirstSite, {"claims": claims}
    if pattern.when == "every" and variable is not None:
        kind = Bound if claims is None else BoundFirstSite
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
        called = join_path(target.path, _segment(target.method, callee))
        if called not in target.functions:
            ran = target.functions[called] = CalleeRan(
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
    in `@every:L<line>`, see `Bound`).  Likewise a
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
            if (info.library or torch_helper(module, info.name)) and info.name not in literal:
                continue
            for callee in (None, *info.callees):
                segment = _segment(info, callee)
                yield join_path(path, segment), depth
                for variable in (callee or info).variables:
                    if variable != "self":
                        yield join_path(path, segment, variable), depth


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
        join_path(path, name)
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
            holder = join_path(path, "parametrizations", name)
            computing = typing.cast(nn.ModuleDict, module.parametrizations)[name]
            originals = [join_path(holder, n) for n in computing._parameters]
            return [join_path(path, name), *originals]
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
    modules, scripted = without_scripted(list(model.named_modules()))
    targets: dict[tuple[int, str], Target] = {}
    returns = ReturnKeys()
    for pattern in parsed:
        found = 0
        errors: list[str] = []
        resolver = _Resolver(modules, pattern, returns, strict)
        claims = Claims(aliases) if "**" in pattern.segments else None
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
        refusal = scripted_refusal(pattern, scripted)
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
        message += comma_hint(pattern.text)
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
    modules, scripted = without_scripted(list(root.named_modules()))
    literal = set(re.split(r"[.>@]", pattern))
    sites = [*_static_sites(modules, literal), *_parameter_sites(root, scripted)]
    return [s for s, depth in sites if parsed.matches(s.split("."), plain=depth)]


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
