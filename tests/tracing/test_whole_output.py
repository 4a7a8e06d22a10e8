"""Capturing a whole output never keeps a live object (and its autograd graph) alive."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._hf import tiny_llama
from tests._models import tokens
from vartrace import ModelTracer


class KVLayer:
    """One layer of a key/value cache, as Hugging Face's ``DynamicLayer`` holds it."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False


class KVCache:
    """The shape of ``DynamicCache``: per-layer tensors with ``grad_fn``, no deepcopy."""

    def __init__(self, layers: int) -> None:
        self.layers = [KVLayer() for _ in range(layers)]

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        layer = self.layers[index]
        layer.keys, layer.values, layer.is_initialized = keys, values, True

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        raise RuntimeError("Only Tensors created explicitly by the user support deepcopy")


class CachedLM(nn.Module):
    """A causal LM returning its logits, a cache object and a lock (neither copyable)."""

    def __init__(self, d: int = 8, vocab: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.kv = nn.ModuleList([nn.Linear(d, 2 * d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)
        self.lock = threading.Lock()

    def forward(self, tokens: torch.Tensor) -> dict[str, Any]:
        x = self.embed(tokens)
        cache = KVCache(len(self.kv))
        for index, proj in enumerate(self.kv):
            keys, values = proj(x).chunk(2, dim=-1)
            cache.update(index, keys, values)
            x = x + values
        return {"logits": self.head(x), "past_key_values": cache, "lock": self.lock}


def test_objects_holding_tensors_are_split_and_never_kept_live() -> None:
    model = CachedLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["forward"], change_detection=False) as tracer:
            for step in range(3):
                out = model(tokens(step))
                out["logits"].pow(2).mean().backward()
                cache = weakref.ref(out["past_key_values"])
                keys = out["past_key_values"].layers[1].keys.detach().clone()
                del out
                gc.collect()
                assert cache() is None  # nothing holds the cache, nor so its graph
    results = tracer.results
    names = {
        f"forward.past_key_values.layers.{i}.{kv}" for i in (0, 1) for kv in ("keys", "values")
    }
    assert names <= set(results)
    for name in names:
        assert results[name].iterations == [1, 2, 3]
        for value in results[name].values:
            assert isinstance(value, torch.Tensor) and value.grad_fn is None
            assert not value.requires_grad
    torch.testing.assert_close(results["forward.past_key_values.layers.1.keys"].values[2], keys)
    assert not any(n.startswith("forward.past_key_values.layers.0.is_initialized") for n in results)
    # An object that is neither copyable nor made of tensors is recorded as a marker.
    markers = results["forward.lock"].values
    assert len(markers) == 3 and all(isinstance(m, vartrace.Unstored) for m in markers)
    assert all(m.startswith("lock: cannot copy it") for m in markers)
    ours = [str(w.message) for w in caught if str(w.message).startswith("vartrace")]
    assert len([m for m in ours if "KVCache holding tensors" in m]) == 1
    assert len([m for m in ours if "cannot copy a lock" in m]) <= 1  # once per process


def test_hugging_face_dynamic_cache_is_recorded_as_its_tensors() -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 32, (2, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ModelTracer(model, ["forward"]) as tracer:
            for _ in range(2):
                out = model(ids, labels=ids, use_cache=True)
                out.loss.backward()
                cache = weakref.ref(out.past_key_values)
                del out
                gc.collect()
                assert cache() is None
    assert not any(
        isinstance(v, transformers.Cache) for t in tracer.results.values() for v in t.values
    )
    keys = [n for n in tracer.results if n.endswith(".layers.1.keys")]
    assert keys, sorted(tracer.results)
    value = tracer.results[keys[0]].values[0]
    assert isinstance(value, torch.Tensor) and value.grad_fn is None
    assert value.shape == (2, 2, 6, 8)  # batch, heads, tokens, head dim
