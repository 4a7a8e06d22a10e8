"""Patching methods of individual objects, and capturing values from their calls.

A `Probe` says what to read from one method of one object: which
arguments at entry, which variables at return, which variables on every
line, and which parts of the return value, each as a `Selector`.
A `Hook` pairs a probe with the *sink* that receives the captured
leaves, plus optional enter/exit observers (a tracer counts iterations
with those).  `attach` installs a hook; the first hook on an
`(object, method)` pair replaces the bound method in the object's
`__dict__` with a `wrapt` wrapper, the last `detach` restores
exactly what was there.  Several hooks (several tracers) share one patch,
so tracers may start and stop in any order.

A program that rebuilds the method from the patched one's `__func__`
while traced (accelerate's mixed precision: ``model.forward =
MethodType(autocast(model.forward.__func__), model)``) keeps the capture:
that `__func__` is a function that runs the patch for the patched object.

Only the patched object is affected: other instances of the class run the
original method untouched.  Copies and pickles of a patched object
(`copy.deepcopy`, `pickle`, `torch.save`, EMA / SWA averaged models)
are of the object as it is untraced: while it is patched, its `__dict__`
also holds a `__getstate__` that leaves the patches out.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import wrapt

from vartrace.engine.arguments import ArgumentBinder
from vartrace.engine.frames import Callee, FrameCore, default_core
from vartrace.engine.paths import Pattern, States
from vartrace.engine.structures import is_leaf, leaf_types, select

__all__ = [
    "Hook",
    "Probe",
    "Selector",
    "Sink",
    "attach",
    "core",
    "detach",
    "filter_state",
    "set_core",
]

StateFilter = Callable[[dict[str, Any]], dict[str, Any]]
"""Takes a copy of an object's `__dict__` state, returns it without what a tracer added."""
Sink = Callable[[str, Any, bool], None]
"""`sink(site, leaf, grad)`: receives every captured leaf."""
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_MISSING = object()


@dataclass(frozen=True)
class Selector:
    """One variable (or the return value) of a method, and the pattern state that selected it.

    `site` is the concrete name of the selected object
    (`layers.0.attn.forward.scores`, or `encoder.1.forward` for a return
    value); `states` is the pattern's automaton state after that name, used
    to follow keys into the runtime value.  `callee` is the code of a
    function the method calls, when the variable is that function's
    (`forward>eager_attention_forward.attn_weights`).  `tag` is appended
    to every key (`@return` when one variable is read at two timings).
    `renamed` lists the keys of a returned value that are also names of
    arguments read at entry: that key gets `@return`, leaves below it keep their keys
    after it (`forward.cache` is the argument, `forward.cache@return` the output's
    field and `forward.cache@return.hidden_states` a leaf of it).
    """

    variable: str | None
    site: str
    pattern: Pattern
    states: States
    grad: bool = False
    callee: CodeType | None = None
    tag: str = ""
    renamed: frozenset[str] = frozenset()
    suffix: str = field(init=False, repr=False)
    whole: bool = field(init=False, repr=False)
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Computed once: what every call would otherwise recompute.
        object.__setattr__(self, "suffix", self.tag + ("@grad" if self.grad else ""))
        object.__setattr__(self, "key", self.site + self.suffix)  # the whole value's name
        object.__setattr__(self, "whole", self.pattern.accepts(self.states))

    def emit(self, value: Any, sink: Sink, seen: set[str] | None) -> None:
        """Send every selected leaf of `value` to `sink`, skipping names in `seen`.

        `seen` collects the names sent during one call, where two selectors
        of a probe may select the same leaf; `None` where they cannot.
        """
        # The common case: one leaf (a tensor), as it is.
        if self.whole and (type(value) in leaf_types or is_leaf(value)):
            name = self.key
            if seen is not None:
                if name in seen:
                    return
                seen.add(name)
            sink(name, value, self.grad)
            return
        for site, leaf in select(value, self.pattern, self.states, self.site):
            name = site + self.suffix
            if self.renamed:
                key, dot, below = site[len(self.site) + 1 :].partition(".")
                if key in self.renamed:
                    name = f"{self.site}.{key}@return{dot}{below}{self.suffix}"
            if seen is not None:
                if name in seen:
                    continue
                seen.add(name)
            sink(name, leaf, self.grad)


def _at_return_only(probe: Probe) -> bool:
    """Whether `probe` reads only locals at return, none twice (`_Patch._call`'s short path)."""
    return bool(probe.exit) and not (
        probe.entry or probe.every or probe.returns or probe.calls or probe.dedupe
    )


