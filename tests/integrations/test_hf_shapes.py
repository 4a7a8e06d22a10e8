"""Paths on models shaped like Hugging Face code (issue 11 items 1, 2, 4, 7, 8; issue 14 '**')."""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import vartrace
from tests._hf_shapes import (
    BatchWrapper,
    BertLike,
    CachedLike,
    GetterWrapper,
    LlamaLike,
    MoeLike,
    PeftLike,
    Wrapper,
    eager_attention_forward,
    tokens,
)
from tests._models import WithBatchNorm
from vartrace import ModelTracer
from vartrace.engine import patching
from vartrace.engine.frames import FrameCore, MonitoringCore, SettraceCore
from vartrace.tracing.sites import resolve

CORES = [SettraceCore] + ([MonitoringCore] if hasattr(sys, "monitoring") else [])


@pytest.fixture(params=CORES, ids=lambda c: c.name)
def core(request: pytest.FixtureRequest) -> Iterator[FrameCore]:
    previous = patching.core()
    patching.set_core(request.param())
    yield patching.core()
    patching.set_core(previous)


# -- item 1: a submodule registered under the name ``self`` -------------------------------------


def test_a_module_named_self_is_an_ordinary_path_segment(core: FrameCore) -> None:
    model = BertLike()
    patterns = ["**.attn_weights", "encoder.layer.*.attention.*.forward.context"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, patterns) as tracer:
            model(tokens(0))
    assert sorted(tracer.results) == [
        "encoder.layer.0.attention.self.forward.attn_weights",
        "encoder.layer.0.attention.self.forward.context",
        "encoder.layer.1.attention.self.forward.attn_weights",
        "encoder.layer.1.attention.self.forward.context",
    ]
    weights = tracer.results["encoder.layer.0.attention.self.forward.attn_weights"].values[0]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5))


def test_list_sites_lists_sites_below_a_module_named_self() -> None:
    sites = vartrace.list_sites(BertLike(), "**")
    assert "encoder.layer.0.attention.self" in sites
    assert "encoder.layer.0.attention.self.forward.attn_weights" in sites
    assert "encoder.layer.0.attention.self.query.weight" in sites
    # The *variable* self is still never matched by a wildcard.
    assert not any(s.endswith("forward.self") for s in sites)
    assert "encoder.layer.0.attention.self.forward.self" not in vartrace.list_sites(
        BertLike(), "encoder.layer.0.attention.self.forward.*"
    )


# -- item 2: values inside functions called from a traced method --------------------------------


def _reference_weights(model: LlamaLike, ids: torch.Tensor, layer: int) -> torch.Tensor:
    hidden = model.embed_tokens(ids)
    for block in model.layers[:layer]:
        hidden = block(hidden)
    block = model.layers[layer]
    normed = block.norm(hidden)
    attn = block.self_attn
    query, key, value = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
    return eager_attention_forward(attn, query, key, value, query.shape[-1] ** -0.5)[1]


def test_a_path_continues_into_a_function_the_method_calls(core: FrameCore) -> None:
    model = LlamaLike()
    pattern = "layers.*.self_attn.forward>eager_attention_forward.attn_weights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, [pattern, "layers.0.self_attn.forward>*.1"]) as tracer:
            for step in range(2):
                model(tokens(step))
    name = "layers.{}.self_attn.forward>eager_attention_forward.attn_weights"
    for layer in (0, 1):
        trace = tracer.results[name.format(layer)]
        assert trace.iterations == [1, 2]
        with torch.no_grad():
            expected = _reference_weights(model, tokens(1), layer)
        torch.testing.assert_close(trace.values[1], expected)
    # The function's return value and its keys, under the calling module's site name.
    returned = tracer.results["layers.0.self_attn.forward>eager_attention_forward.1"]
    torch.testing.assert_close(returned.values[1], tracer.results[name.format(0)].values[1])


