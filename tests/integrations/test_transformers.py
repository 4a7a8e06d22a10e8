"""Paths on real Hugging Face models built from tiny configs (random weights, no downloads).

Skipped where transformers is not installed; tests/integrations/test_hf_shapes.py covers
the same code shapes with models of our own.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import vartrace
from vartrace import ModelTracer
from vartrace.tracing.sites import resolve

transformers = pytest.importorskip("transformers")

_LAYERS = {"hidden_size": 16, "intermediate_size": 32, "max_position_embeddings": 16}
_SMALL = {"vocab_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, **_LAYERS}


def _eager(model_class: type, config: object) -> torch.nn.Module:
    """A model with random weights, attention computed by the eager (Python) function."""
    config._attn_implementation = "eager"  # type: ignore[attr-defined]
    return model_class(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(attention_probs_dropout_prob=0.0, **_SMALL)
    return _eager(transformers.BertModel, config)


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(num_key_value_heads=1, **_SMALL)
    return _eager(transformers.LlamaForCausalLM, config)


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0
    )
    config.eos_token_id = 0
    return _eager(transformers.GPT2LMHeadModel, config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))


def test_bert_attention_self_is_reached_by_wildcards_and_listed() -> None:
    model = _bert()
    name = "encoder.layer.{}.attention.self.forward>eager_attention_forward.attn_weights"
    assert name.format(0) in vartrace.list_sites(model, "**")
    patterns = ["**.attn_weights", "encoder.layer.*.attention.*.forward.query_layer"]
    with ModelTracer(model, patterns) as tracer:
        model(_ids())
    for layer in (0, 1):
        assert f"encoder.layer.{layer}.attention.self.forward.query_layer" in tracer.results
        probabilities = tracer.results[name.format(layer)].values[0]
        torch.testing.assert_close(probabilities.sum(-1), torch.ones(2, 2, 6))


def test_llama_eager_attention_function_and_star_star_narrowing() -> None:
    model = _llama()
    targets = resolve(model, ["**.attn_weights"])
    assert sorted((t.path, t.method.name) for t in targets) == [
        ("model.layers.0.self_attn", "forward"),
        ("model.layers.1.self_attn", "forward"),
    ]
    pattern = "model.layers.*.self_attn.forward>eager_attention_forward.attn_weights"
    with ModelTracer(model, [pattern]) as tracer:
        model(_ids())
    weights = tracer.results[pattern.replace("*", "1")]
    assert weights.values[0].shape == (2, 2, 6, 6)
    with pytest.raises(ValueError, match=r"closest.*attn_weights"):
        ModelTracer(model, ["**.attn_wieghts"])


def test_llama_generate_in_eval_with_mode_train_warns() -> None:
    model = _llama().eval()
    with (
        pytest.warns(UserWarning, match=r"only in eval mode"),
        ModelTracer(model, ["**.attn_weights"]) as tracer,
    ):
        model.generate(_ids(), max_new_tokens=2, do_sample=False)
    assert not tracer.results


def test_gpt2_parameter_names_and_listing_without_machinery() -> None:
    model = _gpt2()
    sites = vartrace.list_sites(model, "**")
    assert "transformer.h.0.attn.c_attn.weight" in sites
    assert not any(s.startswith(("from_pretrained", "generate", "save_pretrained")) for s in sites)
    assert not any(s.endswith(".cls") for s in sites)
    ids = _ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with ModelTracer(model, ["transformer.h.0.attn.c_attn.weight@grad"]) as tracer:
            model(ids, labels=ids).loss.backward()
    grad = tracer.results["transformer.h.0.attn.c_attn.weight@grad"].values[0]
    torch.testing.assert_close(grad, model.transformer.h[0].attn.c_attn.weight.grad)


def test_mixtral_router_logits_are_stored_once_per_layer() -> None:
    config = transformers.MixtralConfig(
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **_SMALL
    )
    model = _eager(transformers.MixtralForCausalLM, config)
    with ModelTracer(model, ["**.router_logits"]) as tracer:
        out = model(_ids(), output_router_logits=True)
    gate = "model.layers.{}.mlp.gate.forward.router_logits"
    assert tracer.results.stored == [gate.format(0), gate.format(1)]  # issue 22 item 15
    torch.testing.assert_close(tracer.results[gate.format(1)].values[0], out.router_logits[1])
    # issue 32 item 0: the names the tensor was handed up through read as the gate's records
    assert tracer.results["forward.router_logits.1"] is tracer.results[gate.format(1)]
    assert tracer.results.aliases["model.forward.router_logits.1"] == gate.format(1)


def test_llama_cache_argument_and_output_field_keep_both() -> None:
    model = _llama()
    ids = _ids()
    cache = model(ids, use_cache=True).cache
    patterns = ["forward.cache", "forward"]
    with (
        pytest.warns(UserWarning, match="DynamicCache holding tensors"),
        ModelTracer(model, patterns) as tracer,
    ):
        model(ids[:, :1], cache=cache, use_cache=True)
    given = tracer.results["forward.cache.layers.0.keys"].values[0]  # issue 22 item 14
    returned = tracer.results["forward.cache@return.layers.0.keys"].values[0]
    assert given.shape[-2] == 6 and returned.shape[-2] == 7
    torch.testing.assert_close(returned, cache.layers[0].keys)


@pytest.mark.parametrize(
    ("pattern", "closest"),
    [
        ("model.layers.0.mlp.forward.qqq", "model.layers.0.mlp.forward"),  # down_proj(...)
        ("model.layers.0.self_attn.forward.scores", "model.layers.0.self_attn.forward"),
        ("model.norm.forward.typo", "model.norm.forward"),  # weight * h.to(dtype)
        ("forward.logitz", "forward.logits"),  # a CausalLMOutputWithPast's fields
    ],
)
def test_llama_misspelt_names_are_refused_before_step_one(pattern: str, closest: str) -> None:
    with pytest.raises(ValueError, match=rf"'{re.escape(pattern)}' matches no site.*{closest}"):
        ModelTracer(_llama(), [pattern])  # issue 22 item 1, on the real code


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=32,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _eager(transformers.T5ForConditionalGeneration, config)


@pytest.mark.parametrize(
    ("build", "wanted"),
    [
        (_gpt2, "transformer.h.{}.attn.forward.attn_weights"),
        (_llama, "model.layers.{}.self_attn.forward.attn_weights"),
        (_bert, "encoder.layer.{}.attention.self.forward.attn_weights"),
    ],
    ids=["gpt2", "llama", "bert"],
)
def test_the_attention_weights_read_under_the_attention_forward(build, wanted) -> None:  # type: ignore[no-untyped-def]
    """Issue 32 item 0: `**.attn_weights` stores the weights once (in the eager function)
    and `run[<attention>.forward.attn_weights]`, the name asked for first, reads them."""
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ModelTracer(model, ["**.attn_weights"]) as tracer:
            model(_ids())
    for layer in (0, 1):
        alias = tracer.results[wanted.format(layer)]  # KeyError before aliases
        assert alias.values[0].shape[-2:] == (6, 6)
        stored = tracer.results.aliases[wanted.format(layer)]
        assert stored.endswith(">eager_attention_forward.attn_weights")
        assert alias is tracer.results[stored]


def test_t5_attention_weights_and_generate_read_under_every_name() -> None:
    model = _t5().eval()
    with ModelTracer(model, ["**.attn_weights"], mode="any") as tracer:
        model.generate(_ids(), max_new_tokens=3, do_sample=False)
    aliases = tracer.results.aliases
    assert aliases, sorted(tracer.results)
    for alias, target in aliases.items():
        assert tracer.results[alias] is tracer.results[target]
