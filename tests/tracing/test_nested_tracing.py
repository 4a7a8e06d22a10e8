"""Traced code calling traced code, and values and code of unusual shapes, on real models.

Nested traced methods (``@every``, called functions, plain locals) under no
other tool and under a Python trace function; a tiny Hugging Face Llama
recording ``**.hidden_states`` and a function behind transformers'
decorators; a structure that refers to itself; a ``forward`` the program
installs while traced; locals pytest adds to a rewritten module.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._hf import tiny_llama
from vartrace import ModelTracer

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


class _Debugger:
    """A Python trace function as debuggers (and coverage's PyTracer) have them."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        self.calls += event == "call"
        return self.local

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local


@pytest.fixture(params=["alone", "debugger"])
def other_tool(request: pytest.FixtureRequest) -> Iterator[_Debugger | None]:
    """Run the test alone, or under a Python trace function that stays in place."""
    if request.param == "alone":
        yield None
        return
    debugger = _Debugger()
    previous = sys.gettrace()
    sys.settrace(debugger)
    try:
        yield debugger
        assert sys.gettrace() is debugger
    finally:
        sys.settrace(previous)


def _gate(x: torch.Tensor) -> torch.Tensor:
    gated = torch.sigmoid(x) * x
    return gated


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.proj(x).tanh()
        return mixed


class Stack(nn.Module):
    """Each step runs a traced submodule; the loop's running value is read ``@every``."""

    def __init__(self) -> None:
        super().__init__()
        self.mixer = Mixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(3):
            h = h + self.mixer(h)
        h = _gate(h)
        return h


def _h_every_key(statement: str) -> str:
    """The `@every` key of `Stack.forward`'s `h` as bound by its line `statement`."""
    lines, first = inspect.getsourcelines(Stack.forward)
    (found,) = [first + n for n, text in enumerate(lines) if text.strip() == statement]
    return f"forward.h@every:L{found}"


def _reference(model: Stack, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The running values of ``h`` and the mixer's outputs, computed without a tracer."""
    hs, mixed = [x], []
    h = x
    for _ in range(3):
        mixed.append(model.mixer(h))
        h = h + mixed[-1]
        hs.append(h)
    hs.append(_gate(h))
    return hs, mixed


@pytest.mark.parametrize("outer", ["forward.h@every", "forward>_gate.gated", "forward.h"])
def test_nested_traced_modules(outer: str, other_tool: _Debugger | None) -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 4)
    with torch.no_grad():
        hs, mixed = _reference(model, x)
    with ModelTracer(model, [outer, "mixer.forward.mixed"]) as tracer:
        out = model(x)
    torch.testing.assert_close(out, hs[-1])
    torch.testing.assert_close(
        torch.stack(tracer.results["mixer.forward.mixed"].values), torch.stack(mixed)
    )
    expected = {outer: hs[-1:]}
    if outer == "forward.h@every":  # a site per line binding h: the argument, the loop, the gate
        expected = {
            _h_every_key("h = x"): hs[:1],
            _h_every_key("h = h + self.mixer(h)"): hs[1:4],
            _h_every_key("h = _gate(h)"): hs[4:],
        }
    assert set(tracer.results) == {*expected, "mixer.forward.mixed"}
    for name, values in expected.items():
        torch.testing.assert_close(torch.stack(tracer.results[name].values), torch.stack(values))
    if other_tool is not None:
        assert other_tool.calls > 0


@needs_transformers
def test_tiny_llama_records_hidden_states_everywhere(other_tool: _Debugger | None) -> None:
    model = tiny_llama()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(i: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [
        layer.register_forward_pre_hook(keep_input(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    with ModelTracer(model, ["**.hidden_states"]) as tracer:
        out = model(ids, labels=ids)
        out.loss.backward()
    for handle in handles:
        handle.remove()
    results = tracer.results
    assert "forward.hidden_states" in results and "model.norm.forward.hidden_states" in results
    for i in (0, 1):  # an argument: read at entry
        (at_entry,) = results[f"model.layers.{i}.forward.hidden_states"].values
        torch.testing.assert_close(at_entry, inputs[i])
        assert f"model.layers.{i}.self_attn.forward.hidden_states" in results


@needs_transformers
def test_a_function_behind_transformers_decorators_is_recorded() -> None:
    """``create_causal_mask`` is wrapped by ``deprecate_kwarg``: its own locals are read."""
    import transformers.masking_utils

    assert hasattr(transformers.masking_utils.create_causal_mask, "__wrapped__")
    model = tiny_llama()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    patterns = [
        "model.forward>create_causal_mask.causal_mask",
        "model.layers.0.self_attn.forward.attention_mask",
    ]
    with ModelTracer(model, patterns) as tracer:
        model(ids)
    (mask,) = tracer.results["model.forward>create_causal_mask.causal_mask"].values
    (passed,) = tracer.results["model.layers.0.self_attn.forward.attention_mask"].values
    assert mask.shape == (2, 1, 6, 6)
    torch.testing.assert_close(mask, passed)


class Ring(nn.Module):
    """Keeps its tokens in a ring of dicts linked both ways."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ring: list[dict[str, Any]] = [{"value": row} for row in x]
        for i, node in enumerate(ring):
            node["next"] = ring[(i + 1) % len(ring)]
            node["prev"] = ring[i - 1]
        head = ring[0]
        return head["next"]["value"] * 2


def test_a_structure_that_refers_to_itself_is_recorded_with_markers() -> None:
    model = Ring()
    x = torch.arange(6.0).reshape(3, 2)
    warns = pytest.warns(RuntimeWarning, match=r"forward\.head is not walked as a tree")
    with warns, ModelTracer(model, ["forward.head"]) as tracer:
        model(x)
    results = tracer.results
    for site, row in (("value", 0), ("next.value", 1), ("next.next.value", 2), ("prev.value", 2)):
        (value,) = results[f"forward.head.{site}"].values
        torch.testing.assert_close(value, x[row])
    (marker,) = results["forward.head.next.next.next"].values
    assert isinstance(marker, vartrace.Unstored)
    assert marker == "dict: a reference back to forward.head (a cycle)"


def test_a_forward_installed_while_traced_stays_installed() -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 4)

    def doubled(self: Mixer, h: torch.Tensor) -> torch.Tensor:
        return 2 * h

    with ModelTracer(model, ["mixer.forward.mixed"]) as tracer:
        model(x)
        model.mixer.forward = types.MethodType(doubled, model.mixer)
        model(x)
    assert len(tracer.results["mixer.forward.mixed"].values) == 3  # the first step's
    assert model.mixer.forward.__func__ is doubled
    torch.testing.assert_close(model.mixer(x), 2 * x)


class Checked(nn.Module):
    """A model in a module pytest rewrites: its assert adds ``@py_assert`` locals."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        assert y.shape == x.shape, "same shape"
        return y


def test_assertion_temporaries_are_not_sites() -> None:
    model = Checked()
    assert any(name.startswith("@py_assert") for name in Checked.forward.__code__.co_varnames)
    assert vartrace.list_sites(model, "forward.*") == ["forward.x", "forward.y"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["forward.*"]) as tracer:
            model(torch.zeros(2))
    assert sorted(tracer.results) == ["forward.x", "forward.y"]


def _pieces(x: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
    for piece in x.chunk(n):
        half = piece / 2
        yield half * 2


class Streamer(nn.Module):
    """A model whose code runs in generators and a coroutine."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def chunks(self, x: torch.Tensor, n: int) -> Iterator[torch.Tensor]:
        for part in _pieces(x, n):
            out = self.proj(part)
            yield out

    async def later(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(self.chunks(x, 2)))


@pytest.mark.parametrize(
    ("pattern", "kind"),
    [
        ("chunks.out", "chunks, a generator"),
        ("**.out", "chunks, a generator"),
        ("chunks.part@every", "chunks, a generator"),
        ("chunks.x@return", "chunks, a generator"),
        ("later.y", "later, a coroutine \\(async def\\)"),
        ("chunks>_pieces.half", "_pieces, a generator"),
    ],
)
def test_variables_of_generators_and_coroutines_are_refused_before_step_1(
    pattern: str, kind: str
) -> None:
    with pytest.raises(ValueError, match=f"is in {kind} function: its body runs after the call"):
        ModelTracer(Streamer(), [pattern])


def test_arguments_of_a_generator_are_read_at_entry() -> None:
    model = Streamer()
    x = torch.ones(4, 4)
    with ModelTracer(model, ["chunks.n", "chunks.x"]) as tracer:
        model(x)
    assert tracer.results["chunks.n"].values == [2]
    torch.testing.assert_close(tracer.results["chunks.x"].values[0], x)
