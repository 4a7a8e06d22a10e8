"""The step ``gpu_check.py`` and ``gpu_steps.py`` time: a GPT-2-small-size model trained with bf16
autocast, SDPA and fused AdamW; the sizes and plans of each mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Size:
    layers: int = 12
    d: int = 768
    heads: int = 12
    seq: int = 1024
    batch: int = 8
    vocab: int = 50304


@dataclass(frozen=True)
class Plan:
    """How much of each measurement a mode runs."""

    size: Size
    max_rounds: int
    steps: int  # timed steps per contender and round
    warm: int  # untimed steps after entering a contender
    timing_s: float  # the timing phase's budget
    exact_steps: int = 3
    sync_steps: int = 3


PLANS = {
    "full": Plan(Size(), max_rounds=6, steps=8, warm=2, timing_s=150.0),
    "quick": Plan(Size(), max_rounds=3, steps=6, warm=2, timing_s=70.0, sync_steps=2),
    "smoke": Plan(Size(2, 32, 2, 16, 2, 64), max_rounds=2, steps=3, warm=1, timing_s=60.0),
}
CSAN_SIZE = Size(layers=2, d=64, heads=2, seq=32, batch=2, vocab=128)


class Attention(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.d, 3 * size.d)
        self.proj = nn.Linear(size.d, size.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(size.d), nn.LayerNorm(size.d)
        self.attn = Attention(size)
        self.fc = nn.Linear(size.d, 4 * size.d)
        self.out = nn.Linear(4 * size.d, size.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.wte = nn.Embedding(size.vocab, size.d)
        self.wpe = nn.Embedding(size.seq, size.d)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.d)
        self.head = nn.Linear(size.d, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(positions)  # fp32 residual stream under autocast
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Trainer:
    """The model, its optimizer and four batches; :meth:`step` runs one training step."""

    def __init__(self, size: Size, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.size, self.device = size, device
        self.model = GPT(size).to(device)
        self.model.wpe.weight.requires_grad_(False)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
        generator = torch.Generator().manual_seed(seed + 1)
        shape = (size.batch, size.seq + 1)
        self.batches = [
            torch.randint(0, size.vocab, shape, generator=generator).to(device) for _ in range(4)
        ]
        self.positions = torch.arange(size.seq, device=device)
        self.steps = 0

    def step(self) -> None:
        batch = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(batch[:, :-1], self.positions)
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        self.optimizer.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
