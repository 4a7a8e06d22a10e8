"""Resolving patterns against a model: which methods of which modules to patch.

Everything here is static: module paths come from ``named_modules()``,
methods from each module's class (below ``torch.nn.Module``), variables
from each method's code object.  A tracer resolves its patterns into
:class:`Target` objects before the first step, so a malformed or
non-matching pattern fails at once, naming the pattern and the nearest
existing sites.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from vartrace.engine.code import CALLEE_SEPARATOR, MethodInfo, methods_of
from vartrace.engine.patching import Probe, Selector
from vartrace.engine.paths import Pattern, States, is_glob, parse
from vartrace.engine.structures import register_container

__all__ = [
    "Target",
    "is_compiled",
    "list_sites",
    "module_methods",
    "resolve",
    "sites_of_type",
    "unwrap",
]

_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def _module_children(module: nn.Module) -> Iterator[tuple[str, object]]:
    # A parameter or buffer slot set to None (``bias=False``) is no value: skip it quietly.
    yield from ((k, v) for k, v in module._parameters.items() if v is not None)
    yield from ((k, v) for k, v in module._buffers.items() if v is not None)
    yield from module._modules.items()


register_container(nn.Module, _module_children)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers.

    Example::

        unwrap(DistributedDataParallel(net)) is net   # True
    """
    while True:
        if type(model).__name__ in _WRAPPER_NAMES and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules runs under ``torch.compile``."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in unwrap(model).modules())


def module_methods(module: nn.Module) -> dict[str, MethodInfo]:
    """The methods of a module's class that a pattern can name (those below nn.Module)."""
    return methods_of(type(module), nn.Module)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _has_forward(module: nn.Module) -> bool:
    return "forward" in module_methods(module)


@dataclass
class Target:
    """One method of one module to patch, with what to capture from it.

    ``origins`` maps each pattern's text to the site names of the selectors
    it contributed (a tracer uses it to say which pattern recorded nothing).
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


def _segment(method: MethodInfo, callee: MethodInfo | None) -> str:
    return method.name if callee is None else f"{method.name}{CALLEE_SEPARATOR}{callee.name}"


class _Resolver:
    """Matches one pattern against the static sites of a model."""

    def __init__(self, modules: list[tuple[str, nn.Module]], pattern: Pattern) -> None:
        self.modules = modules
        self.pattern = pattern

    def _module_states(self, path: str) -> States:
        states = self.pattern.start
        for segment in path.split(".") if path else ():
            states = self.pattern.step(states, segment, plain=True)
            if not states:
                break
        return states

    def _names_key(self, info: MethodInfo, states: States) -> bool:
        """Whether a key the code names (a constant, an index, a field) can come next."""
        return any(self.pattern.explicit(states, key) for key in info.return_keys)

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
                if info.library and name not in literal:
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
                or self._names_key(info, var_states)
            ):
                yield _Selection(path, module, method, callee, variable, var_states)
        named = segment in p.literal_next(states)
        # A name that is a variable of the method means the variable, not a key of the result.
        keys = p.literal_next(after)
        names_variables = bool(keys) and keys <= set(info.variables)
        open_keys = (
            info.open_return and named and not names_variables and not self._typo(info, after)
        )
        if self._names_key(info, after) or open_keys:
            yield _Selection(path, module, method, callee, None, after)

    def _typo(self, info: MethodInfo, states: States) -> bool:
        """Whether the next literal segment looks like a misspelt variable of ``info``."""
        return any(
            difflib.get_close_matches(name, info.variables, n=1, cutoff=0.75)
            for name in self.pattern.literal_next(states)
            if name not in info.variables
        )

    def _parameters(self) -> Iterator[_Selection]:
        """Parameters and buffers named as ``named_parameters()`` gives them, read through self."""
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


def _add(target: Target, pattern: Pattern, selection: _Selection) -> str | None:
    """Add one selection to ``target``; return an error message for a bad timing."""
    variable, states, callee = selection.variable, selection.states, selection.callee
    site = selection.site or _join(target.path, _segment(target.method, callee), variable or "")
    # A parameter selection walks from its owner module (named by its path) to the tensor.
    selector = Selector(
        variable,
        target.path if selection.site else site,
        selection.pattern or pattern,
        states,
        grad=pattern.when == "grad",
        callee=None if callee is None else callee.code,
    )
    when = pattern.when
    target.origins.setdefault(pattern.text, []).append(site)
    if callee is not None:
        if when == "entry" or (when == "every" and variable is None):
            return f"{site} is read in a called function when it returns or @every, not @{when}"
        target.calls.append(selector)
        return None
    if variable is None:
        if when == "entry":
            return f"{site} is a return value, which does not exist at entry"
        target.returns.append(selector)
        return None
    is_argument = variable in target.method.arguments
    if when == "every":
        target.every.append(selector)
    elif when == "entry" or (when in (None, "grad") and is_argument):
        if not is_argument:
            return f"{site} is a local variable, not bound at entry"
        target.entry.append(selector)
    else:
        target.exit.append(selector)
    return None


def _tag_timings(target: Target) -> None:
    """Give distinct keys to one variable read at two timings (``x`` and ``x@return``).

    The variable's default timing (entry for an argument, return for a
    local; return in a called function) keeps the plain key; the other
    timing's key ends in ``@entry``, ``@return`` or ``@every``.
    """
    lists = {"entry": target.entry, "return": target.exit, "every": target.every}
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
    for i, selector in enumerate(target.calls):
        if selector.pattern.when == "every" and any(
            other.callee is selector.callee
            and other.variable == selector.variable
            and other.pattern.when in (None, "return")
            for other in target.calls
        ):
            target.calls[i] = replace(selector, tag="@every")


def _static_sites(
    modules: Iterable[tuple[str, nn.Module]], literal: frozenset[str] | set[str] = frozenset()
) -> Iterator[tuple[str, int]]:
    """Every static site with the number of its module path segments.

    Methods from an installed library's base classes are left out unless
    their name is in ``literal`` (the names a pattern spells out).
    """
    for path, module in modules:
        depth = path.count(".") + 1 if path else 0
        methods = module_methods(module)
        if path and "forward" in methods:
            yield path, depth
        for info in methods.values():
            if info.library and info.name not in literal:
                continue
            for callee in (None, *info.callees):
                segment = _segment(info, callee)
                yield _join(path, segment), depth
                for variable in (callee or info).variables:
                    if variable != "self":
                        yield _join(path, segment, variable), depth


def _parameter_sites(model: nn.Module) -> Iterator[tuple[str, int]]:
    for name, _ in (*model.named_parameters(), *model.named_buffers()):
        yield name, name.count(".")


def _closest(pattern: Pattern, modules: list[tuple[str, nn.Module]]) -> list[str]:
    body = ".".join(pattern.segments)
    sites = dict(_static_sites(modules))
    sites.update(_parameter_sites(modules[0][1]))
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


def resolve(model: nn.Module, patterns: Sequence[str], *, strict: bool = True) -> list[Target]:
    """Resolve ``patterns`` into the targets to patch on ``model`` (already unwrapped).

    Raises ``ValueError`` quoting the pattern when one is malformed or, with
    ``strict=True``, matches nothing (with ``strict=False`` it warns).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    parsed = [parse(text) for text in patterns]
    modules = list(model.named_modules())
    targets: dict[tuple[int, str], Target] = {}
    for pattern in parsed:
        found = 0
        errors: list[str] = []
        for selection in _Resolver(modules, pattern).selections():
            key = (id(selection.module), selection.method.name)
            target = targets.get(key)
            if target is None:
                target = targets[key] = Target(selection.path, selection.module, selection.method)
            error = _add(target, pattern, selection)
            if error is None:
                found += 1
            else:
                errors.append(error)
        if found:
            continue
        if errors:
            raise ValueError(
                f"pattern {pattern.text!r}: {errors[0]}; drop @entry to read it at return"
            )
        close = ", ".join(_closest(pattern, modules))
        message = (
            f"pattern {pattern.text!r} matches no site of {type(model).__name__}; "
            f"closest existing sites: {close} (see vartrace.list_sites(model))"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)
    for target in targets.values():
        _tag_timings(target)
    return [t for t in targets.values() if t.probe()]


