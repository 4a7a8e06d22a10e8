"""Patching methods of single objects and capturing their values, under every core."""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from vartrace.engine import Hook, Probe, Selector, attach, detach, frames, methods_of, parse
from vartrace.engine.frames import FrameCore


def _logged(function: Any) -> Any:
    """A decorator adding a Python frame between the caller and the method."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        return result

    return wrapper


class Calc:
    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def run(self, x: int, y: int = 2, *rest: int, scale: int = 1, **extra: int) -> tuple:
        total = (x + y + sum(rest) + self.offset) * scale
        parts = {"total": total, "rest": list(rest)}
        total = total + 1
        return total, parts

    def loop(self, n: int) -> int:
        acc = 0
        for i in range(n):
            acc = acc + i
        return acc

    def grow(self, n: int) -> int:
        items: list[int] = []
        for i in range(n):
            items.append(i)
        return len(items)

    def fact(self, n: int) -> int:
        result = 1 if n <= 1 else n * self.fact(n - 1)
        return result

    def boom(self, x: int) -> int:
        local = x * 2
        raise KeyError(local)

    @_logged
    def cached(self, x: int) -> int:
        doubled = x * 2
        return doubled


def _probe(method: str, *specs: str) -> Probe:
    """Build a probe from 'variable:timing' specs; variable '' is the return value."""
    groups: dict[str, list[Selector]] = {"entry": [], "exit": [], "every": [], "returns": []}
    for spec in specs:
        variable, timing = spec.split(":")
        text = f"{method}.{variable}" if variable else method
        pattern = parse(text)
        states = pattern.step(pattern.start, method)
        if variable:
            states = pattern.step(states, variable)
        groups[timing].append(Selector(variable or None, text, pattern, states))
    return Probe(**{k: tuple(v) for k, v in groups.items()})


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []

    def __call__(self, site: str, value: Any, grad: bool) -> None:
        self.records.append((site, value))

    def sites(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for site, value in self.records:
            out.setdefault(site, []).append(value)
        return out


def _attach(obj: Any, method: str, probe: Probe, **hooks: Any) -> tuple[Hook, Recorder]:
    recorder = Recorder()
    hook = Hook(probe, recorder, **hooks)
    attach(obj, method, methods_of(type(obj))[method].code, hook)
    return hook, recorder


def test_entry_exit_and_return(core: FrameCore) -> None:
    calc = Calc(offset=10)
    probe = _probe(
        "run", "x:entry", "y:entry", "scale:entry", "total:exit", "parts:exit", ":returns"
    )
    hook, rec = _attach(calc, "run", probe)
    try:
        assert calc.run(1, 2, 3, scale=2) == (33, {"total": 32, "rest": [3]})
    finally:
        detach(calc, "run", hook)
    assert rec.sites() == {
        "run.x": [1],
        "run.y": [2],
        "run.scale": [2],
        "run.total": [33],
        "run.parts.total": [32],
        "run.parts.rest.0": [3],
        "run.0": [33],
        "run.1.total": [32],
        "run.1.rest.0": [3],
    }


def test_defaults_varargs_and_kwargs_are_bound(core: FrameCore) -> None:
    calc = Calc()
    probe = _probe("run", "y:entry", "rest:entry", "extra:entry")
    hook, rec = _attach(calc, "run", probe)
    calc.run(1)
    calc.run(1, 5, 6, 7, flag=1)
    detach(calc, "run", hook)
    assert rec.sites() == {
        "run.y": [2, 5],
        "run.rest.0": [6],
        "run.rest.1": [7],
        "run.extra.flag": [1],
    }


def test_every_records_each_new_value(core: FrameCore) -> None:
    calc = Calc()
    hook, rec = _attach(calc, "loop", _probe("loop", "acc:every", "i:every"))
    calc.loop(4)
    detach(calc, "loop", hook)
    sites = rec.sites()
    assert sites["loop.acc"] == [0, 1, 3, 6]
    assert sites["loop.i"] == [0, 1, 2, 3]


@pytest.fixture
def content_change_test() -> Iterator[None]:
    """``@every`` compares contents (as the torch edge sets it), restored afterwards."""
    previous = frames.set_change_test(
        copy.deepcopy, lambda old, new: type(old) is type(new) and old == new
    )
    yield
    frames.set_change_test(*previous)


def test_every_sees_in_place_changes_with_a_content_change_test(
    core: FrameCore, content_change_test: None
) -> None:
    calc = Calc()
    hook, rec = _attach(calc, "grow", _probe("grow", "items:every"))
    assert calc.grow(3) == 3
    detach(calc, "grow", hook)
    assert rec.sites() == {"grow.items.0": [0, 0, 0], "grow.items.1": [1, 1], "grow.items.2": [2]}


def test_only_the_patched_instance_is_traced(core: FrameCore) -> None:
    traced, other = Calc(), Calc(offset=100)
    hook, rec = _attach(traced, "run", _probe("run", "total:exit"))
    other.run(1)
    traced.run(1)
    other.run(2)
    detach(traced, "run", hook)
    assert rec.sites() == {"run.total": [4]}
    assert "run" not in vars(other)


def test_recursion_records_each_call(core: FrameCore) -> None:
    calc = Calc()
    hook, rec = _attach(calc, "fact", _probe("fact", "n:entry", "result:exit"))
    assert calc.fact(4) == 24
    detach(calc, "fact", hook)
    sites = rec.sites()
    assert sites["fact.n"] == [4, 3, 2, 1]
    assert sites["fact.result"] == [1, 2, 6, 24]


def test_decorated_method_frames_are_found(core: FrameCore) -> None:
    calc = Calc()
    hook, rec = _attach(calc, "cached", _probe("cached", "doubled:exit"))
    assert calc.cached(21) == 42
    detach(calc, "cached", hook)
    assert rec.sites() == {"cached.doubled": [42]}


def test_exception_propagates_unchanged_and_records_no_exit(core: FrameCore) -> None:
    calc = Calc()
    exits: list[bool] = []
    probe = _probe("boom", "x:entry", "local:exit")
    hook, rec = _attach(calc, "boom", probe, on_enter=lambda: True, on_exit=exits.append)
    with pytest.raises(KeyError) as error:
        calc.boom(3)
    detach(calc, "boom", hook)
    assert error.value.args == (6,)
    assert rec.sites() == {"boom.x": [3]}
    assert exits == [True]


def test_restores_exactly(core: FrameCore) -> None:
    calc = Calc()
    marker = calc.loop
    vars(calc)["loop"] = marker  # an instance attribute that was there before
    hook, _ = _attach(calc, "loop", _probe("loop", "acc:exit"))
    assert vars(calc)["loop"] is not marker
    detach(calc, "loop", hook)
    assert vars(calc)["loop"] is marker
    plain = Calc()
    hook, _ = _attach(plain, "loop", _probe("loop", "acc:exit"))
    detach(plain, "loop", hook)
    assert "loop" not in vars(plain)


def test_two_hooks_stop_in_any_order(core: FrameCore) -> None:
    calc = Calc()
    first, rec1 = _attach(calc, "loop", _probe("loop", "acc:exit"))
    second, rec2 = _attach(calc, "loop", _probe("loop", "n:entry"))
    calc.loop(3)
    detach(calc, "loop", first)
    calc.loop(5)
    detach(calc, "loop", second)
    calc.loop(7)
    assert rec1.sites() == {"loop.acc": [3]}
    assert rec2.sites() == {"loop.n": [3, 5]}
    assert "loop" not in vars(calc)


def test_disabled_hook_records_nothing_but_observes(core: FrameCore) -> None:
    calc = Calc()
    calls: list[str] = []
    hook, rec = _attach(
        calc,
        "loop",
        _probe("loop", "acc:exit"),
        on_enter=lambda: calls.append("enter") or len(calls) < 3,  # no exit for the 2nd call
        on_exit=lambda failed: calls.append(f"exit:{failed}"),
    )
    hook.enabled = False
    calc.loop(3)
    hook.enabled = True
    calc.loop(3)
    detach(calc, "loop", hook)
    assert rec.sites() == {"loop.acc": [3]}
    assert calls == ["enter", "exit:False", "enter"]


def test_threads_are_traced_independently(core: FrameCore) -> None:
    calcs = [Calc(offset=i) for i in range(4)]
    recorders = []
    hooks = []
    for calc in calcs:
        hook, rec = _attach(calc, "run", _probe("run", "total:exit"))
        hooks.append(hook)
        recorders.append(rec)

    def work(calc: Calc) -> None:
        for _ in range(50):
            calc.run(1)

    threads = [threading.Thread(target=work, args=(c,)) for c in calcs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for calc, hook in zip(calcs, hooks, strict=True):
        detach(calc, "run", hook)
    for i, rec in enumerate(recorders):
        assert rec.sites() == {"run.total": [4 + i] * 50}


def test_object_without_dict_is_refused() -> None:
    class Slotted:
        __slots__ = ()

        def f(self) -> int:
            return 1

    with pytest.raises(TypeError, match="no __dict__"):
        attach(Slotted(), "f", Slotted.f.__code__, Hook(Probe(), Recorder()))


def test_other_tools_trace_function_keeps_working(core: FrameCore) -> None:
    """A debugger-style sys.settrace function sees calls during and after tracing."""
    seen: list[str] = []

    def other_tool(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            seen.append(frame.f_code.co_name)
        return None

    calc = Calc()
    previous = sys.gettrace()
    sys.settrace(other_tool)
    try:
        hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit"))
        calc.loop(3)
        detach(calc, "loop", hook)
        assert sys.gettrace() is other_tool
        calc.loop(2)
    finally:
        sys.settrace(previous)
    assert rec.sites() == {"loop.acc": [3]}
    assert seen.count("loop") == 2


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring needs Python >= 3.12")
def test_monitoring_tool_id_is_released() -> None:
    from vartrace.engine import patching
    from vartrace.engine.frames import MonitoringCore

    previous = patching.core()
    patching.set_core(MonitoringCore())
    try:
        tools_before = [sys.monitoring.get_tool(i) for i in range(6)]
        calc = Calc()
        hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit"))
        assert "vartrace" in [sys.monitoring.get_tool(i) for i in range(6)]
        calc.loop(3)
        detach(calc, "loop", hook)
        assert [sys.monitoring.get_tool(i) for i in range(6)] == tools_before
    finally:
        patching.set_core(previous)
    assert rec.sites() == {"loop.acc": [3]}


def test_set_core_refused_while_patched(core: FrameCore) -> None:
    from vartrace.engine import patching

    calc = Calc()
    hook, _ = _attach(calc, "loop", _probe("loop", "acc:exit"))
    with pytest.raises(RuntimeError, match="while methods are patched"):
        patching.set_core(core)
    detach(calc, "loop", hook)


@pytest.mark.parametrize("paths", [("acc:exit",), ("acc:exit", "i:every")], ids=["exit", "every"])
def test_traced_calls_leave_no_reference_cycles(core: FrameCore, paths: tuple[str, ...]) -> None:
    """Garbage from each call must be freed by refcounting, not wait for a full gc pass
    (the settrace core's common path, and its path that reads every line)."""
    import gc

    calc = Calc()
    hook, rec = _attach(calc, "loop", _probe("loop", *paths))
    calc.loop(3)
    while gc.collect():  # garbage left by earlier tests (finalizers can free more)
        pass
    gc.disable()
    try:
        for _ in range(50):
            calc.loop(3)
        unreachable = gc.collect()
    finally:
        gc.enable()
        detach(calc, "loop", hook)
    assert len(rec.sites()["loop.acc"]) == 51
    assert unreachable == 0


@pytest.mark.parametrize("profile_first", [False, True], ids=["tracer-first", "profiler-first"])
def test_cprofile_runs_while_tracing(core: FrameCore, profile_first: bool) -> None:
    import cProfile
    import pstats

    calc = Calc()
    profiler = cProfile.Profile()
    if profile_first:
        profiler.enable()
    hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit", "i:every"))
    try:
        if not profile_first:
            profiler.enable()  # raised "Another profiling tool is already active" (3.12+)
        calc.loop(3)
        profiler.disable()
    finally:
        profiler.disable()
        detach(calc, "loop", hook)
    calls = {func[2]: stat[1] for func, stat in pstats.Stats(profiler).stats.items()}
    assert calls["loop"] == 1
    assert rec.sites() == {"loop.acc": [3], "loop.i": [0, 1, 2]}


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring needs Python >= 3.12")
def test_monitoring_leaves_the_assigned_tool_ids_to_their_owners() -> None:
    from vartrace.engine import patching
    from vartrace.engine.frames import MonitoringCore

    monitoring = sys.monitoring
    previous = patching.core()
    patching.set_core(MonitoringCore())
    calc = Calc()
    try:
        hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit"))
        assert [monitoring.get_tool(i) for i in range(6)] == [None] * 3 + ["vartrace"] + [None] * 2
        detach(calc, "loop", hook)
        monitoring.use_tool_id(3, "another tool")
        monitoring.use_tool_id(4, "a third tool")
        with pytest.warns(RuntimeWarning, match=r"using id 5, which Python assigns to optimizers"):
            hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit"))
        assert monitoring.get_tool(5) == "vartrace"
        calc.loop(3)
        detach(calc, "loop", hook)
        assert monitoring.get_tool(5) is None
    finally:
        for tool in (3, 4):
            if monitoring.get_tool(tool) in ("another tool", "a third tool"):
                monitoring.free_tool_id(tool)
        patching.set_core(previous)
    assert rec.sites() == {"loop.acc": [3]}


def _halve(value: int) -> int:
    half = value // 2
    if value < 0:
        raise ValueError(value)
    return half


class Caller:
    def twice(self, x: int) -> int:
        first = _halve(x)
        second = _halve(first * 10)
        return first + second


def _callee_probe(*variables: str | None, when: str = "") -> Probe:
    info = methods_of(Caller)["twice"]
    (callee,) = info.callees
    segment = f"twice>{callee.name}"
    selectors = []
    for variable in variables:
        text = f"{segment}.{variable}" if variable else segment
        pattern = parse(text + when)
        states = pattern.step(pattern.start, segment)
        if variable:
            states = pattern.step(states, variable)
        selectors.append(Selector(variable, text, pattern, states, callee=callee.code))
    return Probe(calls=tuple(selectors))


def test_function_called_from_a_method_is_read_per_call(core: FrameCore) -> None:
    caller = Caller()
    hook, rec = _attach(caller, "twice", _callee_probe("half", "value", None))
    try:
        assert caller.twice(8) == 24
        _halve(100)  # called from elsewhere: not the traced method's call
        with pytest.raises(ValueError):
            caller.twice(-4)
    finally:
        detach(caller, "twice", hook)
    sites = rec.sites()
    # One record per call; a call that raised returned nothing and is not read.
    assert sites == {
        "twice>_halve.half": [4, 20],
        "twice>_halve.value": [8, 40],
        "twice>_halve": [4, 20],
    }
    assert "_halve" not in vars(Caller) and "twice" not in vars(caller)


class _OwnReduce(Calc):
    """A class whose reduction copies its ``__dict__`` as it is (no ``__getstate__``)."""

    def __reduce__(self) -> tuple:
        return (type(self), (), dict(vars(self)))


@pytest.mark.parametrize("cls", [Calc, _OwnReduce])
def test_copies_and_pickles_of_a_patched_object_are_untraced(core: FrameCore, cls: type) -> None:
    import copy
    import pickle

    calc = cls()
    calc.offset = 5
    hook, rec = _attach(calc, "run", _probe("run", "total:exit"))
    try:
        copies = [copy.deepcopy(calc), pickle.loads(pickle.dumps(calc))]
        if cls is Calc:  # a shallow copy of _OwnReduce shares the __dict__'s values
            copies.append(copy.copy(calc))
        calc.run(1)
        for other in copies:
            assert other.run(2) == (10, {"total": 9, "rest": []})
            assert copy.deepcopy(other).run(3) == (11, {"total": 10, "rest": []})
            if cls is Calc:  # the patch and its __getstate__ are left out
                assert vars(other) == {"offset": 5}
            else:  # the untraced method, of the copy
                assert other.run.__self__ is other
    finally:
        detach(calc, "run", hook)
    assert rec.sites() == {"run.total": [9]}, "only the traced object's call was recorded"
    assert vars(calc) == {"offset": 5}


def test_every_value_of_a_callee_variable(core: FrameCore) -> None:
    caller = Caller()
    hook, rec = _attach(caller, "twice", _callee_probe("value", "half", when="@every"))
    try:
        caller.twice(8)
    finally:
        detach(caller, "twice", hook)
    # value is bound at entry; half once per call: each call of each frame, in order.
    assert rec.records == [
        ("twice>_halve.value", 8),
        ("twice>_halve.half", 4),
        ("twice>_halve.value", 40),
        ("twice>_halve.half", 20),
    ]


def _renamed_kwarg(old: str, new: str) -> Any:
    """A decorator factory like transformers' ``deprecate_kwarg``: renames a keyword."""

    def wrapper(func: Any) -> Any:
        @functools.wraps(func)
        def wrapped_func(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapped_func

    return wrapper


@_logged
@_renamed_kwarg("past", "cache")
def _masked(size: int, cache: int = 0) -> int:
    mask = size * 10 + cache
    return mask


class MaskUser:
    def forward(self, n: int) -> int:
        first = _masked(n, past=1)
        return first + _masked(n + 1)


def test_function_behind_decorators_is_read(core: FrameCore) -> None:
    """``functools.wraps`` wrappers (``create_causal_mask``) between the method and the
    function: the function's own frame is read, once per call."""
    info = methods_of(MaskUser)["forward"]
    (callee,) = info.callees
    assert callee.code is inspect.unwrap(_masked).__code__
    selectors = []
    for variable, when in (("mask", ""), ("cache", "@every")):
        site = f"forward>_masked.{variable}"
        pattern = parse(site + when)
        states = pattern.step(pattern.step(pattern.start, "forward>_masked"), variable)
        selectors.append(Selector(variable, site, pattern, states, callee=callee.code))
    probe = Probe(calls=tuple(selectors))
    user = MaskUser()
    hook, rec = _attach(user, "forward", probe)
    try:
        assert user.forward(2) == 21 + 30
        _masked(5)  # called from elsewhere: not the traced method's call
    finally:
        detach(user, "forward", hook)
    assert rec.sites() == {"forward>_masked.cache": [1, 0], "forward>_masked.mask": [21, 30]}


def test_a_method_the_program_installs_while_traced_stays(core: FrameCore) -> None:
    """``block.forward = MethodType(f, block)`` while traced: the program's, never deleted."""
    import types

    def faster(self: Calc, n: int) -> int:
        return n * (n - 1) // 2

    calc = Calc()
    hook, rec = _attach(calc, "loop", _probe("loop", "acc:exit"))
    assert calc.loop(3) == 3
    installed = calc.loop = types.MethodType(faster, calc)  # type: ignore[method-assign]
    snapshot = copy.deepcopy(calc)
    detach(calc, "loop", hook)
    assert vars(calc) == {"offset": 0, "loop": installed}
    assert calc.loop(4) == 6
    assert vars(snapshot)["loop"].__func__ is faster, "a copy made while traced keeps it too"
    assert rec.sites() == {"loop.acc": [3]}
