"""Small models with the code shapes of Hugging Face transformers, without the library.

* ``BertLike``: the self-attention module is registered under the name
  ``self`` (``encoder.layer.0.attention.self``), as in BERT / RoBERTa / ELECTRA;
* ``LlamaLike``: the attention's ``forward`` computes its weights in a
  module-level function (``eager_attention_forward``) that it calls through
  a local (``attention_interface``), as modern HF attention does; the
  attention projection has ``bias=False``;
* ``Wrapper``: a user's ``forward(self, *args, **kwargs)`` returning the
  wrapped model's output (its keys are the wrapped model's return keys);
* ``PeftLike``: PEFT's ``PeftModelForCausalLM``: its forward returns, inside
  a ``with`` block and with keyword names, the call of a tuner module whose
  ``forward(*args, **kwargs)`` returns ``self.model.forward(...)``;
* ``MoeLike``: Mixtral / Qwen2-MoE: each layer's router computes
  ``router_logits``, the layer returns them, the model collects them in its
  output, and the causal-LM model around it returns them again;
* ``CachedLike``: transformers' ``cache``: an argument of ``forward`` and
  a field of its output, both named ``cache``;
* ``GetterWrapper``: PEFT's ``PeftModel``: ``forward(*args, **kwargs)``
  returns ``self.get_base_model()(*args, **kwargs)``, whose keys only the
  run can tell.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    attn_weights = torch.matmul(query, key.transpose(-2, -1)) * scaling
    attn_weights = attn_weights.softmax(dim=-1)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output, attn_weights


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, None]:
    out = nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling)
    return out, None


ATTENTION_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {
    "sdpa": sdpa_attention_forward
}


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class SelfAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.query(hidden_states), self.key(hidden_states), self.value(hidden_states)
        attn_weights = (q @ k.transpose(-2, -1)).softmax(-1)
        context = attn_weights @ v
        return context, attn_weights


class Attention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.self = SelfAttention(d)
        self.output = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        context, _ = self.self(hidden_states)
        return self.output(context) + hidden_states


class BertLayer(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attention = Attention(d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attention(hidden_states)


class Encoder(nn.Module):
    def __init__(self, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(d) for _ in range(layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertLike(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.encoder = Encoder(d)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids))


class LlamaAttention(nn.Module):
    def __init__(self, d: int = 8, implementation: str = "eager") -> None:
        super().__init__()
        self.implementation = implementation
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        attention_interface = eager_attention_forward
        if self.implementation != "eager":
            attention_interface = ATTENTION_FUNCTIONS[self.implementation]
        attn_output, attn_weights = attention_interface(
            self, query, key, value, query.shape[-1] ** -0.5
        )
        return self.o_proj(attn_output), attn_weights


class LlamaLayer(nn.Module):
    def __init__(self, d: int = 8, implementation: str = "eager") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(d, implementation)
        self.norm = nn.LayerNorm(d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_output, _ = self.self_attn(self.norm(hidden_states))
        return hidden_states + attn_output


class LlamaLike(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16, implementation: str = "eager") -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d, implementation) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return ModelOutput(logits=logits, loss=loss)


class Wrapper(nn.Module):
    """A user's wrapper: its forward returns the wrapped model's output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.model(*args, **kwargs)


class BatchWrapper(Wrapper):
    """A user's wrapper taking a batch dict, returning the output through a local."""

    def forward(self, batch: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        out = self.model(**batch)
        return out


class LoraTuner(nn.Module):
    """PEFT's ``LoraModel``: calls the wrapped model's ``forward`` method."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.model.forward(*args, **kwargs)


class PeftLike(nn.Module):
    """PEFT's ``PeftModelForCausalLM``: the tuner's call, inside a ``with`` block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = LoraTuner(model)

    def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
        with contextlib.nullcontext():
            return self.base_model(input_ids=input_ids, labels=labels, **kwargs)


class GetterWrapper(Wrapper):
    """PEFT's ``PeftModel``: the wrapped model reached through a method's result."""

    def get_base_model(self) -> nn.Module:
        return self.model

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.get_base_model()(*args, **kwargs)


class Router(nn.Module):
    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.weight = nn.Linear(d, experts, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = self.weight(hidden_states)
        return router_logits.softmax(-1), router_logits


class MoeLayer(nn.Module):
    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = Router(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routing_weights, router_logits = self.gate(hidden_states)
        out = torch.stack([expert(hidden_states) for expert in self.experts], -1)
        return hidden_states + (out * routing_weights.unsqueeze(-2)).sum(-1), router_logits


@dataclass
class MoeOutput:
    logits: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] = ()


class MoeModel(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(MoeLayer(d) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> MoeOutput:
        hidden_states = self.embed_tokens(input_ids)
        all_router_logits: tuple[torch.Tensor, ...] = ()
        for layer in self.layers:
            hidden_states, router_logits = layer(hidden_states)
            all_router_logits += (router_logits,)
        return MoeOutput(logits=hidden_states, router_logits=all_router_logits)


class MoeLike(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.model = MoeModel(d, vocab)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> MoeOutput:
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs.logits)
        return MoeOutput(logits=logits, router_logits=outputs.router_logits)


@dataclass
class CacheOutput:
    logits: torch.Tensor
    cache: dict[str, torch.Tensor] | None = None


class CachedLike(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, cache: dict[str, torch.Tensor] | None = None
    ) -> CacheOutput:
        hidden_states = self.embed_tokens(input_ids)
        if cache is not None:
            hidden_states = torch.cat([cache["hidden_states"], hidden_states], 1)
        cache = {"hidden_states": hidden_states}
        return CacheOutput(logits=self.lm_head(hidden_states), cache=cache)


def tokens(seed: int, batch: int = 2, length: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (batch, length), generator=generator)
