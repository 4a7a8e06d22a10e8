"""``@grad`` sites: recorded gradients against the gradients autograd computes directly.

Each test trains one copy of a small GPT-style model under a tracer and an
identical copy (same seed, same batches) untraced, where the reference
gradients are read with ``retain_grad()`` on the very tensors the tracer
captures (attention scores, block outputs) and from ``param.grad``.
Comparisons are bit-exact (``torch.equal``).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from vartrace.trace import Trace
from vartrace.tracing.gradients import _ParameterWatch
from vartrace.tracing.tracer import ModelTracer

VOCAB, SEQ, BATCH = 32, 6, 2
SCORES = "layers.*.attn.forward.scores@grad"


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.probe: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        if self.probe is not None:
            scores.retain_grad()
            self.probe.append(scores)
        attn = scores.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.head = nn.Linear(d, VOCAB)
        self.checkpointing = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.checkpointing else layer(h)
        return self.head(h)


def _model(checkpointing: bool = False, **sizes: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(**sizes)
    model.checkpointing = checkpointing
    return model


def _batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(n)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())


class _Reference:
    """The untraced twin: gradients of the scores, block outputs and parameters, per forward."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.scores: list[list[torch.Tensor]] = [[] for _ in model.layers]
        self.outputs: list[list[torch.Tensor]] = [[] for _ in model.layers]
        for i, layer in enumerate(model.layers):
            layer.attn.probe = self.scores[i]
            layer.register_forward_hook(self._keep(self.outputs[i]))

    @staticmethod
    def _keep(kept: list[torch.Tensor]) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            output.retain_grad()
            kept.append(output)

        return hook

    def grads(self, kind: str, layer: int) -> list[torch.Tensor]:
        tensors = self.scores[layer] if kind == "scores" else self.outputs[layer]
        return [_grad(t) for t in tensors]


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the gradient autograd left in ``tensor.grad``."""
    assert tensor.grad is not None
    return tensor.grad.clone()


def _total_loss(model: nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([_loss(model, tokens) for tokens in batches]).sum()


def _by_iteration(trace: Trace) -> list[tuple[int, torch.Tensor]]:
    return sorted(zip(trace.iterations, trace.values, strict=True), key=lambda p: p[0])


def _assert_equal(recorded: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(recorded) == len(expected)
    for got, want in zip(recorded, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.warnings_as_errors
def test_scores_outputs_and_parameters_match_autograd() -> None:
    steps = 3
    batches = _batches(steps)
    traced, twin = _model(), _model()
    reference = _Reference(twin)
    paths = [SCORES, "layers.*@grad", "head.forward.self.weight@grad", "layers.0.forward.self@grad"]
    expected_params: dict[str, list[torch.Tensor]] = {}

    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    for tokens in batches:
        optimizer.zero_grad()
        _loss(twin, tokens).backward()
        grads = {"head.weight": _grad(twin.head.weight)}
        grads |= {f"layers.0.{n}": _grad(p) for n, p in twin.layers[0].named_parameters()}
        for name, grad in grads.items():
            expected_params.setdefault(name, []).append(grad)
        optimizer.step()

    optimizer = torch.optim.SGD(traced.parameters(), lr=0.1)
    with ModelTracer(traced, paths, change_detection=False) as tracer:
        for tokens in batches:
            optimizer.zero_grad()
            _loss(traced, tokens).backward()
            optimizer.step()

    results = tracer.results
    for layer in range(2):
        for kind, site in (
            ("scores", f"layers.{layer}.attn.forward.scores@grad"),
            ("outputs", f"layers.{layer}.forward@grad"),
        ):
            assert results[site].iterations == [1, 2, 3]
            _assert_equal(results[site].values, reference.grads(kind, layer))
    assert results["head.forward.self.weight@grad"].iterations == [1, 2, 3]
    _assert_equal(results["head.forward.self.weight@grad"].values, expected_params["head.weight"])
    own = [n for n in expected_params if n.startswith("layers.0.")]
    assert len(own) == len(list(traced.layers[0].parameters()))
    for name in own:
        site = "layers.0.forward.self." + name.removeprefix("layers.0.") + "@grad"
        assert results[site].iterations == [1, 2, 3]
        _assert_equal(results[site].values, expected_params[name])


def test_argument_gradient_is_the_gradient_of_the_input() -> None:
    tokens = _batches(1)[0]
    traced, twin = _model(), _model()
    inputs: list[torch.Tensor] = []
    twin.layers[1].register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    twin.layers[1].register_forward_pre_hook(lambda m, args: args[0].retain_grad())
    _loss(twin, tokens).backward()

    with ModelTracer(traced, ["layers.1.forward.x@grad"]) as tracer:
        _loss(traced, tokens).backward()

    _assert_equal(tracer.results["layers.1.forward.x@grad"].values, [inputs[0].grad])


@pytest.mark.warnings_as_errors
def test_accumulation_one_backward_for_several_forwards() -> None:
    steps, micro = 2, 3
    batches = _batches(steps * micro)
    traced, twin = _model(), _model()
    reference = _Reference(twin)
    expected_params = []
    for step in range(steps):
        twin.zero_grad()
        _total_loss(twin, batches[step * micro : (step + 1) * micro]).backward()
        expected_params.append(_grad(twin.head.weight))

    with ModelTracer(traced, [SCORES, "head.forward.self.weight@grad"]) as tracer:
        for step in range(steps):
            traced.zero_grad()
            _total_loss(traced, batches[step * micro : (step + 1) * micro]).backward()

    for layer in range(2):
        trace = tracer.results[f"layers.{layer}.attn.forward.scores@grad"]
        pairs = _by_iteration(trace)
        assert [it for it, _ in pairs] == [1, 2, 3, 4, 5, 6]
        _assert_equal([g for _, g in pairs], reference.grads("scores", layer))
    head = tracer.results["head.forward.self.weight@grad"]
    assert head.iterations == [3, 6]  # once per backward, tagged with the last forward
    _assert_equal(head.values, expected_params)


def test_accumulation_with_set_iteration_and_a_backward_per_micro_batch() -> None:
    steps, micro = 2, 3
    batches = _batches(steps * micro)
    traced, twin = _model(), _model()
    reference = _Reference(twin)
    expected_params = []
    for step in range(steps):
        twin.zero_grad()
        for tokens in batches[step * micro : (step + 1) * micro]:
            _loss(twin, tokens).backward()
            expected_params.append(_grad(twin.head.weight))

    with ModelTracer(traced, [SCORES, "head.forward.self.weight@grad"]) as tracer:
        for step in range(steps):
            tracer.set_iteration(step + 1)
            traced.zero_grad()
            for tokens in batches[step * micro : (step + 1) * micro]:
                _loss(traced, tokens).backward()

    for layer in range(2):
        trace = tracer.results[f"layers.{layer}.attn.forward.scores@grad"]
        assert trace.iterations == [1, 1, 1, 2, 2, 2]
        _assert_equal(trace.values, reference.grads("scores", layer))
    head = tracer.results["head.forward.self.weight@grad"]
    assert head.iterations == [1, 1, 1, 2, 2, 2]  # the accumulated .grad after each backward
    _assert_equal(head.values, expected_params)


def test_activation_checkpointing_records_once_per_forward() -> None:
    steps = 2
    batches = _batches(steps)
    traced, twin = _model(checkpointing=True), _model()
    reference = _Reference(twin)
    expected_qkv = []
    for tokens in batches:
        twin.zero_grad()
        _loss(twin, tokens).backward()
        expected_qkv.append(_grad(twin.layers[0].attn.qkv.weight))

    paths = [
        "layers.*.attn.forward.scores",
        SCORES,
        "layers.*@grad",
        "layers.0.attn.forward.self.qkv.weight@grad",
    ]
    with ModelTracer(traced, paths, change_detection=False) as tracer:
        for tokens in batches:
            traced.zero_grad()
            _loss(traced, tokens).backward()

    results = tracer.results
    for layer in range(2):
        values = results[f"layers.{layer}.attn.forward.scores"]
        assert values.iterations == [1, 2]  # the recomputation in backward adds nothing
        want = [t.detach() for t in reference.scores[layer]]
        _assert_equal(values.values, want)
        for kind, site in (
            ("scores", f"layers.{layer}.attn.forward.scores@grad"),
            ("outputs", f"layers.{layer}.forward@grad"),
        ):
            assert results[site].iterations == [1, 2]
            _assert_equal(results[site].values, reference.grads(kind, layer))
    qkv = results["layers.0.attn.forward.self.qkv.weight@grad"]
    assert qkv.iterations == [1, 2]
    _assert_equal(qkv.values, expected_qkv)


@pytest.mark.parametrize("change_detection", [True, False])
def test_change_detection_applies_to_gradients(change_detection: bool) -> None:
    model = _model()
    tokens = _batches(1)[0]
    with ModelTracer(model, [SCORES], change_detection=change_detection) as tracer:
        for _ in range(3):
            _loss(model, tokens).backward()  # no optimizer step: identical gradients
    expected = [1] if change_detection else [1, 2, 3]
    assert tracer.results["layers.0.attn.forward.scores@grad"].iterations == expected


def test_gradients_go_through_pre_save_callbacks() -> None:
    model = _model()
    tokens = _batches(1)[0]
    seen: list[tuple[str, int]] = []

    def norm(name: str, value: torch.Tensor, iteration: int) -> torch.Tensor:
        seen.append((name, iteration))
        return value.norm()

    with ModelTracer(model, ["layers.0.attn.forward.scores@grad"], pre_save_callbacks=[norm]) as t:
        _loss(model, tokens).backward()
    assert seen == [("layers.0.attn.forward.scores@grad", 1)]
    assert t.results["layers.0.attn.forward.scores@grad"].values[0].shape == ()


def test_a_second_backward_through_the_same_graph_records_nothing_more() -> None:
    model = _model()
    tokens = _batches(1)[0]
    paths = ["layers.0.attn.forward.scores@grad", "head.forward.self.weight@grad"]
    with ModelTracer(model, paths, change_detection=False) as tracer:
        loss = _loss(model, tokens)
        loss.backward(retain_graph=True)
        loss.backward()
    assert tracer.results["layers.0.attn.forward.scores@grad"].iterations == [1]
    assert tracer.results["head.forward.self.weight@grad"].iterations == [1]


def _vartrace_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("vartrace:")]


@pytest.mark.warnings_as_errors
def test_no_grad_and_non_differentiable_values_warn_once_per_site() -> None:
    model = _model()
    tokens = _batches(1)[0]
    paths = [SCORES, "forward.tokens@grad", "head.forward.self.weight@grad"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, paths) as tracer, torch.no_grad():
            for _ in range(3):
                model(tokens)
    messages = _vartrace_warnings(caught)
    sites = [
        "layers.0.attn.forward.scores@grad",
        "layers.1.attn.forward.scores@grad",
        "forward.tokens@grad",
        "head.forward.self.weight@grad",
    ]
    assert len(messages) == len(sites)
    for site in sites:
        [message] = [m for m in messages if f" {site}:" in m]
        assert "no gradient is recorded" in message
    assert "torch.no_grad()" in next(m for m in messages if "head.forward" in m)
    assert len(tracer.results) == 0
    assert model.head.weight._post_accumulate_grad_hooks in (None, {})


def test_hooks_are_removed_at_stop_when_backward_never_runs() -> None:
    model = _model()
    tokens = _batches(1)[0]
    live: list[torch.Tensor] = []

    def keep(name: str, value: torch.Tensor, iteration: int) -> torch.Tensor:
        live.append(value)
        return value

    paths = ["layers.0.attn.forward.scores", "layers.0.attn.forward.scores@grad"]
    paths.append("head.forward.self.weight@grad")
    with ModelTracer(model, paths, pre_save_callbacks=[keep]) as tracer:
        loss = _loss(model, tokens)
        assert live[0]._backward_hooks  # the @grad hook sits on the captured tensor
        assert model.head.weight._post_accumulate_grad_hooks
    assert not live[0]._backward_hooks
    assert not model.head.weight._post_accumulate_grad_hooks
    before = {name: len(trace) for name, trace in tracer.results.items()}
    loss.backward()
    assert {name: len(trace) for name, trace in tracer.results.items()} == before
    assert "layers.0.attn.forward.scores@grad" not in tracer.results


def _count(kind: type) -> int:
    gc.collect()
    return sum(issubclass(type(obj), kind) for obj in gc.get_objects())


def _discard(name: str, trace: Trace) -> None:
    trace.clear()


def _steps(model: GPT, tokens: torch.Tensor, n: int, backward: bool) -> Iterator[int]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i in range(1, n + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, tokens)
        if backward:
            loss.backward()
            optimizer.step()
        yield i


class _FreshScale(nn.Module):
    """Replaces its (non-parameter) leaf ``scale`` after every call."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.full((1,), 2.0, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.scale
        self.scale = torch.full((1,), 2.0, requires_grad=True)
        return out


