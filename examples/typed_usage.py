"""A fully annotated user script: mypy checks it against vartrace's types (``py.typed``).

    python examples/typed_usage.py [--out run.h5]

CI runs ``mypy`` on the package and on this file, so what a user's type
checker sees of ``vartrace.open``, ``Run``, ``Site``, ``ModelTracer`` and the
callbacks stays precise (not ``Any``).  It also runs: a two-layer model is
traced for 12 steps into an HDF5 file, which is then read back.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer, Run, Site, Trace
from vartrace.tracing.tracer import GatherCallback


def halve(name: str, value: torch.Tensor, iteration: int) -> torch.Tensor:
    """A pre-save callback: keep half the values' precision (float16)."""
    return value.half()


def count_records(counts: dict[str, int]) -> GatherCallback:
    """A post-gather callback counting the records it sees per site."""

    def callback(name: str, trace: Trace) -> None:
        counts[name] = counts.get(name, 0) + len(trace.iterations)

    return callback


def trace_run(path: Path, steps: int = 12) -> dict[str, int]:
    """Train a small model for ``steps`` steps, tracing it into ``path``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts: dict[str, int] = {}
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(
            model,
            ["0", "2.forward.input"],
            pre_save_callbacks=[halve],
            post_gather_callbacks=[count_records(counts), saver],
            gathering_interval=4,
        ) as tracer,
    ):
        for _ in range(steps):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert tracer.iteration == steps
    return counts


def summary(path: Path) -> list[str]:
    """One line per site of the run at ``path``: records, first and last iteration, dtype."""
    lines: list[str] = []
    with vartrace.open(path) as run:
        assert isinstance(run, Run)
        for name in run.names:
            site: Site = run[name]
            iterations: np.ndarray = site.iterations
            lines.append(
                f"{name}: {len(site)} records, iterations {iterations.min()}-{iterations.max()},"
                f" {site.dtype}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="HDF5 file to write (a temporary one if omitted)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vartrace-") as folder:
        path: Path = args.out or Path(folder) / "typed.h5"
        counts = trace_run(path)
        print("records gathered:", ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        print("\n".join(summary(path)))


if __name__ == "__main__":
    main()
