"""``torch.compile(fullgraph=True)``: recorded where the traced methods lie outside the
fullgraph regions (torchtitan compiles each block so), refused before the step where they
lie inside, never an exception inside the step."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from vartrace.tracing.tracer import ModelTracer

# Said whenever a compiled model is traced; not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore:vartrace. the model is compiled")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.relu(h) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        scaled = self.head(x) * 2
        return scaled


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=generator) for _ in range(3)]


def _wrap_blocks(model: Net, backend: str = "eager") -> str:
    """torchtitan's way: each block compiled and assigned back (an ``OptimizedModule``)."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, fullgraph=True, backend=backend)
    return "layers.0._orig_mod"


def _compile_blocks_in_place(model: Net, backend: str = "eager") -> str:
    for layer in model.layers:
        layer.compile(fullgraph=True, backend=backend)
    return "layers.0"


BLOCKS = [_wrap_blocks, _compile_blocks_in_place]
OUTSIDE = ["forward.scaled", "head", "head.forward.self.weight@grad"]


def _train(model: nn.Module, sites: list[str]) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ModelTracer(model, sites, change_detection=False) as tracer:
        for x in _inputs():
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
    return {name: (trace.iterations, trace.values) for name, trace in tracer.results.items()}


@pytest.mark.parametrize("compile_blocks", BLOCKS)
def test_blocks_compiled_with_fullgraph_record_the_sites_outside_them(
    compile_blocks: Callable[[Net], str],
) -> None:
    expected = _train(_net(), OUTSIDE)
    model = _net()
    compile_blocks(model)
    recorded = _train(model, OUTSIDE)
    assert set(recorded) == set(expected) and len(expected) == 3
    for name, (iterations, values) in expected.items():
        assert recorded[name][0] == iterations == [1, 2, 3]
        assert all(torch.equal(a, b) for a, b in zip(recorded[name][1], values, strict=True))


@pytest.mark.parametrize("compile_blocks", BLOCKS)
def test_a_site_inside_a_fullgraph_block_is_refused_before_the_step(
    compile_blocks: Callable[[Net], str],
) -> None:
    model = _net()
    block = compile_blocks(model)
    site = f"{block}.forward.h"
    with pytest.raises(ValueError) as refused:
        ModelTracer(model, ["head", site]).start()
    message = str(refused.value)
    assert "torch.compile(fullgraph=True)" in message
    assert f"the traced methods {block}.forward," in message
    assert "compile without fullgraph=True while tracing" in message
    assert "head.forward" not in message  # outside the blocks: not the problem
    # Nothing stays patched: the compiled model trains as before.
    model(_inputs()[0]).sum().backward()
    with ModelTracer(model, ["head"]) as tracer:  # a site outside the blocks still records
        model(_inputs()[0])
    assert tracer.results["head.forward"].iterations == [1]


def test_a_model_compiled_whole_in_place_with_fullgraph_is_refused_before_the_step() -> None:
    model = _net()
    model.compile(fullgraph=True, backend="eager")
    tracer = ModelTracer(model, ["head"])
    with pytest.raises(ValueError, match=r"<root> compiled with fullgraph=True") as refused:
        tracer.start()
    assert "head.forward and the model, whose calls count iterations" in str(refused.value)
    out = model(_inputs()[0])  # the step itself runs, unpatched
    assert out.shape == (3, 2)


def test_a_model_wrapped_whole_with_fullgraph_is_refused_before_the_step() -> None:
    compiled = torch.compile(_net(), fullgraph=True, backend="eager")
    with (
        pytest.raises(ValueError, match=r"<root> compiled with fullgraph=True"),
        ModelTracer(compiled, ["head"]),
    ):
        compiled(_inputs()[0])


