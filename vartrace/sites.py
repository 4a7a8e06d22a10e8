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
from dataclasses import dataclass, field

from torch import nn

from vartrace.engine.code import MethodInfo, methods_of
from vartrace.engine.patching import Probe, Selector
from vartrace.engine.paths import Pattern, States, parse
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
    yield from module._parameters.items()
    yield from module._buffers.items()
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
    """One method of one module to patch, with what to capture from it."""

    path: str
    module: nn.Module
    method: MethodInfo
    entry: list[Selector] = field(default_factory=list)
    exit: list[Selector] = field(default_factory=list)
    every: list[Selector] = field(default_factory=list)
    returns: list[Selector] = field(default_factory=list)

    def probe(self) -> Probe:
        return Probe(tuple(self.entry), tuple(self.exit), tuple(self.every), tuple(self.returns))


class _Resolver:
    """Matches one pattern against the static sites of a model."""

    def __init__(self, modules: list[tuple[str, nn.Module]], pattern: Pattern) -> None:
        self.modules = modules
        self.pattern = pattern

    def _module_states(self, path: str) -> States:
        states = self.pattern.start
        for segment in path.split(".") if path else ():
            states = self.pattern.step(states, segment)
            if not states:
                break
        return states

    def selections(self) -> Iterator[tuple[str, nn.Module, MethodInfo, str | None, States]]:
        """Yield ``(module path, module, method, variable or None, states)`` for each match."""
        p = self.pattern
        for path, module in self.modules:
            states = self._module_states(path)
            if not states:
                continue
            methods = module_methods(module)
            if p.accepts(states) and "forward" in methods:
                yield path, module, methods["forward"], None, states
            for name, info in methods.items():
                after = p.step(states, name)
                if not after:
                    continue
                if p.accepts(after):
                    yield path, module, info, None, after
                    continue
                for variable in info.variables:
                    var_states = p.step(after, variable)
                    if var_states:
                        yield path, module, info, variable, var_states
                if any(p.step(after, key) for key in info.return_keys):
                    yield path, module, info, None, after


def _add(target: Target, pattern: Pattern, variable: str | None, states: States) -> str | None:
    """Add one selection to ``target``; return an error message for a bad timing."""
    site = _join(target.path, target.method.name, variable or "")
    selector = Selector(variable, site, pattern, states, grad=pattern.when == "grad")
    when = pattern.when
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


def _static_sites(modules: Iterable[tuple[str, nn.Module]]) -> Iterator[str]:
    for path, module in modules:
        methods = module_methods(module)
        if path and "forward" in methods:
            yield path
        for name, info in methods.items():
            yield _join(path, name)
            for variable in info.variables:
                if variable != "self":
                    yield _join(path, name, variable)


def _closest(pattern: Pattern, modules: list[tuple[str, nn.Module]]) -> list[str]:
    body = ".".join(pattern.segments)
    candidates = list(dict.fromkeys(_static_sites(modules)))
    close = difflib.get_close_matches(body, candidates, n=5, cutoff=0.6)
    if close:
        return close
    # Fall back on the sites below the longest prefix that still matches something.
    for cut in range(len(pattern.segments) - 1, 0, -1):
        prefix = parse(".".join(pattern.segments[:cut]) + ".**")
        below = [c for c in candidates if prefix.matches(c.split("."))]
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
        for path, module, info, variable, states in _Resolver(modules, pattern).selections():
            key = (id(module), info.name)
            target = targets.get(key)
            if target is None:
                target = targets[key] = Target(path, module, info)
            error = _add(target, pattern, variable, states)
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
    return [t for t in targets.values() if t.probe()]


def list_sites(model: nn.Module, pattern: str = "**") -> list[str]:
    """Every capturable site of ``model`` that ``pattern`` matches, in module order.

    Lists module outputs (``encoder.1``), method return values
    (``encoder.1.forward``) and each method's arguments and locals
    (``encoder.1.forward.x``); keys inside runtime values are not listed.
    Example::

        >>> vartrace.list_sites(model, "layers.0.attn.forward.*")
        ['layers.0.attn.forward.x', 'layers.0.attn.forward.q', ...]
    """
    parsed = parse(pattern)
    modules = list(unwrap(model).named_modules())
    hidden = _torch_helpers(modules, pattern)
    return [
        s for s in _static_sites(modules) if parsed.matches(s.split(".")) and not _below(s, hidden)
    ]


def _torch_helpers(modules: list[tuple[str, nn.Module]], pattern: str) -> set[str]:
    """Sites of torch's own helper methods (``reset_parameters``, ``extra_repr``,
    ``_conv_forward``...): methods other than ``forward`` that a class of the ``torch``
    package defines, unless ``pattern`` names the method literally."""
    literal = set(re.split(r"[.>@]", pattern))
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
    """Whether ``site`` is one of ``methods`` or a variable of one."""
    parts = site.split(".")
    return any(".".join(parts[:cut]) in methods for cut in range(1, len(parts) + 1))


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