def test_every_value_in_a_called_function_gives_the_pre_softmax_scores(core: FrameCore) -> None:
    model = LlamaLike()
    name = "layers.0.self_attn.forward>eager_attention_forward.attn_weights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, [name, f"{name}@every"]) as tracer:
            model(tokens(0))
    lines, first = inspect.getsourcelines(eager_attention_forward)
    scores_key, softmax_key = (
        f"{name}@every:L{first + n}"
        for statement in ("attn_weights = torch.matmul(", "attn_weights = attn_weights.softmax(")
        for n, text in enumerate(lines)
        if text.strip().startswith(statement)
    )
    assert set(tracer.results) == {name, scores_key, softmax_key}  # a site per binding line
    (scores,) = tracer.results[scores_key].values
    (probabilities,) = tracer.results[softmax_key].values
    torch.testing.assert_close(scores.softmax(-1), probabilities)
    torch.testing.assert_close(tracer.results[name].values, [probabilities])


def test_function_sites_are_listed_validated_and_matched_by_wildcards() -> None:
    model = LlamaLike()
    sites = vartrace.list_sites(model, "layers.0.**")
    assert "layers.0.self_attn.forward>eager_attention_forward.attn_weights" in sites
    assert "layers.0.self_attn.forward>eager_attention_forward.query" in sites
    every = vartrace.list_sites(model, "**.attn_weights")
    assert "layers.1.self_attn.forward.attn_weights" in every
    assert "layers.1.self_attn.forward>eager_attention_forward.attn_weights" in every
    with pytest.raises(ValueError, match=r"closest.*forward>eager_attention_forward\.attn_weights"):
        ModelTracer(model, ["layers.0.self_attn.forward>eager_attention_forwrd.attn_weights"])
    with pytest.raises(ValueError, match="called function"):
        ModelTracer(model, ["layers.0.self_attn.forward>eager_attention_forward.query@entry"])
    with pytest.raises(ValueError, match="called function"):
        ModelTracer(model, ["layers.0.self_attn.forward>eager_attention_forward@every"])


# -- issue 14 and item 4: '**' patches only code that binds the name, and is validated ----------


def test_star_star_patches_exactly_the_methods_that_bind_the_name() -> None:
    model = LlamaLike()
    targets = resolve(model, ["**.attn_weights"])
    assert sorted((t.path, t.method.name) for t in targets) == [
        ("layers.0.self_attn", "forward"),
        ("layers.1.self_attn", "forward"),
    ]
    with ModelTracer(model, ["**.attn_weights"]):
        patched = [path for path, m in model.named_modules() if "forward" in vars(m)]
        # the root is not patched: module hooks count its calls (issue 11, item 6)
        assert patched == ["layers.0.self_attn", "layers.1.self_attn"]


def test_star_star_patterns_are_validated_like_others() -> None:
    model = LlamaLike()
    with pytest.raises(ValueError, match=r"'\*\*\.attn_wieghts'.*closest.*attn_weights"):
        ModelTracer(model, ["**.attn_wieghts"])
    with pytest.raises(ValueError, match=r"'\*\*\.eager_attention_forward\.\*' matches no site"):
        ModelTracer(model, ["**.eager_attention_forward.*"])


# -- item 4: nothing recorded is never silent ---------------------------------------------------


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught]


def test_a_model_in_eval_mode_with_mode_train_warns() -> None:
    model = LlamaLike().eval()
    pattern = "layers.*.self_attn.forward.attn_weights"
    message = r"only in eval mode.*mode='train'.*mode='eval'"
    with pytest.warns(UserWarning, match=message), ModelTracer(model, [pattern]) as tracer:
        model(tokens(0))
    assert not tracer.results