def _overlap(selectors: tuple[Selector, ...]) -> bool:
    """Whether two selectors may name one leaf (one site, or one below the other)."""
    sites = sorted(s.site for s in selectors)
    return any(b == a or b.startswith(f"{a}.") for i, a in enumerate(sites) for b in sites[i + 1 :])


@dataclass(frozen=True)
class Probe:
    """What to capture from one method of one object."""

    entry: tuple[Selector, ...] = ()
    exit: tuple[Selector, ...] = ()
    every: tuple[Selector, ...] = ()
    returns: tuple[Selector, ...] = ()
    calls: tuple[Selector, ...] = ()
    frame_names: tuple[str, ...] = field(init=False)
    every_names: tuple[str, ...] = field(init=False)
    dedupe: bool = field(init=False)

    def __post_init__(self) -> None:
        names = {s.variable for s in self.exit} | {s.variable for s in self.every}
        object.__setattr__(self, "frame_names", tuple(sorted(n for n in names if n)))
        every = {s.variable for s in self.every}
        object.__setattr__(self, "every_names", tuple(sorted(n for n in every if n)))
        read_once = (*self.entry, *self.exit, *self.returns)
        dedupe = bool(self.every) or _overlap(read_once) or _overlap(self.calls)
        object.__setattr__(self, "dedupe", dedupe)

    def callee_names(self) -> dict[CodeType, tuple[set[str], set[str]]]:
        """Per callee code, the variables to read at return and those read `@every`."""
        names: dict[CodeType, tuple[set[str], set[str]]] = {}
        for selector in self.calls:
            at_return, every = names.setdefault(selector.callee, (set(), set()))  # type: ignore[arg-type]
            if selector.variable is not None:
                (every if selector.pattern.when == "every" else at_return).add(selector.variable)
        return names

    def __bool__(self) -> bool:
        return bool(self.entry or self.exit or self.every or self.returns or self.calls)


class Hook:
    """A subscriber to one patched method.

    `enabled` may be flipped at any time (a tracer turns capture off
    between traced iterations); `on_enter()` runs before every call whether
    enabled or not, and `on_exit(failed)` after each call for which it
    returned true (a tracer counts outermost calls only); `calls` counts the
    calls.
    """

    __slots__ = ("calls", "captures", "enabled", "on_enter", "on_exit", "probe", "sink")

    def __init__(
        self,
        probe: Probe,
        sink: Sink,
        on_enter: Callable[[], bool] | None = None,
        on_exit: Callable[[bool], None] | None = None,
    ) -> None:
        self.probe = probe
        self.captures = bool(probe)
        self.sink = sink
        self.on_enter = on_enter
        self.on_exit = on_exit
        self.enabled = True
        self.calls = 0


class _Wrapper(wrapt.FunctionWrapper):
    """A patched method; a copy or pickle of it is of the untraced method (of the copy).

    Reached only for objects whose own `__reduce__` copies their `__dict__` as it
    is; `_CleanState` keeps the wrapper out of every other copy.
    """

    _self_function: Callable[..., Any] | None = None  # see _Patch._rebindable

    def __copy__(self) -> Any:
        return self.__wrapped__

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__wrapped__.__reduce_ex__(protocol)

    @property
    def __func__(self) -> Any:
        """A function that captures for the patched object (see `_Patch._rebindable`)."""
        function = self._self_function
        return self.__wrapped__.__func__ if function is None else function  # type: ignore[attr-defined]


