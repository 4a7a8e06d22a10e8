"""Static facts about methods, read from classes and code objects.

Everything a pattern can name below a module — its methods, their
arguments and locals, the keys their return values may have — is known
before the first step from the class and each method's code object.  This
lets a tracer validate patterns and suggest near misses up front.
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
import os
import site
import sys
import sysconfig
import typing
from dataclasses import dataclass, field
from functools import cache
from types import CodeType, FunctionType

__all__ = ["MethodInfo", "methods_of"]

CALLEE_SEPARATOR = ">"
"""Joins a method and a function it calls into one site segment: ``forward>attention``."""


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
        open_return: whether some ``return`` hands back a call's result
            (``return self.model(*args, **kwargs)``), whose keys only the
            run can tell.
        library: the method comes from a base class of an installed
            library (``PreTrainedModel.from_pretrained`` machinery): wildcards
            skip it, a literal name still reaches it.
        callees: the plain functions the method calls by global name
            (``eager_attention_forward``), each analysed like a method.
    """

    name: str
    code: CodeType
    arguments: tuple[str, ...]
    locals: tuple[str, ...]
    return_keys: frozenset[str]
    open_return: bool = False
    library: bool = False
    callees: tuple[MethodInfo, ...] = field(default=(), compare=False)

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


_BARE_CALLS = frozenset({"CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_EX"})
_SKIPPED = frozenset({"CACHE", "EXTENDED_ARG", "NOP", "PRECALL"})
_LOAD_FAST = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})


def _returns_a_call(code: CodeType) -> bool:
    """Whether some ``return`` returns a call's result made without keyword names.

    Either directly (``return self.model(*args, **kwargs)``) or through a
    local stored straight from such a call (``out = self.model(**batch)``
    ... ``return out``).  A call with keyword names (``Output(loss=...,
    logits=...)``) builds a structure whose keys are among the code's
    constants; a bare call returns something only the run knows.
    """
    previous: list[dis.Instruction] = []
    from_calls: set[str] = set()
    for instruction in dis.get_instructions(code):
        op = instruction.opname
        ops = [p.opname for p in previous]
        bare = bool(ops) and ops[-1] in _BARE_CALLS and "KW_NAMES" not in ops[:-1]
        if op == "STORE_FAST" and bare:
            from_calls.add(instruction.argval)
        if op == "RETURN_VALUE" and previous:
            local = ops[-1] in _LOAD_FAST and previous[-1].argval in from_calls
            if bare or local:
                return True
        if op not in _SKIPPED:
            previous = [*previous[-2:], instruction]
    return False


def _global_functions(function: FunctionType) -> dict[str, FunctionType]:
    """The plain Python functions ``function`` loads by global name."""
    namespace = function.__globals__
    found: dict[str, FunctionType] = {}
    for instruction in dis.get_instructions(function.__code__):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        name = instruction.argval
        value = namespace.get(name)
        if isinstance(value, FunctionType) and name not in found:
            inner = inspect.unwrap(value)
            if isinstance(inner, FunctionType):
                found[name] = inner
    return found


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
    open_return = _returns_a_call(code) and not annotated_keys
    return MethodInfo(name, code, arguments, local_names, frozenset(keys), open_return)


def _function_info(name: str, function: FunctionType) -> MethodInfo:
    return _analyse(name, function.__code__, _annotated_keys(function))


@cache
def _installed_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    roots.update(site.getsitepackages())
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _is_library_base(klass: type, cls: type) -> bool:
    """Whether ``klass``, a base of ``cls``, is an installed library's class from another module."""
    if klass is cls or klass.__module__ == cls.__module__:
        return False
    path = getattr(sys.modules.get(klass.__module__), "__file__", None)
    return path is not None and os.path.realpath(path).startswith(_installed_roots())


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
    they are not per-instance behaviour a tracer can patch.  A method
    inherited from an installed library's base class in another module is
    marked ``library`` (``forward`` never is).  Example::

        methods_of(MyBlock, torch.nn.Module)["forward"].locals
    """
    found: dict[str, MethodInfo] = {}
    for klass in cls.__mro__:
        if klass is object or (stop is not None and klass is stop):
            break
        for name, attr in vars(klass).items():
            if name in found or (name.startswith("__") and name.endswith("__")):
                continue
            if isinstance(attr, (classmethod, staticmethod)):
                continue
            if not isinstance(attr, FunctionType) and not hasattr(attr, "__wrapped__"):
                continue
            code = method_code(attr)
            if code is None or code.co_argcount == 0:
                continue
            function = inspect.unwrap(attr)
            info = _function_info(name, function)
            callees = tuple(_function_info(n, f) for n, f in _global_functions(function).items())
            library = name != "forward" and _is_library_base(klass, cls)
            found[name] = dataclasses.replace(info, library=library, callees=callees)
    return found
