"""Static facts read from classes and code objects (torch-free)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

from vartrace.engine.code import Returned, methods_of, returned_calls, runs_later


class Base:
    def helper(self, a, *args, key=1, **kwargs):  # type: ignore[no-untyped-def]
        inner = a + key

        def closure() -> int:
            return inner

        return {"value": closure(), "other": inner}

    def __repr__(self) -> str:
        return "Base"

    @staticmethod
    def static() -> int:
        return 1

    @property
    def prop(self) -> int:
        return 1


class Child(Base):
    def forward(self, x):  # type: ignore[no-untyped-def]
        y = x * 2
        return y


def test_methods_and_variables() -> None:
    methods = methods_of(Child)
    assert set(methods) == {"forward", "helper"}
    helper = methods["helper"]
    assert helper.arguments == ("self", "a", "key", "args", "kwargs")
    assert set(helper.locals) == {"inner", "closure"}
    assert {"value", "other", "0"} <= helper.return_keys
    assert methods["forward"].variables == ("self", "x", "y")


def test_stop_class_is_excluded() -> None:
    assert set(methods_of(Child, Base)) == {"forward"}


def test_engine_imports_no_torch() -> None:
    code = "import sys, vartrace, vartrace.engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _scale(value: int) -> int:
    return value * 2


def _calls_scale(value: int) -> int:
    return _scale(value)


class Mixed:
    @classmethod
    def build(cls, size: int) -> Mixed:
        return cls()

    @staticmethod
    def pure(a: int) -> int:
        return a

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.inner(*args, **kwargs)

    def scaled(self, x: int) -> dict:
        y = _scale(x)
        return {"y": y}

    def named(self, x: int) -> dict:
        return dict(loss=x, logits=x)

    def stored(self, batch: dict) -> object:
        out = self.inner(**batch)
        return out


def test_class_and_static_methods_are_left_out() -> None:
    assert set(methods_of(Mixed)) == {"forward", "scaled", "named", "stored"}


def test_functions_called_by_global_name_are_callees() -> None:
    methods = methods_of(Mixed)
    (callee,) = methods["scaled"].callees
    assert callee.name == "_scale" and callee.code is _scale.__code__
    assert callee.arguments == ("value",)
    assert methods["forward"].callees == ()


class Looped:
    def forward(self, x):  # type: ignore[no-untyped-def]
        with open(x) as f:  # a return inside a with block
            if f:
                return super().forward(x)
        for _i, layer in enumerate(self.layers[:2]):
            x = layer(x)
        return x if x else x.softmax(-1)


def test_the_calls_a_method_returns_are_read_from_its_source() -> None:
    inner = Returned("self", ("inner",))
    assert returned_calls(Mixed.forward) == (inner,)
    assert returned_calls(Mixed.stored) == (inner,)  # a local stored straight from a call
    assert returned_calls(Mixed.scaled) == ()
    (named,) = returned_calls(Mixed.named)
    assert (named.kind, named.target, named.keywords) == ("global", dict, True)
    (scale,) = returned_calls(_calls_scale)
    assert scale.target is _scale
    assert set(returned_calls(Looped.forward)) == {
        Returned("super", ("forward",)),
        Returned("loop", ("layers",)),
        Returned("value", ("softmax",)),
    }


def test_a_method_without_source_returns_an_unknown_call() -> None:
    namespace: dict[str, object] = {}
    exec("def forward(self, x):\n    return self.inner(x)\n", namespace)
    assert returned_calls(namespace["forward"]) == (Returned("unknown"),)  # type: ignore[arg-type]
    assert not methods_of(Mixed)["scaled"].annotated


class Checked:
    """A class in a module pytest rewrites: its ``assert`` adds ``@py_assert...`` locals."""

    def forward(self, x: int) -> int:
        y = x + 1
        assert y > x, "grows"
        return y


def test_names_that_are_not_identifiers_are_left_out() -> None:
    code = Checked.forward.__code__
    rewritten = [name for name in code.co_varnames if name.startswith("@py_assert")]
    assert rewritten, "pytest rewrote the assert of this module (the shape under test)"
    assert methods_of(Checked)["forward"].variables == ("self", "x", "y")


class Streams:
    def plain(self, x: int) -> int:
        return x

    def stream(self, n: int) -> Iterator[int]:
        yield from range(n)

    async def fetch(self, x: int) -> int:
        return x

    async def pages(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


def test_generators_and_coroutines_run_later() -> None:
    methods = methods_of(Streams)
    kinds = {name: runs_later(info.code) for name, info in methods.items()}
    assert kinds == {
        "plain": None,
        "stream": "a generator",
        "fetch": "a coroutine (async def)",
        "pages": "an async generator",
    }
