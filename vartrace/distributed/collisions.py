"""Where a gather would collide with the training's own communication, and must wait.

A gather is a collective: every rank of its group must reach it, and nothing else
may run on that group in between.  Two training layouts break that on the
training thread:

- a `torch.distributed.pipelining` schedule (GPipe, 1F1B, ...) calls a stage's
  module once a microbatch, between its receives and sends: a gather at the end
  of such a call (an iteration, without `optimizer=`) waits for a rank that waits
  for this rank's activations;
- `torch.distributed.algorithms.Join` shadows the collectives of ranks still
  running with its own (a count each step, DDP's all-reduces) on the ranks out of
  inputs: a gather pairs with those and no rank leaves.

`in_pipeline_schedule` and `join_enabled` tell the tracer so; it then holds its
periodic gathers back to its final one (see `vartrace.tracing.handover`), or
refuses to start under a Join that would outlive it.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch

__all__ = ["in_pipeline_schedule", "join_enabled"]

_PIPELINING = os.path.join(os.path.dirname(torch.__file__), "distributed", "pipelining") + os.sep


def in_pipeline_schedule() -> bool:
    """Whether this thread runs inside a `torch.distributed.pipelining` schedule's step.

    Example:
        ```python
        schedule.step(x)  # a stage's forward, inside: in_pipeline_schedule() is True
        ```
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PIPELINING):
            return True
        frame = frame.f_back
    return False


def join_enabled(model: Any) -> bool:
    """Whether `model` (a `DistributedDataParallel` wrapper, any `Joinable`) was given to
    a `Join` with uneven-input detection on: its forward then takes part in Join's
    collectives, and ranks out of inputs shadow the others'.

    Example:
        ```python
        with Join([ddp]):
            join_enabled(ddp)  # True
        ```
    """
    config = getattr(model, "_join_config", None)
    return bool(getattr(config, "enable", False))
