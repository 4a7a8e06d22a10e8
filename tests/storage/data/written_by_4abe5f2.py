"""The script that wrote written_by_4abe5f2.h5.gz: vartrace at commit 4abe5f2 (the last before
the package was laid out in layers), `python written_by_4abe5f2.py OUT.h5`; kept beside the
file so that it can be written again by another release."""

import sys

import torch
from torch import nn

from vartrace import H5PYSaverCallback, ModelTracer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        half = h.to(torch.bfloat16)  # noqa: F841 (a traced local)
        flags = h > 0  # noqa: F841
        info = {"mean": h.mean(), "n": 3}  # noqa: F841
        return h + x


torch.manual_seed(0)
model = Block()
with (
    H5PYSaverCallback(sys.argv[1]) as saver,
    ModelTracer(
        model,
        ["forward.h", "forward.half", "forward.flags", "forward.info", "lin.weight@grad"],
        post_gather_callbacks=[saver],
        gathering_interval=2,
    ),
):
    for step in range(4):
        x = torch.zeros(2, 3) if step == 2 else torch.randn(2, 3)
        model(x).sum().backward()
        model.zero_grad()
