"""The models the CPU benchmarks train: a GPT-style model in two sizes, and a loop of tiny calls.

``build_model`` and ``training_step`` are what ``bench_overhead.py``, ``bench_gradients.py``,
``bench_stats.py``, ``bench_storage.py`` and ``bench_distributed.py`` time; the paths are the
sites ``bench_overhead.py`` traces on them.
"""

from __future__ import annotations

import argparse

SIZES = {
    "tiny": {"blocks": 4, "d_model": 64, "heads": 4, "seq": 32, "batch": 2},
    "small": {"blocks": 4, "d_model": 256, "heads": 4, "seq": 128, "batch": 8},
}
TRACED_PATHS = ["forward.x", "layers.*.attn.forward.scores", "layers.*.mlp.forward.h"]
ALL_LOCALS_PATHS = ["layers.*.attn.forward.*"]
IDLE_PATHS = ["generate.prompt"]
LOOP_PATHS = ["blocks.*.forward.h"]
LOOP_CALLS = 8  # traced calls in one call of the loop model
LOOP_STEP_CALLS = 20  # calls of the loop model in one timed step


def build_model(size: str, seed: int = 0):  # type: ignore[no-untyped-def]
    """The GPT-style benchmark model and a batch of token ids for it."""
    import torch
    from torch import nn

    cfg = SIZES[size]
    d, heads = cfg["d_model"], cfg["heads"]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            attn = scores.softmax(dim=-1)
            return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = nn.functional.gelu(self.fc(x))
            return self.out(h)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn, self.mlp = Attention(), MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, vocab: int = 256) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(cfg["seq"], d))
            self.layers = nn.ModuleList(Block() for _ in range(cfg["blocks"]))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos[: x.shape[1]]
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

        def generate(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
            for _ in range(steps):
                prompt = torch.cat([prompt, self(prompt)[:, -1:].argmax(-1)], dim=1)
            return prompt

    torch.manual_seed(seed)
    model = GPT()
    tokens = torch.randint(0, 256, (cfg["batch"], cfg["seq"]))
    return model, tokens


def training_step(size: str):  # type: ignore[no-untyped-def]
    """The benchmark model and a function running one full training step on it."""
    import torch

    model, tokens = build_model(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()

    return model, step


def loop_model():  # type: ignore[no-untyped-def]
    """A chain of :data:`LOOP_CALLS` blocks of two tiny tensor ops, and its input.

    Nearly all of its time is Python, so a tracer's cost per call shows
    with little noise: the loop for A/B-ing changes to the record path.
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            return h - x

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(LOOP_CALLS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    return Chain(), torch.ones(4)


def add_size(parsed: argparse.ArgumentParser) -> None:
    """``--size``: the size of the benchmark GPT (:data:`SIZES`), ``tiny`` by default."""
    parsed.add_argument("--size", choices=sorted(SIZES), default="tiny")