class _CleanState:
    """The `__getstate__` of a patched object: its state as it is untraced.

    `copy`, `pickle` and `torch.save` look `__getstate__` up on the
    object, so this one (in the object's `__dict__`) takes the place of the
    class's, which it calls, and drops the patches from what that returns.
    """

    __slots__ = ("filters", "instance", "originals", "previous")

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.previous = vars(instance).get("__getstate__", _MISSING)
        self.originals: dict[str, Any] = {}  # patched name -> what the __dict__ held before
        self.filters: dict[object, StateFilter] = {}  # see filter_state

    @classmethod
    def of(cls, instance: Any) -> _CleanState:
        """The object's clean state, installed on first use."""
        found = vars(instance).get("__getstate__")
        if not isinstance(found, _CleanState):
            found = vars(instance)["__getstate__"] = cls(instance)
        return found

    def forget(self, name: str) -> None:
        """`name` is restored; the last one out restores the `__getstate__` entry too."""
        del self.originals[name]
        self.release()

    def release(self) -> None:
        """Restore the `__getstate__` entry once no patch and no filter is left.

        An entry the program put in its place meanwhile stays.
        """
        if (
            not self.originals
            and not self.filters
            and vars(self.instance).get("__getstate__") is self
        ):
            if self.previous is _MISSING:
                del vars(self.instance)["__getstate__"]
            else:
                vars(self.instance)["__getstate__"] = self.previous

    def __call__(self) -> Any:
        instance = self.instance
        if self.previous is not _MISSING:
            state = self.previous()
        else:  # the class's (object's since Python 3.11), else the plain __dict__
            getstate = getattr(type(instance), "__getstate__", None)
            state = vars(instance) if getstate is None else getstate(instance)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            return self._clean(state[0]), state[1]  # (__dict__, slots)
        return self._clean(state) if isinstance(state, dict) else state

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Copied with an object whose own reduction copies its __dict__ as it is: the
        # copy's entry knows no patches, so it only leaves itself out of further copies.
        return _CleanState, (self.instance,)

    def _clean(self, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        for name, original in [*self.originals.items(), ("__getstate__", self.previous)]:
            if not isinstance(state.get(name), (_Wrapper, _CleanState)):
                continue  # the program's own value, set while traced
            if original is _MISSING:
                state.pop(name, None)
            else:
                state[name] = original
        for state_filter in self.filters.values():
            state = state_filter(state)
        return state


class _Patch:
    """The wrapper installed on one `(object, method)` pair."""

    def __init__(
        self, instance: Any, name: str, code: CodeType, decorate: Decorator | None
    ) -> None:
        self.instance = instance
        self.name = name
        self.code = code
        self.hooks: tuple[Hook, ...] = ()
        self.at_return: Hook | None = None  # the one hook, when it reads locals at return only
        self.original = vars(instance).get(name, _MISSING)
        bound = getattr(instance, name)
        self.binder = ArgumentBinder(bound, f"{type(instance).__name__}.{name}")
        self.frame_names: tuple[str, ...] = ()
        self.every_names: tuple[str, ...] = ()
        self.callees: dict[CodeType, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self.armed: tuple[bool, bool] = (False, False)
        # The callee handlers for one set of active hooks (normally all of them, every call).
        self._callee_handlers: tuple[tuple[Hook, ...], dict[CodeType, Callee]] = ((), {})
        call = self._call if decorate is None else decorate(self._call)
        self.clean = _CleanState.of(instance)
        self.clean.originals[name] = self.original
        self.wrapper = vars(instance)[name] = _Wrapper(bound, call)
        self.wrapper._self_function = self._rebindable(bound, call)

    def _rebindable(self, bound: Any, call: Callable[..., Any]) -> Callable[..., Any] | None:
        """The patched method's `__func__`: the method's function, capturing when called
        with the patched object while it is patched.

        A program that rebuilds the method from it (accelerate's mixed precision:
        `MethodType(autocast(model.forward.__func__), model)`) keeps the capture.  Its
        signature is the function's; it has no `__wrapped__`, so that unwrapping such a
        rebuilt method (accelerate's `unwrap_model`) stops at it.  `None` where
        the method is not a bound method of the object.
        """
        function = getattr(bound, "__func__", None)
        if getattr(bound, "__self__", None) is not self.instance or not callable(function):
            return None
        instance = self.instance

        def traced(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if owner is not instance or not self.hooks:
                return function(owner, *args, **kwargs)
            return call(bound, instance, args, kwargs)

        functools.update_wrapper(traced, function)
        del traced.__wrapped__  # type: ignore[attr-defined]
        with contextlib.suppress(TypeError, ValueError):  # else (owner, *args, **kwargs)
            traced.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
        return traced

    def set_hooks(self, hooks: tuple[Hook, ...]) -> None:
        self.hooks = hooks
        frame: set[str] = set()
        every: set[str] = set()
        callees: dict[CodeType, tuple[set[str], set[str]]] = {}
        for hook in hooks:
            frame.update(hook.probe.frame_names)
            every.update(hook.probe.every_names)
            for code, (at_return, lines) in hook.probe.callee_names().items():
                names = callees.setdefault(code, (set(), set()))
                names[0].update(at_return)
                names[1].update(lines)
        self.frame_names = tuple(sorted(frame))
        self.every_names = tuple(sorted(every))
        wanted = {code: (tuple(sorted(a)), tuple(sorted(b))) for code, (a, b) in callees.items()}
        for code, (_, wanted_lines) in wanted.items():
            if self.callees.get(code, (None, None))[1] != wanted_lines:
                _core.arm(code, bool(wanted_lines), callee=True)
        for code, (_, armed_lines) in self.callees.items():
            if wanted.get(code, (None, None))[1] != armed_lines:
                _core.disarm(code, bool(armed_lines), callee=True)
        self.callees = wanted
        self._callee_handlers = ((), {})
        self.at_return = hooks[0] if len(hooks) == 1 and _at_return_only(hooks[0].probe) else None
        armed = (bool(frame), bool(every))
        if armed != self.armed:
            if armed[0]:
                _core.arm(self.code, armed[1])
            if self.armed[0]:
                _core.disarm(self.code, self.armed[1])
            self.armed = armed

    def restore(self) -> None:
        """Put back what the object held, unless the program replaced the patch meanwhile.

        A `forward` the program installs while traced
        (`block.forward = MethodType(f, block)`) is the program's: it stays.
        """
        self.set_hooks(())
        namespace = vars(self.instance)
        if namespace.get(self.name) is self.wrapper:
            if self.original is _MISSING:
                del namespace[self.name]
            else:
                namespace[self.name] = self.original
        self.clean.forget(self.name)

    def _call(self, wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        hook = self.at_return
        if hook is not None:
            # The common case, decided at `set_hooks`: one hook, locals read at return.
            hook.calls += 1
            if hook.on_enter is None or not hook.on_enter():
                if not (hook.enabled and hook.captures):
                    return wrapped(*args, **kwargs)
                run = _core.run_plain
                answer = run and run(self.code, self.frame_names, wrapped, args, kwargs)
                result, snapshot = answer or _core.run(
                    self.code, self.frame_names, (), None, wrapped, args, kwargs
                )
                if snapshot:
                    for selector in hook.probe.exit:
                        value = snapshot.get(selector.variable, _MISSING)  # type: ignore[arg-type]
                        if value is _MISSING:
                            continue
                        # Selector.emit's common case (its subclasses emit otherwise).
                        plain = type(selector) is Selector and selector.whole
                        if plain and type(value) in leaf_types:
                            hook.sink(selector.key, value, selector.grad)
                        else:
                            selector.emit(value, hook.sink, None)
                return result
            one: list[tuple[Hook, set[str] | None]] = (
                [(hook, None)] if hook.enabled and hook.captures else []
            )
            return self._leaving([hook], one, wrapped, args, kwargs)
        # Plain loops, no comprehension: each is a function call of its own before 3.12.
        hooks = self.hooks
        leaving: list[Hook] = []
        for hook in hooks:
            hook.calls += 1
            if hook.on_enter is not None and hook.on_enter():
                leaving.append(hook)
        active: list[tuple[Hook, set[str] | None]] = []
        for hook in hooks:  # once every on_enter ran: one may have enabled the hooks
            if hook.enabled and hook.captures:
                active.append((hook, set() if hook.probe.dedupe else None))
        if not leaving:  # the common case: no hook ends a call here
            return (
                self._capture(active, wrapped, args, kwargs) if active else wrapped(*args, **kwargs)
            )
        return self._leaving(leaving, active, wrapped, args, kwargs)

    def _leaving(
        self,
        leaving: list[Hook],
        active: list[tuple[Hook, set[str] | None]],
        wrapped: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call that `leaving` hooks' `on_enter` began: their `on_exit` follows it."""
        failed = True
        try:
            result = (
                self._capture(active, wrapped, args, kwargs) if active else wrapped(*args, **kwargs)
            )
            failed = False
            return result
        finally:
            for hook in reversed(leaving):
                if hook.on_exit is not None:
                    hook.on_exit(failed)

    def _capture(
        self,
        active: list[tuple[Hook, set[str] | None]],
        wrapped: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Call `wrapped`, sending what each active hook's probe reads to its sink; each
        hook comes with the set of the names sent to it during this call (see `emit`)."""
        arguments: dict[str, Any] | None = None
        for hook, hook_seen in active:
            for selector in hook.probe.entry:
                if selector.variable == "self":
                    selector.emit(self.instance, hook.sink, hook_seen)
                    continue
                if arguments is None:
                    arguments = self.binder.bind(args, kwargs)
                if selector.variable in arguments:
                    selector.emit(arguments[selector.variable], hook.sink, hook_seen)

        if not self.frame_names and not self.callees:
            result = wrapped(*args, **kwargs)
            snapshot: dict[str, Any] = {}
        else:
            on_line = None
            if self.every_names:

                def on_line(variable: str, value: Any) -> None:
                    for hook, hook_seen in active:
                        for selector in hook.probe.every:
                            if selector.variable == variable:
                                hook_seen.clear()  # type: ignore[union-attr]
                                selector.emit(value, hook.sink, hook_seen)

            result, snap = _core.run(
                self.code,
                self.frame_names,
                self.every_names,
                on_line,
                wrapped,
                args,
                kwargs,
                self._callees([hook for hook, _ in active]) if self.callees else None,
            )
            snapshot = snap or {}

        for hook, hook_seen in active:
            for selector in hook.probe.exit:
                value = snapshot.get(selector.variable, _MISSING)  # type: ignore[arg-type]
                if value is not _MISSING:
                    selector.emit(value, hook.sink, hook_seen)
            for selector in hook.probe.returns:
                selector.emit(result, hook.sink, hook_seen)
        return result

    def _callees(self, active: list[Hook]) -> dict[CodeType, Callee]:
        """What to do with each callee's frames during one call, for the `active` hooks."""
        key = tuple(active)
        built, callees = self._callee_handlers
        if built == key:
            return callees
        callees = {}
        for code, (names, every) in self.callees.items():
            on_line = _as_line(_call_emitter(active, code, True)) if every else None
            callees[code] = Callee(names, every, _call_emitter(active, code, False), on_line)
        self._callee_handlers = (key, callees)
        return callees


def _call_emitter(
    active: list[Hook], code: CodeType, every: bool
) -> Callable[[dict[str, Any], Any], None]:
    """Emit the callee variables (or, for `every`, the rebound ones) to each active hook."""

    def emit(variables: dict[str, Any], value: Any) -> None:
        for hook in active:
            seen: set[str] | None = set() if hook.probe.dedupe else None
            for selector in hook.probe.calls:
                if selector.callee is not code or (selector.pattern.when == "every") != every:
                    continue
                if selector.variable is None:
                    selector.emit(value, hook.sink, seen)
                elif selector.variable in variables:
                    selector.emit(variables[selector.variable], hook.sink, seen)

    return emit


def _as_line(emit: Callable[[dict[str, Any], Any], None]) -> Callable[[str, Any], None]:
    return lambda name, value: emit({name: value}, None)


_core: FrameCore = default_core()
_patches: dict[tuple[int, str], _Patch] = {}


def core() -> FrameCore:
    """The frame-capture core in use."""
    return _core


def set_core(new: FrameCore) -> None:
    """Choose the frame-capture core (only while nothing is attached).

    Example:
        ```python
        from vartrace.engine.frames import SettraceCore
        set_core(SettraceCore())   # compare the cores on Python >= 3.12
        ```
    """
    global _core
    if _patches:
        raise RuntimeError("cannot change the frame core while methods are patched")
    _core = new


def filter_state(instance: Any, key: object, state_filter: StateFilter | None) -> None:
    """Pass copies and pickles of `instance`'s state through `state_filter`.

    `key` names the filter; `None` removes the one `key` added.  A tracer
    uses it to leave the hooks it registered on a module out of the module's
    copies.  Example:

    ```python
    filter_state(module, tracer, lambda state: {k: v for k, v in state.items() if k != "x"})
    filter_state(module, tracer, None)
    ```
    """
    if state_filter is not None:
        _CleanState.of(instance).filters[key] = state_filter
        return
    clean = vars(instance).get("__getstate__")
    if isinstance(clean, _CleanState) and clean.filters.pop(key, None) is not None:
        clean.release()


def attach(
    instance: Any, name: str, code: CodeType, hook: Hook, decorate: Decorator | None = None
) -> None:
    """Subscribe `hook` to calls of `instance.<name>` (whose frames run `code`).

    `decorate`, applied to the wrapper when the patch is first installed,
    lets a caller keep it out of a JIT (`torch._dynamo.disable`).
    """
    key = (id(instance), name)
    patch = _patches.get(key)
    if patch is None:
        if not hasattr(instance, "__dict__"):
            raise TypeError(
                f"cannot trace {type(instance).__name__}.{name}: the object has no __dict__"
            )
        patch = _patches[key] = _Patch(instance, name, code, decorate)
    patch.set_hooks((*patch.hooks, hook))


def detach(instance: Any, name: str, hook: Hook) -> None:
    """Unsubscribe `hook`; the last one out restores the original method."""
    key = (id(instance), name)
    patch = _patches.get(key)
    if patch is None or hook not in patch.hooks:
        return
    remaining = tuple(h for h in patch.hooks if h is not hook)
    if remaining:
        patch.set_hooks(remaining)
    else:
        patch.restore()
        del _patches[key]
