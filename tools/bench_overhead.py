"""Overhead of tracing a training step, as ratios to an untraced step in the same process.

Usage::

    python tools/bench_overhead.py --size tiny      # Python-bound step (stands in for a GPU step)
    python tools/bench_overhead.py --size small     # compute-bound step
    python tools/bench_overhead.py --engine         # torch-free: settrace vs sys.monitoring core

Contenders run round-robin (a block of steps each, many rounds) so that
machine noise hits them alike; the table shows the median step time and
its ratio to the untraced median.  Traced contenders discard each chunk
after the gather (as the HDF5 saver does), so memory stays flat.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {
    "tiny": {"blocks": 4, "d_model": 64, "heads": 4, "seq": 32, "batch": 2},
    "small": {"blocks": 4, "d_model": 256, "heads": 4, "seq": 128, "batch": 8},
}
TRACED_PATHS = ["forward.x", "layers.*.attn.forward.scores", "layers.*.mlp.forward.h"]
IDLE_PATHS = ["generate.prompt"]
Context = Callable[[], contextlib.AbstractContextManager[None]]


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
            self.floor: list[torch.Tensor] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            attn = scores.softmax(dim=-1)
            if self.floor is not None:
                self.floor.append(scores.detach().clone())
            return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)
            self.floor: list[torch.Tensor] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = nn.functional.gelu(self.fc(x))
            if self.floor is not None:
                self.floor.append(h.detach().clone())
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
            self.floor: list[torch.Tensor] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.floor is not None:
                self.floor.append(x.detach().clone())
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


def table(title: str, rows: list[tuple[str, float]], base: float) -> str:
    """Format ``(contender, median seconds)`` rows with their ratio to ``base``."""
    width = max(len(name) for name, _ in rows)
    lines = [title, f"{'contender':<{width}}  {'median step':>12}  {'ratio':>6}"]
    for name, seconds in rows:
        unit = f"{seconds * 1e3:9.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:9.2f} us"
        lines.append(f"{name:<{width}}  {unit:>12}  {seconds / base:6.3f}x")
    return "\n".join(lines)


def round_robin(
    contenders: dict[str, Context],
    step: Callable[[], None],
    rounds: int,
    block: int,
) -> dict[str, float]:
    """Median seconds of ``step`` under each contender's context, interleaved round-robin."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, context in contenders.items():
            with context():
                for _ in range(block):
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def step_table(
    size: str, contenders: dict[str, Context], step: Callable[[], None], rounds: int, block: int
) -> str:
    """Warm up, time ``step`` under each contender, and format the table of ratios."""
    import torch

    for _ in range(3):
        step()
    medians = round_robin(contenders, step, rounds, block)
    title = (
        f"--size {size}: full training step (forward + backward + SGD), Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    return table(title, list(medians.items()), medians["untraced"])


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


def bench_model(size: str, rounds: int, block: int) -> str:
    import torch

    from vartrace import ModelTracer

    model, step = training_step(size)

    def discard(name: str, trace: object) -> None:
        trace.clear()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def untraced() -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def tracer(paths: list[str]) -> Iterator[None]:
        with ModelTracer(model, paths, post_gather_callbacks=[discard]):
            yield

    @contextlib.contextmanager
    def forward_hooks() -> Iterator[None]:
        kept: list[torch.Tensor] = []
        handles = [
            layer.register_forward_hook(lambda m, i, o: kept.append(o.detach().clone()))
            for layer in model.layers
        ]
        yield
        for handle in handles:
            handle.remove()

    @contextlib.contextmanager
    def copy_floor() -> Iterator[None]:
        owners = [model, *(b.attn for b in model.layers), *(b.mlp for b in model.layers)]
        for owner in owners:
            owner.floor = []
        yield
        for owner in owners:
            owner.floor = None

    contenders = {
        "untraced": untraced,
        "idle tracer (never-called method)": lambda: tracer(IDLE_PATHS),
        "forward hooks cloning block outputs": forward_hooks,
        "copy floor (clone the traced tensors)": copy_floor,
        "vartrace: " + ", ".join(TRACED_PATHS): lambda: tracer(TRACED_PATHS),
    }
    return step_table(size, contenders, step, rounds, block)


class _Workload:
    def compute(self, n: int) -> int:
        total = 0
        for i in range(n):
            total += i * i
        squared = total * total
        return squared % 7


def bench_engine(rounds: int, block: int) -> str:
    from vartrace.engine import Hook, Probe, Selector, attach, detach, methods_of, parse, set_core
    from vartrace.engine.frames import MonitoringCore, SettraceCore

    work = _Workload()
    info = methods_of(_Workload)["compute"]
    pattern = parse("compute.squared")
    states = pattern.step(pattern.step(pattern.start, "compute"), "squared")
    probe = Probe(exit=(Selector("squared", "compute.squared", pattern, states),))
    captured: list[object] = []

    def sink(site: str, value: object, grad: bool) -> None:
        captured.append(value)
        if len(captured) > 1000:
            captured.clear()

    def calls() -> None:
        for _ in range(100):
            work.compute(100)

    def traced(core_factory: Callable[[], object]) -> Context:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            set_core(core_factory())  # type: ignore[arg-type]
            hook = Hook(probe, sink)
            attach(work, "compute", info.code, hook)
            yield
            detach(work, "compute", hook)

        return context

    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "settrace core (locals at return)": traced(SettraceCore),
    }
    if hasattr(sys, "monitoring"):
        contenders["sys.monitoring core (locals at return)"] = traced(MonitoringCore)
    medians = round_robin(contenders, calls, rounds, block)
    title = (
        "--engine: 100 calls of a pure-Python method (a 100-step loop) with locals, "
        f"Python {sys.version.split()[0]}"
    )
    return table(title, list(medians.items()), medians["untraced"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--engine", action="store_true", help="torch-free engine comparison")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.engine:
        print(bench_engine(args.rounds, args.block))
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(bench_model(args.size, args.rounds, args.block))


if __name__ == "__main__":
    main()
