"""Static facts about methods, read from classes and code objects.

Everything a pattern can name below a module — its methods, their
arguments and locals, the keys their return values may have — is known
before the first step from the class and each method's code object.  This
lets a tracer validate patterns and suggest near misses up front.  Where a
method returns another call's result (`return self.proj(h)`), its source
says which call (`returned_calls`), for the torch side to follow.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import dis
import inspect
import os
import site
import sys
import sysconfig
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from types import CodeType, FunctionType, ModuleType

__all__ = [
    "MethodInfo",
    "Returned",
    "function_info",
    "methods_of",
    "returned_calls",
    "runs_later",
    "source_lines",
]

CALLEE_SEPARATOR = ">"
"""Joins a method and a function it calls into one site segment: `forward>attention`."""


@dataclass(frozen=True)
class MethodInfo:
    """What the engine knows about one method of a class.

    Attributes:
        name: the attribute name on the class (`forward`, `_attention`).
        code: the code object whose frames are captured (decorators unwrapped).
        arguments: parameter names in order, `self` first.
        locals: every other local variable name (including closure cells).
        return_keys: keys a returned structure is likely to have: string
            constants of the code (`"logits"` in `return {"logits": ...}`),
            small indices, and the fields of a dataclass / namedtuple return
            annotation.  Used to decide statically which methods a key
            pattern may concern.
        annotated: a return annotation names the fields of what the method
            returns (a dataclass, a namedtuple): `return_keys` are its keys.
            Otherwise keys of a value the method returns from a call
            (`return self.proj(h)`) are those of the callee's result:
            `returned_calls` says which calls.
        library: the method comes from a base class of an installed
            library (`PreTrainedModel.from_pretrained` machinery): wildcards
            skip it, a literal name still reaches it.
        callees: the plain functions the method calls by global name
            (`eager_attention_forward`), each analysed like a method.
    """

    name: str
    code: CodeType
    arguments: tuple[str, ...]
    locals: tuple[str, ...]
    return_keys: frozenset[str]
    annotated: bool = False
    library: bool = False
    callees: tuple[MethodInfo, ...] = field(default=(), compare=False)
    function: FunctionType | None = field(default=None, compare=False, repr=False)

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
    """Whether some `return` returns a call's result made without keyword names.

    Either directly (`return self.model(*args, **kwargs)`) or through a
    local stored straight from such a call (`out = self.model(**batch)`
    ... `return out`).  A call with keyword names (``Output(loss=...,
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
    """The plain Python functions `function` loads by global name."""
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
    cells = tuple(c for c in code.co_cellvars if c not in arguments)
    # Names that are not identifiers (pytest's ``@py_assert0``) are no pattern's to name.
    local_names = tuple(n for n in code.co_varnames[n_args:] + cells if n.isidentifier())
    keys = _string_constants(code) | {str(i) for i in range(8)} | annotated_keys
    return MethodInfo(name, code, arguments, local_names, frozenset(keys), bool(annotated_keys))


def _function_info(name: str, function: FunctionType) -> MethodInfo:
    info = _analyse(name, function.__code__, _annotated_keys(function))
    return dataclasses.replace(info, function=function)


@cache
def function_info(function: FunctionType) -> MethodInfo:
    """What the engine knows about a plain function (a callee followed into)."""
    return _function_info(function.__name__, function)


@dataclass(frozen=True)
class Returned:
    """One call whose result a method returns, as the method's code spells the callee.

    `kind` says where the callee's name starts:

    * `"self"`: an attribute chain of the method's object (`self.proj`,
      `self.model.forward`); `names` is the chain;
    * `"super"`: `super().<name>`; `names` is `(name,)`;
    * `"loop"`: a local bound by `for layer in self.layers` (or ``in
      self`) and called; `names` is the chain iterated (`("layers",)``);
    * `"value"`: a method called on another local value (`x.softmax`);
      `names` is `(method,)`;
    * `"global"`: a name of the function's globals or builtins, through
      modules (`F.linear`); `target` is the object it names, `keywords`
      whether the call passes keyword names only (`dict(loss=...)`);
    * `"unknown"`: anything else (a call's result called, a local function).
    """

    kind: str
    names: tuple[str, ...] = ()
    target: object = field(default=None, compare=False)
    keywords: bool = False


_MISSING = object()
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _syntax(function: FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of `function`, or `None` when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _own_nodes(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, leaving out functions and classes defined in it."""
    stack: list[ast.AST] = list(node.body)
    while stack:
        current = stack.pop()
        yield current
        stack.extend(c for c in ast.iter_child_nodes(current) if not isinstance(c, _NESTED))


class _Returns:
    """Reads which calls' results a function returns from its syntax tree."""

    def __init__(
        self, function: FunctionType, node: ast.FunctionDef | ast.AsyncFunctionDef
    ) -> None:
        self.function = function
        code = function.__code__
        self.self_name = code.co_varnames[0] if code.co_argcount else None
        self.locals = {*code.co_varnames, *code.co_cellvars, *code.co_freevars}
        self.returns: list[ast.expr] = []
        self.stored: dict[str, list[ast.Call]] = {}  # local -> calls stored straight into it
        self.loops: dict[str, ast.expr] = {}  # local -> what a for loop binds it from
        for current in _own_nodes(node):
            if isinstance(current, ast.Return) and current.value is not None:
                self.returns.append(current.value)
            elif isinstance(current, (ast.Assign, ast.AnnAssign)) and isinstance(
                current.value, ast.Call
            ):
                targets = current.targets if isinstance(current, ast.Assign) else [current.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.stored.setdefault(target.id, []).append(current.value)
            elif isinstance(current, (ast.For, ast.AsyncFor)):
                self._bind_loop(current.target, current.iter)

    def _bind_loop(self, target: ast.expr, iterated: ast.expr) -> None:
        if (  # for i, layer in enumerate(self.layers)
            isinstance(target, ast.Tuple)
            and len(target.elts) == 2
            and isinstance(iterated, ast.Call)
            and isinstance(iterated.func, ast.Name)
            and iterated.func.id == "enumerate"
            and iterated.args
        ):
            target, iterated = target.elts[1], iterated.args[0]
        if isinstance(target, ast.Name):
            self.loops[target.id] = iterated

    def calls(self) -> tuple[Returned, ...]:
        found: dict[Returned, None] = {}
        for value in self.returns:
            for call in self._calls_in(value):
                found.setdefault(self._classify(call))
        return tuple(found)

    def _calls_in(self, expr: ast.expr) -> Iterator[ast.Call]:
        if isinstance(expr, ast.Call):
            yield expr
        elif isinstance(expr, ast.IfExp):
            yield from self._calls_in(expr.body)
            yield from self._calls_in(expr.orelse)
        elif isinstance(expr, ast.Name):
            yield from self.stored.get(expr.id, ())

    def _self_chain(self, expr: ast.expr) -> tuple[str, ...] | None:
        """`("layers",)` for `self.layers` (or a slice of it), `()` for `self`."""
        if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice):
            expr = expr.value
        chain: list[str] = []
        while isinstance(expr, ast.Attribute):
            chain.append(expr.attr)
            expr = expr.value
        if isinstance(expr, ast.Name) and expr.id == self.self_name:
            return tuple(reversed(chain))
        return None

    def _classify(self, call: ast.Call) -> Returned:
        func = call.func
        chain: list[str] = []
        while isinstance(func, ast.Attribute):
            chain.append(func.attr)
            func = func.value
        chain.reverse()
        if (
            isinstance(func, ast.Call)
            and isinstance(func.func, ast.Name)
            and func.func.id == "super"
            and len(chain) == 1
        ):
            return Returned("super", tuple(chain))
        if not isinstance(func, ast.Name):
            return Returned("unknown")
        name = func.id
        if name == self.self_name:
            return Returned("self", tuple(chain))
        if name in self.locals:
            iterated = self.loops.get(name)
            loop = None if chain or iterated is None else self._self_chain(iterated)
            if loop is not None:
                return Returned("loop", loop)
            return Returned("value", tuple(chain)) if len(chain) == 1 else Returned("unknown")
        target = self._global(name, chain)
        if target is _MISSING:
            return Returned("unknown")
        keywords = bool(call.keywords) and not call.args and all(k.arg for k in call.keywords)
        return Returned("global", (name, *chain), target, keywords)

    def _global(self, name: str, chain: list[str]) -> object:
        """The object a global name and an attribute chain through modules name."""
        namespace = self.function.__globals__
        value = namespace[name] if name in namespace else getattr(builtins, name, _MISSING)
        for attr in chain:
            if not isinstance(value, ModuleType):
                return _MISSING
            value = getattr(value, attr, _MISSING)
        if isinstance(value, FunctionType):
            value = inspect.unwrap(value)
        return value


@cache
def returned_calls(function: FunctionType) -> tuple[Returned, ...]:
    """The calls whose results `function` returns: directly, through a conditional
    expression, or through a local stored straight from one (`out = self.model(**b)`).

    Read from the source; where it cannot be read, a call seen in the bytecode
    is an `"unknown"` one.  Example:

    ```python
    returned_calls(Block.forward)   # (Returned("self", ("proj",)),)
    ```
    """
    node = _syntax(function)
    if node is None:
        return (Returned("unknown"),) if _returns_a_call(function.__code__) else ()
    return _Returns(function, node).calls()


@cache
def _installed_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    roots.update(site.getsitepackages())
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _is_library_base(klass: type, cls: type) -> bool:
    """Whether `klass`, a base of `cls`, is an installed library's class from another module."""
    if klass is cls or klass.__module__ == cls.__module__:
        return False
    path = getattr(sys.modules.get(klass.__module__), "__file__", None)
    return path is not None and os.path.realpath(path).startswith(_installed_roots())


_RUNS_LATER = (
    (inspect.CO_ASYNC_GENERATOR, "an async generator"),
    (inspect.CO_COROUTINE, "a coroutine (async def)"),
    (inspect.CO_GENERATOR, "a generator"),
)


def runs_later(code: CodeType) -> str | None:
    """What `code` is when a call of it returns before its body runs, else `None`.

    A generator or `async def` function returns a generator (coroutine)
    object at once; its body runs when that is iterated (awaited), after the
    call a tracer brackets has returned, so no local of it can be read at
    that return.  Example:

    ```python
    runs_later(Model.stream.__code__)   # 'a generator'
    ```
    """
    for flag, kind in _RUNS_LATER:
        if code.co_flags & flag:
            return kind
    return None


def source_lines(code: CodeType) -> frozenset[int]:
    """The source lines that can bind a value in a frame of `code` (`@every:L<line>`).

    The lines its instructions run on, and its first line (`co_firstlineno`,
    where its arguments are bound); not those of the functions defined in it.
    Example:

    ```python
    73 in source_lines(Attention.forward.__code__)   # line 73 runs code of forward
    ```
    """
    lines = {line for _, _, line in code.co_lines() if line is not None}
    lines.add(code.co_firstlineno)
    return frozenset(lines)


def method_code(function: object) -> CodeType | None:
    """The code object a method's frames run, looking through decorators."""
    try:
        inner = inspect.unwrap(function)  # type: ignore[arg-type]
    except ValueError:
        return None
    return inner.__code__ if isinstance(inner, FunctionType) else None


@cache
def methods_of(cls: type, stop: type | None = None) -> dict[str, MethodInfo]:
    """The plain methods defined on `cls` and its bases, up to (excluding) `stop`.

    Dunder methods, static and class methods and properties are left out:
    they are not per-instance behaviour a tracer can patch.  A method
    inherited from an installed library's base class in another module is
    marked `library` (`forward` never is).  Example:

    ```python
    methods_of(MyBlock, torch.nn.Module)["forward"].locals
    ```
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
