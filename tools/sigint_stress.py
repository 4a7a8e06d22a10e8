"""Ctrl-C during the foreground saver's flush: does the interrupt always reach the user's loop?

Usage::

    python tools/sigint_stress.py --runs 200 --seed 0

Measured on 2 shared CPU cores: before Ctrl-C was held during the saver's writes,
5 of 100 runs (seed 7) swallowed the interrupt ("Exception ignored in: ...
WeakValueDictionary ... KeyboardInterrupt"); after, 0 of 200 (seed 0), every
file readable and exact, 163 of the 200 interrupts landed inside the saver's
writes (18 in the tracer's hand-over around them, 19 in the step); 421.5 s wall,
with a test suite running beside it.

Each run forks a child from this process (which imported torch and vartrace
but ran no torch operation, so the child starts clean and fast).  The child
trains a tiny model under ``ModelTracer`` with a foreground
``H5PYSaverCallback``, gathering every iteration, 16 KiB records at ``--sites``
sites (default 1); two marker callbacks around the saver report when a
gather's writes start and when its flush ended.  The parent measures how long
those take, then sends SIGINT at a random moment inside the writes of a random
gather.  Each gather's start takes a go-ahead (a byte on a second pipe): the
parent gives ``_AHEAD`` at the start and one more for each gather it sees, so
the child never runs more than ``_AHEAD`` gathers ahead of the parent and cannot
reach its last step before the signal comes.  Without them a parent slowed by a
loaded machine let the child run on (up to 26 steps past the targeted gather in
100 runs with 3 busy loops on 2 cores), and a parent late by the rest of the
80 steps saw the child finish: a run counted as swallowed although nothing was
(``--lag 3``, a parent 3 s late: 3 of 3 runs).  ``--lag`` adds that many
seconds before each signal, as such a parent would.  A run is:

- ``interrupted``: ``KeyboardInterrupt`` reached the child's training loop;
- ``swallowed``: the loop ran to its end anyway (or the child printed
  ``Exception ignored ... KeyboardInterrupt``);
- ``failed``: the child died otherwise, or hung (killed at the deadline).

Where each interrupt landed is read from the traceback of the
``KeyboardInterrupt`` that reached the loop (``landed``): ``saver`` when it
passes through the saver's code (held during a write or flush and raised at its
end, or raised in it), ``gather`` when through the tracer's hand-over only,
``step`` otherwise.  ``sent_in_flush`` counts the signals the parent sent before
it saw the targeted gather's flush end (the child, a step later, is often in the
next gather's writes when the signal lands: fewer than ``landed["saver"]``).

Afterwards the file must open with ``vartrace.open`` and hold the records of
iterations 1..n without a gap, each with its exact value.  The counts and the
wall time (``wall_s``) are printed as JSON; the exit status is 1 unless every
run was interrupted, every file was right and at least one interrupt landed in
the saver (else the stress proved nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

# Small records: the writes spend their time in the Python code around HDF5 calls, where a
# signal's handler runs (inside an h5py weakref callback, before the fix, it was ignored).
_SHAPE = (64, 64)
_STEPS = 80  # a child that runs them all after the SIGINT swallowed it
_DEADLINE = 120.0  # seconds a child may take
_AHEAD = 40  # gathers a child may run ahead of the parent: the last target is 12 of 80


class _Multiples(nn.Module):
    """Returns ``{"k0": x, "k1": 2 * x, ...}``: the sites ``forward.k0``, ..."""

    def __init__(self, sites: int) -> None:
        super().__init__()
        self.sites = sites

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"k{k}": x * (k + 1) for k in range(self.sites)}


class _Marker:
    """A post-gather callback: ``start`` at the first site of a gather, then a go-ahead
    taken from ``go`` (when given); ``end`` after the gather's flush."""

    def __init__(self, fd: int, start: bytes, end: bytes, go: int | None = None) -> None:
        self._fd, self._start, self._end, self._go = fd, start, end, go

    def __call__(self, name: str, trace: object) -> None:
        if self._start and name == "forward.k0":
            os.write(self._fd, self._start)
            if self._go is not None:
                os.read(self._go, 1)  # b"" once the parent closed it: no more waits

    def flush(self) -> None:
        if self._end:
            os.write(self._fd, self._end)


_STORAGE = os.path.join("vartrace", "storage", "")
_TRACING = os.path.join("vartrace", "tracing", "")
_H5PY = f"{os.sep}h5py{os.sep}"


def _landed(error: BaseException) -> str:
    """Where the ``KeyboardInterrupt`` was raised, from its traceback: ``saver`` (inside the
    saver's write or flush: held there and raised when it ended, or raised in its code or
    h5py's), ``gather`` (the tracer's hand-over, outside the saver) or ``step``."""
    files = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
    if any(_STORAGE in name or _H5PY in name for name in files):
        return "saver"
    if any(_TRACING in name for name in files):
        return "gather"
    return "step"


def _child(path: Path, fd: int, go: int, log: Path, sites: int) -> None:
    """Train until interrupted, each gather after a go-ahead from ``go``; write
    ``interrupted <where>`` or ``finished`` to ``fd``."""
    # Python's Ctrl-C handler, as in a terminal, also when this tool was started with SIGINT
    # ignored (a shell's background job): Python then installs none, and nothing is held.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(errors, 2)
    model = _Multiples(sites)
    saver = H5PYSaverCallback(path, metadata=False, background=False)
    callbacks = [_Marker(fd, b"w\n", b"", go), saver, _Marker(fd, b"", b"d\n")]
    outcome = b"finished\n"
    try:
        with saver, ModelTracer(model, ["forward"], post_gather_callbacks=callbacks):
            for step in range(_STEPS):
                model(torch.full(_SHAPE, float(step)))
    except KeyboardInterrupt as error:
        outcome = f"interrupted {_landed(error)}\n".encode()
    os.write(fd, outcome)


