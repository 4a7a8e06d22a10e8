"""Host-device synchronisations in ``gpu_check.py``'s steps: whether two steps pass sync-debug
mode ``"error"`` (else where they raised), and every sync counted by thread and frame."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import vartrace
from _gpu.contenders import Capture, Contender
from _gpu.logs import describe
from _gpu.model import Trainer, synchronize

VARTRACE_DIR = os.path.dirname(vartrace.__file__) + os.sep  # as its frames name their files


def _frames(frame: FrameType | None) -> Iterator[tuple[str, int, str]]:
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


def innermost(frames: Iterable[tuple[str, int, str]]) -> str:
    """The innermost vartrace frame of ``frames`` (innermost first), else the check's own."""
    mine = None
    for filename, line, function in frames:
        if filename.startswith(VARTRACE_DIR):
            return f"{filename[len(VARTRACE_DIR) :]}:{line} {function}"
        path = Path(filename)
        if mine is None and (path.parent.name == "_gpu" or path.name == "gpu_check.py"):
            mine = f"{path.name}:{line} {function}"
    return mine or "(outside vartrace)"


def raised_at(error: BaseException) -> str:
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    frames = [
        (f.filename, f.lineno or 0, f.name)
        for e in reversed(chain)  # the original error first
        for f in reversed(traceback.extract_tb(e.__traceback__))
    ]
    return innermost(frames)


def sync_debug(trainer: Trainer, items: list[Contender]) -> dict[str, Any]:
    """Whether two traced steps run under ``set_sync_debug_mode("error")``, else where not."""
    device = trainer.device
    out: dict[str, Any] = {}
    for c in items:
        try:
            with c.enter(Capture(trainer)):
                trainer.step()
                trainer.step()
                synchronize(device)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    trainer.step()
                    trainer.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            synchronize(device)
            out[c.name] = {"raised": False}
        except Exception as error:
            torch.cuda.set_sync_debug_mode("default")
            out[c.name] = {"raised": True, "where": raised_at(error), "error": describe(error)}
            synchronize(device)
    return out


class SyncCounter:
    """Host-device synchronisations by kind, thread and innermost vartrace frame, while ``on``.

    Stream, device and event synchronisations as ``torch.cuda._gpu_trace`` reports them (a
    blocking copy is a stream synchronisation).  Once on, the trace stays on in this process.
    """

    def __init__(self) -> None:
        from torch.cuda import _gpu_trace

        self.on = False
        self.counts: Counter[tuple[str, str, str]] = Counter()
        torch._C._activate_gpu_trace()
        _gpu_trace.register_callback_for_stream_synchronization(lambda s: self._hit("stream"))
        _gpu_trace.register_callback_for_device_synchronization(lambda: self._hit("device"))
        _gpu_trace.register_callback_for_event_synchronization(lambda e: self._hit("event"))

    def _hit(self, kind: str) -> None:
        if self.on:
            where = innermost(_frames(sys._getframe(2)))
            self.counts[(kind, threading.current_thread().name, where)] += 1


def in_step(thread: str) -> bool:
    """The training thread, or an autograd device thread (made in C++: Python says Dummy-N)."""
    return thread == "MainThread" or thread.startswith("Dummy")


def count_syncs(trainer: Trainer, items: list[Contender], steps: int) -> dict[str, Any]:
    counter = SyncCounter()
    device = trainer.device
    out: dict[str, Any] = {}
    for c in items:
        counter.counts.clear()
        try:
            with c.enter(Capture(trainer)):
                trainer.step()
                trainer.step()
                synchronize(device)
                counter.on = True
                for _ in range(steps):
                    trainer.step()
                counter.on = False
            synchronize(device)
        except Exception as error:
            counter.on = False
            out[c.name] = {"error": describe(error)}
            continue
        by_site = [
            {"kind": kind, "thread": thread, "where": where, "per_step": n / steps}
            for (kind, thread, where), n in counter.counts.most_common()
        ]
        per_step = sum(row["per_step"] for row in by_site if in_step(row["thread"]))
        other = sum(
            row["per_step"]
            for row in by_site
            if not in_step(row["thread"]) and not row["thread"].startswith("vartrace-")
        )
        out[c.name] = {"in_step_per_step": per_step, "other_threads_per_step": other}
        out[c.name]["by_site"] = by_site
    return out
