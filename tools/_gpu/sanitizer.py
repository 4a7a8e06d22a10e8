"""``gpu_check.py``'s CUDA-sanitizer child: a few async-staged steps under
``TORCH_CUDA_SANITIZER=1``, its races counted from what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from _gpu.contenders import GRAD_SITES, SITES, Capture, traced
from _gpu.model import CSAN_SIZE, Trainer

CSAN_RACE = "CSAN detected a possible data race"
COMMAND = str(Path(__file__).resolve().parent.parent / "gpu_check.py")


def csan(timeout: float) -> dict[str, Any]:
    """A few async-staged steps (values and ``@grad``) in a child under the CUDA sanitizer."""
    command = [sys.executable, COMMAND, "--csan-child"]
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    text = done.stdout + done.stderr
    return {"rc": done.returncode, "races": text.count(CSAN_RACE), "tail": text[-2000:]}


def csan_child() -> None:
    trainer = Trainer(CSAN_SIZE, torch.device("cuda"))
    capture = Capture(trainer, keep=True)
    with traced(capture, [*SITES, *GRAD_SITES], staging="async"):
        for _ in range(4):
            trainer.step()
    torch.cuda.synchronize()
    print(f"csan child: {len(capture.records)} records")
