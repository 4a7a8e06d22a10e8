"""Port of Tensor Dumper: dumps you can trace back to their run, compared with tolerances.

Tensor Dumper saved tensors together with what produced them (command
line, installed packages, git state) and compared two dumps within
tolerances.  vartrace's ``H5PYSaverCallback`` stores that metadata once per
file (``metadata=True``, the default), ``vartrace.open(path).meta`` and
``vartrace meta RUN`` read it back, and ``vartrace compare A B --atol --rtol``
compares two saved runs (exit status 1 when they differ: usable in CI).

This script trains the same small model three times — twice identically,
once with a slightly different learning rate — saves each run, shows the
metadata of one, and compares the runs.

Run: ``python examples/tensor_dumper_port.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

import vartrace
from vartrace import compare
from vartrace.cli import main as vartrace_cli
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.tracing.tracer import ModelTracer


def train(path: Path, lr: float, steps: int = 12) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.randn(steps, 16, 8)
    target = data.sum(dim=-1, keepdim=True).sin()
    with (
        H5PYSaverCallback(path, overwrite=True) as saver,
        ModelTracer(
            model, ["0", "2", "4", "forward"], post_gather_callbacks=[saver], gathering_interval=4
        ),
    ):
        for x, y in zip(data, target, strict=True):
            loss = nn.functional.mse_loss(model(x), y)
            vartrace.record("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def show_metadata(path: Path) -> None:
    with vartrace.open(path) as run:
        meta = run.meta
    git = meta.get("git", {})
    print(f"metadata of {path.name}:")
    command = meta["command"]
    print(f"  command:  {' '.join(command) if isinstance(command, list) else command}")
    print(f"  cwd:      {meta['cwd']}")
    print(f"  versions: torch {meta['versions']['torch']}, numpy {meta['versions']['numpy']}")
    print(f"  packages: {len(meta['packages'])} installed, e.g. {meta['packages'][0]}")
    if git.get("available"):
        state = "dirty" if git["dirty"] else "clean"
        print(f"  git:      {git['commit'][:12]} on {git['branch']} ({state})")
    else:
        print("  git:      not recorded (the run did not start inside a git checkout)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for the run files (default: temp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        a, again, changed = out / "run_a.h5", out / "run_a_again.h5", out / "run_lr.h5"
        train(a, lr=0.05)
        train(again, lr=0.05)
        train(changed, lr=0.0501)
        show_metadata(a)

        same = compare(a, again)
        print(f"\nrerun with the same settings: ok={same.ok} ({len(same)} records compared)")
        report = compare(a, changed, atol=1e-6, rtol=1e-4, labels=(a.name, changed.name))
        print(f"learning rate 0.05 -> 0.0501: ok={report.ok}, {report.first_divergence}")
        print(report)

        print(f"\n$ vartrace compare {a.name} {changed.name} --atol 1e-2 --rtol 1e-2 --names loss")
        status = vartrace_cli(
            ["compare", str(a), str(changed), "--atol", "1e-2", "--rtol", "1e-2", "--names", "loss"]
        )
        print(f"exit status {status}: the loss stays within 1e-2")


if __name__ == "__main__":
    main()
