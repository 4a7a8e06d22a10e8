"""The rooms a record walks through, from admission to the file.

Usage::

    python tools/record_walk.py                 # one whole record, synchronous staging
    python tools/record_walk.py --stats         # the same record through vartrace.stats()
    python tools/record_walk.py --staging async

A tiny model records one local variable into an HDF5 file with a gather at every
iteration's end.  After a first iteration (sites resolved, the file's site created), the
second iteration is walked: every call into a function of the package, on any thread, is
logged by `sys.setprofile` (and `threading.setprofile` for the staging and writing threads)
until its record is in the file.  A room is a module.  The walk prints the call tree by room,
a call inside the room it is called from folded into it, each room with its layer (the
layers of `tests/docs/test_layout.py`); then the rooms entered from more than one place, and
the calls that go from a lower layer up to a higher one (a callable handed down at start:
the only way up).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import vartrace

PACKAGE = Path(vartrace.__file__).parent
#: The package's layers, bottom first (tests/docs/test_layout.py's LAYERS, by unit).
LAYERS = (
    ("_support", "_version", "errors", "markers"),
    ("engine", "trace", "reduced", "placements", "tensors"),
    ("statistics",),
    ("staging", "distributed", "storage"),
    ("tracing",),
    ("analysis",),
    ("cli", "plot", "tensorboard", "__init__"),
)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        return h + x


def _room(frame: FrameType) -> str | None:
    """The module of `frame`'s code, if it is the package's: `staging.blocking`."""
    path = Path(frame.f_code.co_filename)
    try:
        parts = path.relative_to(PACKAGE).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(room: str) -> int:
    unit = room.split(".")[0]
    return next(level for level, units in enumerate(LAYERS) if unit in units)


def walk(stats: bool, staging: str) -> list[tuple[str, int, str, str | None]]:
    """(thread, depth, room, calling room) of each room entered while one record is made.

    The depth counts the rooms entered on the way: a call inside its caller's room does not
    enter a room, and a call from outside the package (a hook torch runs) starts at 0.
    """
    torch.manual_seed(0)
    model = _Block()
    visits: list[tuple[str, int, str, str | None]] = []
    stacks: dict[int, list[str | None]] = {}
    lock = threading.Lock()
    walking = threading.Event()  # threads the tracer starts are profiled from their start

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return") or not walking.is_set():
            return
        room = _room(frame)
        if room is None:
            return
        stack = stacks.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack:
                stack.pop()
            return
        caller = _room(frame.f_back) if frame.f_back is not None else None
        if caller is None or caller != room:
            depth = sum(1 for entered in stack if entered is not None)
            with lock:
                visits.append((threading.current_thread().name, depth, room, caller))
            stack.append(room)
        else:
            stack.append(None)  # inside the room it was called from

    callbacks = {"pre_save_callbacks": [vartrace.stats()]} if stats else {}
    with tempfile.TemporaryDirectory() as folder:
        saver = vartrace.H5PYSaverCallback(f"{folder}/run.h5")
        tracer = vartrace.ModelTracer(
            model,
            ["forward.h"],
            post_gather_callbacks=[saver],
            gathering_interval=1,
            staging=staging,
            **callbacks,
        )
        threading.setprofile(profile)
        tracer.start()
        model(torch.randn(4, 8))  # the first iteration: sites resolved, caches warm
        assert tracer.results is not None  # the staging thread, if any, is done
        sys.setprofile(profile)
        walking.set()
        try:
            model(torch.randn(4, 8))
            assert tracer.results is not None  # handed over by any staging thread
            saver.flush(wait=True)  # the background writer, if any, has written it
        finally:
            walking.clear()
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        tracer.stop()
        saver.close()
        assert len(vartrace.open(f"{folder}/run.h5")["forward.h"].iterations) == 2
    return visits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stats", action="store_true", help="records through vartrace.stats()")
    parser.add_argument("--staging", default="sync", choices=("sync", "async"))
    args = parser.parse_args()
    visits = walk(args.stats, args.staging)
    rooms = {room for _, _, room, _ in visits}
    print(f"{len(visits)} rooms entered, {len(rooms)} distinct:")
    for thread, depth, room, _ in visits:
        print(f"  {thread[:12]:12s} {'  ' * depth}{room} (layer {_layer(room)})")
    callers: dict[str, set[str | None]] = {}
    for _, _, room, caller in visits:
        callers.setdefault(room, set()).add(caller)
    again = sorted(room for room, by in callers.items() if len(by) > 1)
    print(f"rooms entered from more than one room: {len(again)}")
    for room in again:
        print(f"  {room} <- {', '.join(sorted(str(c) for c in callers[room]))}")
    climbs = sorted(
        {
            (caller, room)
            for _, _, room, caller in visits
            if caller is not None and _layer(room) > _layer(caller)
        }
    )
    print(f"calls from a lower layer up to a higher one: {len(climbs)}")
    for caller, room in climbs:
        print(f"  {caller} (layer {_layer(caller)}) -> {room} (layer {_layer(room)})")


if __name__ == "__main__":
    main()
