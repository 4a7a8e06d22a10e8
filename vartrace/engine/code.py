"""Static facts about methods, read from classes and code objects.

Everything a pattern can name below a module — its methods, their
arguments and locals, the keys their return values may have — is known
before the first step from the class and each method's code object.  This
lets a tracer validate patterns and suggest near misses up front.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from functools import cache
from types import CodeType, FunctionType

__all__ = ["MethodInfo", "methods_of"]


@dataclass(frozen=True)
class MethodInfo:
    """What the engine knows about one method of a class.

    Attributes:
        name: the attribute name on the class (``forward``, ``_attention``).
        code: the code object whose frames are captured (decorators unwrapped).
        arguments: parameter names in order, ``self`` first.
        locals: every other local variable name (including closure cells).
        return_keys: keys a returned structure is likely to have: string
            constants of the code (``"logits"`` in ``return {"logits": ...}``),
            small indices, and the fields of a dataclass / namedtuple return
            annotation.  Used to decide statically which methods a key
            pattern may concern.
    """

    name: str
    code: CodeType
    arguments: tuple[str, ...]
    locals: tuple[str, ...]
    return_keys: frozenset[str]

    @property
    def variables(self) -> tuple[str, ...]:
        """Arguments then locals."""
        return self.arguments + self.locals


def _string_constants(code: CodeType) -> set[str]:
    found: set[str] = set()
    stack: list[object] = list(code.co_consts)
    while stack:
        const = stack.pop()
        if isinstance(const, str) and const.isidentifier():
            found.add(const)
        elif isinstance(const, tuple):
            stack.extend(const)
    return found


def _field_names(annotation: object) -> set[str]:
    """Field names of a dataclass / namedtuple return annotation (through Union/Optional)."""
    names: set[str] = set()
    for candidate in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(candidate):
            names.update(f.name for f in dataclasses.fields(candidate))
        names.update(getattr(candidate, "_fields", ()))
    return names


def _annotated_keys(function: object) -> frozenset[str]:
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # unresolvable forward references: annotations are only a hint
        return frozenset()
    return frozenset(_field_names(hints.get("return")))


@cache
def _analyse(name: str, code: CodeType, annotated_keys: frozenset[str]) -> MethodInfo:
    n_args = code.co_argcount + code.co_kwonlyargcount
    n_args += bool(code.co_flags & inspect.CO_VARARGS)
    n_args += bool(code.co_flags & inspect.CO_VARKEYWORDS)
    arguments = code.co_varnames[:n_args]
    local_names = code.co_varnames[n_args:] + tuple(
        c for c in code.co_cellvars if c not in arguments
    )
    keys = _string_constants(code) | {str(i) for i in range(8)} | annotated_keys
    return MethodInfo(name, code, arguments, local_names, frozenset(keys))


def method_code(function: object) -> CodeType | None:
    """The code object a method's frames run, looking through decorators."""
    try:
        inner = inspect.unwrap(function)  # type: ignore[arg-type]
    except ValueError:
        return None
    return inner.__code__ if isinstance(inner, FunctionType) else None


@cache
def methods_of(cls: type, stop: type | None = None) -> dict[str, MethodInfo]:
    """The plain methods defined on ``cls`` and its bases, up to (excluding) ``stop``.

    Dunder methods, static and class methods and properties are left out:
    they are not per-instance behaviour a tracer can patch.  Example::

        methods_of(MyBlock, torch.nn.Module)["forward"].locals
    """
    found: dict[str, MethodInfo] = {}
    for klass in cls.__mro__:
        if klass is object or (stop is not None and klass is stop):
            break
        for name, attr in vars(klass).items():
            if name in found or (name.startswith("__") and name.endswith("__")):
                continue
            if not isinstance(attr, FunctionType) and not hasattr(attr, "__wrapped__"):
                continue
            code = method_code(attr)
            if code is None or code.co_argcount == 0:
                continue
            found[name] = _analyse(name, code, _annotated_keys(inspect.unwrap(attr)))
    return found