def test_leaves_reached_through_self_record_grad_and_are_forgotten_when_gone() -> None:
    model = _FreshScale()
    used: list[torch.Tensor] = []
    with ModelTracer(model, ["forward.self.scale@grad"], change_detection=False) as tracer:
        for step in range(1, 301):
            used.append(model.scale)
            (model(torch.full((3,), float(step))) ** 2).sum().backward()
            if step > 2:
                used.pop(0)  # the step's leaf dies: its hook and entry must go too
        watches = _count(_ParameterWatch)
    trace = tracer.results["forward.self.scale@grad"]
    assert trace.iterations == list(range(1, 301))
    _assert_equal(trace.values[-2:], [_grad(t) for t in used])
    assert watches <= 200


@pytest.mark.parametrize("backward", [True, False], ids=["train", "no-backward"])
def test_a_thousand_steps_do_not_leak(backward: bool) -> None:
    model = _model(d=8, heads=2, blocks=1)
    tokens = _batches(1)[0]
    paths = [SCORES, "layers.0@grad", "layers.0.forward.self@grad"]
    counts: dict[int, tuple[int, int]] = {}
    with ModelTracer(model, paths, post_gather_callbacks=[_discard]):
        for i in _steps(model, tokens, 1000, backward):
            if i in (100, 1000):
                counts[i] = (_count(torch.Tensor), _count(RemovableHandle))
    tensors_100, handles_100 = counts[100]
    tensors_1000, handles_1000 = counts[1000]
    assert tensors_1000 <= tensors_100
    # Unfired hooks of dead graphs are forgotten in batches: bounded, not one per step.
    assert handles_1000 <= max(handles_100, 200)
