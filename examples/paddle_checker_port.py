"""Port of the Paddle saving-hook precision checker: per-layer statistics of two runs, as CSV.

The Paddle tool registered saving hooks on every layer of chosen classes,
dumped their activations in a baseline run and in a run under test (for
instance mixed precision), then wrote one CSV row per layer with the cosine
similarity and the mean/std/var of both runs and their differences.  In
vartrace: ``vartrace.sites_of_type(model, nn.Linear, nn.LayerNorm)`` names
the layers, one ``ModelTracer`` per run captures their outputs, and
``vartrace.compare`` computes the statistics per record; grouping them by
site gives the per-layer table.

Here the run under test computes in bfloat16 autocast on the CPU.

Run: ``python examples/paddle_checker_port.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import vartrace
from vartrace import compare
from vartrace.tracing.tracer import ModelTracer

COLUMNS = (
    "layer",
    "type",
    "records",
    "min_cosine",
    "mean_cosine",
    "max_abs_diff",
    "mean_base",
    "mean_test",
    "mean_diff",
    "std_base",
    "std_test",
    "std_diff",
    "var_base",
    "var_test",
    "var_diff",
)


class Encoder(nn.Module):
    def __init__(self, width: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width),
                nn.ReLU(),
                nn.Linear(2 * width, width),
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def run(model: nn.Module, layers: list[str], inputs: torch.Tensor, *, bf16: bool) -> ModelTracer:
    """One checker run: every chosen layer's output for each batch of ``inputs``."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with (
        ModelTracer(model, layers, mode="eval", change_detection=False) as tracer,
        torch.no_grad(),
        autocast,
    ):
        for batch in inputs:
            model(batch)
    return tracer


def per_layer(report, model: nn.Module) -> list[dict]:
    """One row per layer: the Paddle checker's table, aggregated over batches."""
    frame = report.to_frame()
    modules = dict(model.named_modules())
    rows = []
    for site, records in frame.groupby("site", sort=False):
        layer = site.removesuffix(".forward")
        row = {
            "layer": layer,
            "type": type(modules[layer]).__name__,
            "records": len(records),
            "min_cosine": records["cosine"].min(),
            "mean_cosine": records["cosine"].mean(),
            "max_abs_diff": records["max_abs_diff"].max(),
        }
        for stat in ("mean", "std", "var"):
            row[f"{stat}_base"] = records[f"{stat}_a"].mean()
            row[f"{stat}_test"] = records[f"{stat}_b"].mean()
            row[f"{stat}_diff"] = records[f"{stat}_diff"].mean()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for the CSV files (default: temp)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Encoder().eval()
    layers = vartrace.sites_of_type(model, nn.Linear, nn.LayerNorm)
    print(f"checking {len(layers)} Linear and LayerNorm layers: {', '.join(layers[:4])}, ...")
    inputs = torch.randn(4, 32, 48)
    base = run(model, layers, inputs, bf16=False)
    test = run(model, layers, inputs, bf16=True)
    report = compare(base, test, atol=1e-3, rtol=1e-3, labels=("float32", "bfloat16 autocast"))
    rows = per_layer(report, model)

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "layer_check.csv"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        report.to_csv(out / "record_check.csv")
        with path.open() as f:
            written = sum(1 for _ in f) - 1
    print(f"wrote {path.name} ({written} layers) and record_check.csv ({len(report)} records)\n")

    shown = ("layer", "type", "min_cosine", "max_abs_diff", "mean_diff", "std_diff", "var_diff")
    print("  ".join(f"{c:>12}" if i > 1 else f"{c:<16}" for i, c in enumerate(shown)))
    for row in rows:
        cells = [f"{row['layer']:<16}", f"{row['type']:<16}"]
        cells += [
            f"{row[c]:>12.6f}" if c == "min_cosine" else f"{row[c]:>12.3e}" for c in shown[2:]
        ]
        print("  ".join(cells))
    worst = min(rows, key=lambda r: r["min_cosine"])
    cosines = np.array([r["min_cosine"] for r in rows])
    print(
        f"\nlowest cosine similarity: {worst['layer']} ({worst['min_cosine']:.6f}); "
        f"{int((cosines < 0.99999).sum())} of {len(rows)} layers below 0.99999"
    )
    site, iteration, _ = report.first_divergence
    print(
        f"first record beyond atol=rtol=1e-3: {site}, batch {iteration} "
        "(LayerNorm stays float32 under autocast: its outputs match exactly in layers.0)"
    )


if __name__ == "__main__":
    main()