@pytest.mark.parametrize("compile_blocks", BLOCKS)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_outputs_of_fullgraph_blocks_are_recorded_from_the_graph(
    compile_blocks: Callable[..., str], backend: str
) -> None:
    """A torchtitan-style run watches its block outputs: each recorded through an op in
    the block's graph, bit-exact against eager hooks, with iterations counted outside."""
    eager = _net()
    hooked: list[torch.Tensor] = []
    eager.layers[1].register_forward_hook(lambda _, args, out: hooked.append(out.detach().clone()))
    expected = _train(eager, ["layers.*", "head"])
    model = _net()
    block = compile_blocks(model, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = _train(model, [block.replace("0", "*"), "head"])
    said = [str(w.message) for w in caught if "vartrace" in str(w.message)]
    assert not [message for message in said if "layers" in message]  # no block runs eagerly
    assert len(recorded) == 3 and recorded["head.forward"][0] == [1, 2, 3]
    for i in range(2):
        iterations, values = recorded[f"{block.replace('0', str(i))}.forward"]
        eager_iterations, eager_values = expected[f"layers.{i}.forward"]
        assert iterations == eager_iterations == [1, 2, 3]
        assert all(torch.equal(a, b) for a, b in zip(values, eager_values, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(values, hooked, strict=True))
    assert not model.layers[0]._forward_hooks  # removed at stop


def test_a_local_and_an_output_of_one_fullgraph_block_are_refused_together() -> None:
    model = _net()
    _compile_blocks_in_place(model)
    with pytest.raises(ValueError, match=r"the traced methods layers\.1\.forward,") as refused:
        ModelTracer(model, ["layers.0", "layers.1.forward.h"]).start()
    assert "layers.0.forward" not in str(refused.value)  # an output: recorded from the graph
    assert "a module's whole output is recorded from inside the graph" in str(refused.value)


@pytest.mark.parametrize("compile_blocks", BLOCKS)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_parameters_of_fullgraph_blocks_and_their_gradients_are_recorded(
    compile_blocks: Callable[..., str], backend: str
) -> None:
    """Read from the graph when the module is entered; `@grad` watches the parameter's
    accumulated `.grad` as in eager mode, with the iteration of the forward."""

    def sites(block: str) -> list[str]:
        return [
            f"{block}.fc.weight",
            f"{block}.fc.weight@grad",
            f"{block}.forward.self.fc.bias@grad",
        ]

    expected = _train(_net(), sites("layers.0"))
    model = _net()
    block = compile_blocks(model, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = _train(model, sites(block))
    assert not [str(w.message) for w in caught if "no gradient" in str(w.message)]
    assert len(recorded) == len(expected) == 3
    for name, (iterations, values) in expected.items():
        got_iterations, got_values = recorded[name.replace("layers.0", block)]
        assert got_iterations == iterations == [1, 2, 3]
        assert all(torch.equal(a, b) for a, b in zip(got_values, values, strict=True))


def test_a_gradient_of_a_block_output_is_still_refused() -> None:
    model = _net()
    _compile_blocks_in_place(model)
    with pytest.raises(ValueError, match=r"the traced methods layers\.0\.forward,"):
        ModelTracer(model, ["layers.0@grad"]).start()


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.fc(x)
        return {"hidden": h, "pair": (h * 2, torch.relu(h))}


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DictBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)["pair"][1]
        return x


def test_a_structured_block_output_is_recorded_leaf_by_leaf_from_the_graph() -> None:
    """Dicts and tuples of tensors (a ModelOutput): each tensor under its keys, as eager."""

    def run(compiled: bool) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
        torch.manual_seed(0)
        model = DictNet()
        if compiled:
            for layer in model.layers:
                layer.compile(fullgraph=True, backend="aot_eager")
        return _train(model, ["layers.*"])

    expected, recorded = run(False), run(True)
    assert sorted(recorded) == sorted(expected) and len(expected) == 6
    assert "layers.1.forward.pair.0" in recorded
    for name, (iterations, values) in expected.items():
        assert recorded[name][0] == iterations == [1, 2, 3]
        assert all(torch.equal(a, b) for a, b in zip(recorded[name][1], values, strict=True))