@dataclass
class _Lines:
    """The lines a child wrote to its pipe, read as they come."""

    fd: int
    buffer: bytes = b""
    lines: list[str] = field(default_factory=list)
    closed: bool = False

    def wait(self, deadline: float) -> str | None:
        """The next line, or ``None`` when the pipe closed or the deadline passed."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if self.closed or left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            data = os.read(self.fd, 4096)
            self.closed = not data
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.lines.append(line.decode())
        return self.lines[-1]


def _check_file(path: Path, sites: int) -> str:
    """``""`` when every site of ``path`` holds iterations 1..n, each record exact; else what
    is wrong (a site may lack the last iteration: the interrupt came before its write)."""
    try:
        with vartrace.open(path) as run:
            for k in range(sites):
                site = run[f"forward.k{k}"]
                iterations = np.asarray(site.iterations)
                if not np.array_equal(iterations, np.arange(1, len(iterations) + 1)):
                    return f"forward.k{k}: iterations {iterations.tolist()} are not 1..n"
                values = site.values
                for row, iteration in enumerate(iterations):
                    if not (values[row] == np.float32((k + 1) * (iteration - 1))).all():
                        return f"forward.k{k}: the record of iteration {iteration} is wrong"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _one_run(
    directory: Path, rng: random.Random, index: int, sites: int, lag: float = 0.0
) -> dict[str, object]:
    path = directory / f"run{index}.h5"
    log = directory / f"run{index}.err"
    read, write = os.pipe()
    go_read, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        os.close(go)
        status = 1
        try:
            _child(path, write, go_read, log, sites)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    os.close(go_read)
    os.write(go, b"g" * _AHEAD)
    lines = _Lines(read)
    deadline = time.monotonic() + _DEADLINE
    target = rng.randint(3, 12)  # the gather to interrupt
    windows: list[float] = []
    started = 0.0
    gathers = 0
    sent_in_flush = False
    while True:
        line = lines.wait(deadline)
        if line is None:
            break
        if line == "w":
            gathers += 1
            started = time.monotonic()
            with contextlib.suppress(BrokenPipeError):  # the child ended since it wrote
                os.write(go, b"g")  # one more gather the child may start
            if gathers == target:
                time.sleep(lag + rng.uniform(0.0, 1.2 * float(np.median(windows))))
                os.kill(pid, signal.SIGINT)
                sent_in_flush = not lines.buffer and not select.select([read], [], [], 0)[0]
        elif line == "d":
            windows.append(time.monotonic() - started)
        elif line == "finished" or line.startswith("interrupted "):
            break
    outcome, _, landed = (lines.lines[-1] if lines.lines else "").partition(" ")
    os.close(go)  # a child still running (it swallowed the signal) goes on to its end
    while lines.wait(deadline) is not None:
        pass
    os.close(read)
    hung = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            hung = True
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    stderr = log.read_text(errors="replace")
    ignored = "Exception ignored" in stderr and "KeyboardInterrupt" in stderr
    if hung or os.waitstatus_to_exitcode(status) != 0 or outcome not in ("interrupted", "finished"):
        result = "failed"
    elif outcome == "finished" or ignored:
        result = "swallowed"
    else:
        result = "interrupted"
    problem = _check_file(path, sites)
    for leftover in (path, log):
        leftover.unlink(missing_ok=True)
    return {
        "run": index,
        "result": result,
        "file": problem or "ok",
        "sent_in_flush": sent_in_flush,
        "landed": landed if result == "interrupted" else "",
        "stderr": stderr[-2000:] if result != "interrupted" or problem else "",
    }


def stress(
    runs: int, seed: int, directory: Path, sites: int = 1, lag: float = 0.0
) -> dict[str, object]:
    """Run ``runs`` interrupted children; the counts, and the runs that went wrong."""
    rng = random.Random(seed)
    started = time.monotonic()
    counts = {"interrupted": 0, "swallowed": 0, "failed": 0, "bad_files": 0, "sent_in_flush": 0}
    landed = {"saver": 0, "gather": 0, "step": 0}
    wrong: list[dict[str, object]] = []
    for index in range(runs):
        outcome = _one_run(directory, rng, index, sites, lag)
        counts[str(outcome["result"])] += 1
        counts["sent_in_flush"] += int(bool(outcome["sent_in_flush"]))
        if outcome["landed"]:
            landed[str(outcome["landed"])] += 1
        if outcome["file"] != "ok":
            counts["bad_files"] += 1
        if outcome["result"] != "interrupted" or outcome["file"] != "ok":
            wrong.append(outcome)
    wall = round(time.monotonic() - started, 1)
    return {
        "runs": runs,
        "seed": seed,
        "sites": sites,
        "lag": lag,
        **counts,
        "landed": landed,
        "wall_s": wall,
        "wrong": wrong,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the stress, print the counts as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sites", type=int, default=1, help="sites written per gather")
    parser.add_argument("--dir", type=Path, default=None, help="where the run files go")
    parser.add_argument(
        "--lag", type=float, default=0.0, help="seconds the parent adds before each signal"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        report = stress(args.runs, args.seed, Path(directory), args.sites, args.lag)
    print(json.dumps(report, indent=1))
    good = report["interrupted"] == args.runs and report["bad_files"] == 0
    if not report["landed"]["saver"]:  # type: ignore[index]
        print("no interrupt landed inside the saver's writes: this proves nothing", file=sys.stderr)
        good = False
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
