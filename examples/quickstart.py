"""Quickstart: trace a small transformer while it trains, save to HDF5, read it back.

    python examples/quickstart.py [--steps 300] [--out run.h5]

The model learns to reverse short token sequences.  vartrace records the
model's input tokens, every block's attention scores (a local variable
inside ``Attention.forward``), the MLP hidden state reduced to a few
statistics by a pre-save callback, and the loss recorded by hand; records
stream into an HDF5 file every 25 iterations.  The summary at the end is
read from that file alone; without ``--out`` the file is temporary and removed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

VOCAB, SEQ, D_MODEL, HEADS = 16, 8, 32, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (d // HEADS) ** 0.5
        attn = scores.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        return self.out(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.1)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def summarize_hidden(name: str, value: Any, iteration: int) -> Any:
    """Pre-save callback: keep MLP hidden states as (mean, std, max), everything else as is."""
    if name.endswith("mlp.forward.h"):
        return torch.stack([value.mean(), value.std(), value.max()])
    return value


def train(out: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    paths = ["forward.tokens", "layers.*.attn.forward.scores", "layers.*.mlp.forward.h"]
    with (
        H5PYSaverCallback(out) as saver,
        ModelTracer(
            model,
            paths,
            pre_save_callbacks=[summarize_hidden],
            post_gather_callbacks=[saver],
            gathering_interval=25,
        ),
    ):
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (32, SEQ))
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flip(1).flatten())
            vartrace.record("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def summary(path: Path) -> str:
    lines = [f"{path} holds:"]
    with vartrace.open(path) as run:
        width = max(len(name) for name in run.names)
        lines.append(f"  {'site':<{width}}  records  iterations  record shape")
        for name in run.names:
            site = run[name]
            its = site.iterations
            shape = tuple(int(n) for n in site.shapes[0])
            lines.append(
                f"  {name:<{width}}  {len(its):7d}  {its.min():4d}-{its.max():<5d}  {shape}"
            )
        loss = run["loss"]
        first, last = loss.get(int(loss.iterations[0])), loss.get(int(loss.iterations[-1]))
        lines.append(f"loss: {float(first):.3f} at iteration 1 -> {float(last):.3f} at the end")
        scores = run["layers.1.attn.forward.scores"]
        peak = [float(abs(scores.get(int(i))).max()) for i in scores.iterations[::50]]
        lines.append(
            "largest |attention score| in block 1, every 50 iterations: "
            + ", ".join(f"{p:.1f}" for p in peak)
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Trace a small transformer into HDF5.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--out",
        type=Path,
        help="HDF5 file to write and keep (must not exist); default: a "
        "temporary file, removed at the end",
    )
    args = parser.parse_args()
    if args.out is not None:
        train(args.out, args.steps)
        print(summary(args.out))
        return
    with tempfile.TemporaryDirectory(prefix="vartrace-") as folder:
        out = Path(folder) / "quickstart.h5"
        train(out, args.steps)
        print(summary(out))
    print("(a temporary file, now removed: pass --out run.h5 to keep it)")


if __name__ == "__main__":
    main()