def test_patterns_that_recorded_nothing_warn_once_with_the_reason() -> None:
    model = LlamaLike(implementation="sdpa")
    patterns = [
        "layers.*.self_attn.forward.attn_weights",  # always None under SDPA
        "layers.*.self_attn.forward>eager_attention_forward.attn_weights",  # never called
        "layers.0.self_attn.forward.query",  # records: no warning
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, patterns):
            for step in range(3):
                model(tokens(step))
    messages = _messages(caught)
    assert len(messages) == 2, messages
    assert (
        "'layers.*.self_attn.forward.attn_weights' recorded nothing: its value was None"
        in (messages[0])
    )
    assert "forward>eager_attention_forward.attn_weights' recorded nothing" in messages[1]
    # issue 22 item 15: a function never called is said so, not "never bound"
    called = "layers.{}.self_attn.forward>eager_attention_forward"
    never = f"the function it is in was never called ({called.format(0)}, {called.format(1)})"
    assert never in messages[1]


def test_a_method_never_called_is_named() -> None:
    model = Wrapper(LlamaLike())
    with pytest.warns(UserWarning, match=r"its method was never called \(model\.layers\.0\.norm"):
        patterns = ["model.layers.0.norm.forward.input", "model.layers.1.norm.forward.input"]
        with ModelTracer(model, patterns):
            model.model.layers[1](torch.zeros(1, 2, 8))  # only the other layer runs


def test_one_variable_at_two_timings_keeps_both_keys() -> None:
    model = BertLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(
            model, ["encoder.forward.hidden_states", "encoder.forward.hidden_states@return"]
        ) as tracer:
            model(tokens(0))
    entry = tracer.results["encoder.forward.hidden_states"].values[0]
    final = tracer.results["encoder.forward.hidden_states@return"].values[0]
    torch.testing.assert_close(entry, model.embeddings(tokens(0)))
    assert not torch.equal(entry, final)


# -- item 7: parameter names as named_parameters() gives them; None skipped; listing ----------


