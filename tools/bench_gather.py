"""What a gather into an HDF5 saver costs the training thread, in instructions under callgrind.

Usage::

    python tools/bench_gather.py                 # 16 steps a contender, the tiny GPT, 13 sites
    python tools/bench_gather.py --steps 32 --size small
    python tools/bench_gather.py --training-thread-only   # no all-threads column: half the time

The tiny GPT of ``bench_overhead.py`` trains on the CPU while a tracer records
:data:`GATHER_PATHS` (13 sites: the input, and each of the 4 blocks' attention scores,
attention probabilities and MLP hidden state) with ``gathering_interval=1``: every step
gathers.  Each contender runs in a process of its own under ``valgrind --tool=callgrind
--separate-threads=yes`` (one torch thread, ``PYTHONHASHSEED=0``), instrumented for its
measured steps only, and the table counts the **training thread alone** (callgrind's
thread 1): what the step waits for.  The contenders:

- ``no saver``: the chunk discarded after each gather (what the tracer costs by itself);
- ``saver (default)``: ``H5PYSaverCallback(path)`` as a user makes it: the tracer hands
  each gather to the saver's writer thread (``flush_later``);
- ``saver, background=False`` / ``background=True``: written in the step / every call
  taken over for the writer thread, named.

The ``all threads`` column adds the saver's writer thread (and any other), so the work
moved off the training thread is still counted somewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _harness import discard, handshake, instructions, need_callgrind, parser, table, versions
from _model import add_size, training_step

GATHER_PATHS = [
    "forward.x",
    "layers.*.attn.forward.scores",
    "layers.*.attn.forward.attn",
    "layers.*.mlp.forward.h",
]
STEPS = 16
COMMAND = Path(__file__).resolve()
# Contender -> the saver's options (None: no saver, the chunk discarded).
CONTENDERS: dict[str, dict[str, Any] | None] = {
    "no saver": None,
    "saver (default)": {},
    "saver, background=False": {"background": False},
    "saver, background=True": {"background": True},
}


@contextlib.contextmanager
def _tracer(model: object, options: dict[str, Any] | None, folder: Path) -> Iterator[None]:
    """A tracer gathering every step into a saver made with `options` (None: discarded)."""
    from vartrace import H5PYSaverCallback, ModelTracer

    with contextlib.ExitStack() as stack:
        callback: Callable[[str, Any], None] = discard
        if options is not None:
            path = folder / "gather.h5"
            callback = stack.enter_context(
                H5PYSaverCallback(path, overwrite=True, metadata=False, **options)
            )
        with ModelTracer(
            model,  # type: ignore[arg-type]
            GATHER_PATHS,
            post_gather_callbacks=[callback],
            gathering_interval=1,
        ):
            yield


def _child(size: str, name: str, steps: int) -> None:
    """A contender's process, under callgrind: warm up, then ``steps`` steps between two
    handshakes (callgrind's instrumentation is on between them)."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, step = training_step(size)
    for _ in range(3):
        step()
    with tempfile.TemporaryDirectory() as folder, _tracer(model, CONTENDERS[name], Path(folder)):
        for _ in range(3):  # the file's sites made, the writer thread started
            step()
        gc.collect()
        handshake()
        for _ in range(steps):
            step()
        handshake()


def _count(size: str, name: str, steps: int, out: Path, main_thread: bool) -> float:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    argv = [str(COMMAND), "--size", size, "--steps", str(steps), "--_child", name]
    return instructions(argv, out, env, switched=True, main_thread=main_thread) / steps


def bench(size: str, steps: int, markdown: bool, every_thread: bool = True) -> str:
    """The training thread's instructions a step under each contender, and (with
    `every_thread`) all threads'."""
    need_callgrind(control=True)
    names = list(CONTENDERS)
    threads = (True, False) if every_thread else (True,)
    jobs = [(name, main_thread) for main_thread in threads for name in names]
    with tempfile.TemporaryDirectory() as directory, ThreadPoolExecutor(2) as pool:

        def counted(index: int) -> float:
            name, main_thread = jobs[index]
            out = Path(directory) / f"callgrind.{index}"
            return _count(size, name, steps, out, main_thread)

        counts = list(pool.map(counted, range(len(jobs))))
    training, every = counts[: len(names)], counts[len(names) :] or counts
    title = (
        f"bench_gather.py --size {size}: training step (forward + backward + SGD) gathering "
        f"13 sites every step; instructions (callgrind Ir) per step over {steps} steps; "
        f"{versions()}, 1 torch thread"
    )
    columns = 5 if every_thread else 3
    header = ["contender", "training thread", "ratio", "all threads", "ratio"][:columns]
    rows = [
        [
            name,
            f"{training[i] / 1e6:.3f} M",
            f"{training[i] / training[0]:.3f}x",
            f"{every[i] / 1e6:.3f} M",
            f"{every[i] / every[0]:.3f}x",
        ][:columns]
        for i, name in enumerate(names)
    ]
    lines = table(header, rows, markdown=markdown)
    return "\n".join([f"**{title}**", "", *lines] if markdown else [title, *lines])


def main() -> None:
    arguments = parser(__doc__)
    add_size(arguments)
    arguments.add_argument("--steps", type=int, default=STEPS, help="steps counted")
    arguments.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    arguments.add_argument(
        "--training-thread-only",
        action="store_true",
        help="count the training thread alone (half the processes: no all-threads column)",
    )
    arguments.add_argument("--_child", help=argparse.SUPPRESS)
    args = arguments.parse_args()
    if args._child:
        _child(args.size, args._child, args.steps)
        return
    print(bench(args.size, args.steps, args.markdown, not args.training_thread_only))


if __name__ == "__main__":
    main()