def list_sites(model: nn.Module, pattern: str = "**") -> list[str]:
    """Every capturable site of ``model`` that ``pattern`` matches, in module order.

    Lists module outputs (``encoder.1``), method return values
    (``encoder.1.forward``), each method's arguments and locals
    (``encoder.1.forward.x``), the same for the functions each method calls
    by global name (``attn.forward>eager_attention_forward.attn_weights``),
    then parameters and buffers (``encoder.1.weight``); keys inside runtime
    values are not listed, nor methods inherited from an installed library's
    base classes (name those literally).  Example::

        >>> vartrace.list_sites(model, "layers.0.attn.forward.*")
        ['layers.0.attn.forward.x', 'layers.0.attn.forward.q', ...]
    """
    parsed = parse(pattern)
    root = unwrap(model)
    modules = list(root.named_modules())
    literal = set(re.split(r"[.>@]", pattern))
    hidden = _torch_helpers(modules, literal)
    sites = [*_static_sites(modules, literal), *_parameter_sites(root)]
    return [
        s
        for s, depth in sites
        if parsed.matches(s.split("."), plain=depth) and not _below(s, hidden)
    ]


def _torch_helpers(modules: list[tuple[str, nn.Module]], literal: set[str]) -> set[str]:
    """Sites of torch's own helper methods (``reset_parameters``, ``extra_repr``,
    ``_conv_forward``...): methods other than ``forward`` that a class of the ``torch``
    package defines, unless the pattern names the method literally (in ``literal``)."""
    hidden = set()
    for path, module in modules:
        for name in module_methods(module):
            if name == "forward" or name in literal:
                continue
            owner = next(c for c in type(module).__mro__ if name in vars(c))
            if owner.__module__.split(".")[0] == "torch":
                hidden.add(_join(path, name))
    return hidden


def _below(site: str, methods: set[str]) -> bool:
    """Whether ``site`` is one of ``methods``, or a variable or called function of one."""
    cuts = [match.start() for match in re.finditer(r"[.>]", site)]
    return any(site[:cut] in methods for cut in [*cuts, len(site)])


def sites_of_type(model: nn.Module, *types: type[nn.Module]) -> list[str]:
    """The paths of the submodules of ``model`` that are instances of ``types``.

    Example::

        >>> vartrace.sites_of_type(model, nn.LayerNorm)
        ['layers.0.norm1', 'layers.0.norm2', ...]
    """
    if not types:
        raise TypeError("sites_of_type() needs at least one module class")
    return [
        path for path, module in unwrap(model).named_modules() if path and isinstance(module, types)
    ]
