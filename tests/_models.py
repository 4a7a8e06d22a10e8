"""Small torch models shared by the tracer tests."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch import nn

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Output:
    logits: torch.Tensor
    extras: dict


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = self._scores(q, k)
        attn = scores.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        return (q @ k.transpose(-2, -1)) * scale


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.step_count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step_count += 1
        h = self.attn(self.norm(x))
        return x + h


class TinyTransformer(nn.Module):
    """Two blocks, a shared block called twice, a dataclass output."""

    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, scale: float = 1.0) -> Output:
        x = self.embed(tokens) * scale
        for layer in self.layers:
            x = layer(x)
        x = self.shared(self.shared(x))
        logits = self.head(x)
        return Output(logits, {"mean": logits.mean(), "pair": Pair(x.sum(), tokens.shape[0])})


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.bn(x))


def tokens(seed: int, batch: int = 2, length: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (batch, length), generator=generator)