def test_parameter_and_buffer_names_are_sites(core: FrameCore) -> None:
    model = LlamaLike()
    names = ["layers.0.self_attn.q_proj.weight@grad", "layers.*.norm.weight", "lm_head.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, names) as tracer:
            model(tokens(0)).logits.sum().backward()
    assert sorted(tracer.results) == [
        "layers.0.norm.weight",
        "layers.0.self_attn.q_proj.weight@grad",
        "layers.1.norm.weight",
        "lm_head.weight",
    ]
    grad = tracer.results["layers.0.self_attn.q_proj.weight@grad"].values[0]
    torch.testing.assert_close(grad, model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(tracer.results["lm_head.weight"].values[0], model.lm_head.weight)
    bn = WithBatchNorm()
    with ModelTracer(bn, ["bn.running_mean"], change_detection=False) as tracer:
        for _ in range(2):
            bn(torch.randn(4, 4))
    assert len(tracer.results["bn.running_mean"].values) == 2


def test_module_self_grad_skips_a_missing_bias_quietly() -> None:
    model = LlamaLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["layers.0.self_attn.q_proj.forward.self@grad"]) as tracer:
            model(tokens(0)).logits.sum().backward()
    assert list(tracer.results) == ["layers.0.self_attn.q_proj.forward.self.weight@grad"]


class _Layer(nn.TransformerEncoderLayer):
    """A user's subclass of a library module: the library's helpers are machinery."""

    @classmethod
    def from_config(cls, size: int) -> _Layer:
        return cls(size, 2, dim_feedforward=16, batch_first=True)

    @staticmethod
    def describe() -> str:
        return "layer"


def test_list_sites_leaves_out_class_methods_and_library_machinery() -> None:
    layer = _Layer.from_config(8)
    sites = vartrace.list_sites(layer)
    assert "forward.src" in sites
    assert not any(s.startswith(("from_config", "describe", "_sa_block")) for s in sites)
    # Named literally, a library base's method is still listed and reached.
    assert "_sa_block.x" in vartrace.list_sites(layer, "_sa_block.*")
    with ModelTracer(layer, ["_sa_block.x"]) as tracer:
        layer(torch.randn(2, 3, 8))
    assert list(tracer.results) == ["_sa_block.x"]


# -- item 8: keys below a return value that static analysis cannot see --------------------------


def test_keys_below_a_wrapper_return_are_followed_into_the_wrapped_model() -> None:
    ids = tokens(0)
    for model in (Wrapper(LlamaLike()), PeftLike(LlamaLike()), GetterWrapper(LlamaLike())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ModelTracer(model, ["forward.loss", "forward.logits"]) as tracer:
                model(ids, labels=ids)
        assert sorted(tracer.results) == ["forward.logits", "forward.loss"], type(model)
    for model in (Wrapper(LlamaLike()), PeftLike(LlamaLike())):  # issue 22, items 1 and 13
        with pytest.raises(ValueError, match=r"'forward\.lgoits' matches no.*forward\.logits"):
            ModelTracer(model, ["forward.lgoits"])
    batched = BatchWrapper(LlamaLike())
    with ModelTracer(batched, ["forward.loss"]) as tracer:
        batched({"input_ids": ids, "labels": ids})
    assert list(tracer.results) == ["forward.loss"]


def test_a_key_only_the_run_can_tell_is_checked_at_the_first_return() -> None:
    model = GetterWrapper(LlamaLike())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["forward.lgoits", "forward.loss"]) as tracer:
            model(tokens(0))  # no labels: the loss is None, its key exists
            first = [str(w.message) for w in caught]
            model(tokens(1), labels=tokens(1))
    assert first == [
        "vartrace: pattern 'forward.lgoits': forward returned a ModelOutput with keys "
        "logits, loss; no key 'lgoits'; closest: logits, loss (it records nothing under this name)"
    ]
    assert len(caught) == 1  # not said again when the tracer stops
    message = r"no key 'logits,loss'.*pass several as a list, \['forward\.logits', 'loss'\]"
    with pytest.warns(UserWarning, match=message), ModelTracer(model, "forward.logits,loss"):
        model(tokens(0))
    assert list(tracer.results) == ["forward.loss"]


# -- issue 22 item 15: a tensor handed up through return values is stored once -----------------


def test_star_star_stores_a_tensor_handed_up_through_returns_once() -> None:
    model = MoeLike()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.router_logits"], change_detection=False) as tracer:
            for step in range(2):
                model(tokens(step))
    gate = "model.layers.{}.gate.forward.router_logits"
    assert tracer.results.stored == [gate.format(0), gate.format(1)]
    assert tracer.results["forward.router_logits.0"] is tracer.results[gate.format(0)]  # alias
    assert len(tracer.results[gate.format(0)].values) == 2
    reference = model.model.layers[0].gate.weight(model.model.embed_tokens(tokens(1)))
    torch.testing.assert_close(tracer.results[gate.format(0)].values[1], reference)
    with ModelTracer(model, ["forward.router_logits"]) as tracer:  # named: recorded there
        model(tokens(0))
    assert sorted(tracer.results) == ["forward.router_logits.0", "forward.router_logits.1"]


# -- issue 22 item 14: an argument and a return key of the same name ------------------------------


def test_an_argument_and_an_output_field_of_one_name_keep_both() -> None:
    model = CachedLike()
    cache = model(tokens(0)).cache
    for patterns in (["forward.cache", "forward"], ["forward.*"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ModelTracer(model, patterns) as tracer:
                out = model(tokens(1), cache=cache)
        given = tracer.results["forward.cache.hidden_states"].values[0]
        returned = tracer.results["forward.cache@return.hidden_states"].values[0]
        assert sorted(name for name in tracer.results if name.startswith("forward.cache")) == [
            "forward.cache.hidden_states",
            "forward.cache@return.hidden_states",  # as an object's split leaves are named
        ]
        torch.testing.assert_close(given, cache["hidden_states"])
        torch.testing.assert_close(returned, out.cache["hidden_states"])
        assert given.shape == (2, 5, 8) and returned.shape == (2, 10, 8)
    with ModelTracer(model, ["forward"]) as tracer:  # the argument not traced: the plain name
        model(tokens(1), cache=cache)
    assert sorted(tracer.results) == ["forward.cache.hidden_states", "forward.logits"]
