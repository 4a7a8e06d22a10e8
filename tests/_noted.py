"""A record that notes the thread which pickled it, and a model that returns one.

The saver stores a `Noted` pickled, so its write runs `Noted.__reduce__`: `WRITERS` then
names, in order, the thread of each write (the writer thread, or the caller's).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

WRITERS: list[str] = []  # the thread that pickled each Noted, in order


class Noted:
    """A record the saver pickles; pickling it notes the thread."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __reduce__(self) -> tuple[type[Noted], tuple[int]]:
        WRITERS.append(threading.current_thread().name)
        return (Noted, (self.step,))


class NotedNet(nn.Module):
    """Doubles `x` and returns `note` beside it: its outputs are a tensor and a Noted."""

    def forward(self, x: torch.Tensor, note: Noted) -> tuple[torch.Tensor, Noted]:
        return x * 2, note
