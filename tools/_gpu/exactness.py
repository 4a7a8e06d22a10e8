"""Bit-exactness of ``gpu_check.py``'s records: each contender's against blocking copies of
the same tensors, and records under ``torch.compile(mode="reduce-overhead")``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from _gpu.contenders import Capture, Contender, Records, block_hooks, traced
from _gpu.logs import describe
from _gpu.model import Size, Trainer, synchronize


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def exactness(trainer: Trainer, items: list[Contender], steps: int) -> dict[str, Any]:
    """Each contender's records against hooks' blocking copies of the same tensors."""
    out: dict[str, Any] = {}
    for c in items:
        if c.name == "untraced":
            continue
        capture = Capture(trainer, keep=True)
        reference: Records = {}
        try:
            with block_hooks(trainer.model, True, reference, grad=True), c.enter(capture):
                for _ in range(steps):
                    trainer.step()
            synchronize(trainer.device)
        except Exception as error:
            out[c.name] = {"error": describe(error)}
            continue
        row: dict[str, Any] = {"records": len(capture.records)}
        if c.exact:
            wanted = {k: v for k, v in reference.items() if k[0].endswith("@grad") == c.grad}
            compared = [key for key in wanted if key in capture.records]
            bad = [key for key in compared if not same_bits(capture.records[key], wanted[key])]
            row.update(
                compared=len(compared),
                mismatched=len(bad),
                missing=len(wanted) - len(compared),
                first_mismatch=f"{bad[0][0]} @ {bad[0][1]}" if bad else None,
            )
        if c.name.startswith("vartrace") and not c.grad:
            row["wpe_records"] = sum(1 for site, _ in capture.records if site == "wpe.weight")
        out[c.name] = row
    return out


def compiled_check(size: Size, device: torch.device, steps: int, async_ok: bool) -> dict[str, Any]:
    """Under ``torch.compile(mode="reduce-overhead")`` the last block's input is the output
    of a compiled (cudagraph) region that the next replay overwrites: its records must equal
    a pre-hook's blocking copy of the same tensor, step by step."""
    trainer = Trainer(size, device)
    last = size.layers - 1
    site = f"blocks.{last}.forward.x"
    reference: Records = {}
    step = [0]

    def count(module: nn.Module, args: Any) -> None:
        step[0] += 1

    def keep(module: nn.Module, args: Any) -> None:
        reference[(site, step[0])] = args[0].detach().to("cpu", copy=True)

    handles = [
        trainer.model.register_forward_pre_hook(count),
        trainer.model.blocks[last].register_forward_pre_hook(keep),
    ]
    trainer.model = torch.compile(trainer.model, mode="reduce-overhead")  # type: ignore[assignment]
    capture = Capture(trainer, keep=True)
    try:
        with traced(capture, [site], **({"staging": "async"} if async_ok else {})):
            for _ in range(steps):
                trainer.step()
        synchronize(device)
    except Exception as error:
        return {"error": describe(error)}
    finally:
        for handle in handles:
            handle.remove()
    compared = [key for key in reference if key in capture.records]
    bad = [key for key in compared if not same_bits(capture.records[key], reference[key])]
    return {"records": len(capture.records), "compared": len(compared), "mismatched": len(bad)}
