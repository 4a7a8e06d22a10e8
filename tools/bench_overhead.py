"""Overhead of tracing a training step, as ratios to an untraced step in the same process.

Usage::

    python tools/bench_overhead.py --size tiny      # Python-bound step (stands in for a GPU step)
    python tools/bench_overhead.py --size small     # compute-bound step
    python tools/bench_overhead.py --engine         # torch-free: settrace vs sys.monitoring core
    python tools/bench_overhead.py --hf             # tiny HF GPT-2: ** against an explicit path
    python tools/bench_overhead.py --markdown       # the table as Markdown, for the README
    python tools/bench_overhead.py --profile 2000   # cProfile of 2000 traced tiny steps
    python tools/bench_overhead.py --breakdown      # vartrace's cost above the floor, by layer
    python tools/bench_overhead.py --loop           # the same in a tight loop, for A/B tests
    python tools/bench_overhead.py --instructions   # instructions per tiny step, under callgrind
    python tools/bench_overhead.py --instructions --breakdown   # the breakdown, in instructions

Contenders run round-robin (a block of steps each, many rounds) so that
machine noise hits them alike; the table shows the median step time and
its ratio to the untraced median.  Traced contenders discard each chunk
after the gather (as the HDF5 saver does), so memory stays flat.

Each vartrace contender has a *bare floor* beside it: a hand-written
capture through the same mechanism as vartrace's frame core on this Python
(a ``sys.monitoring`` ``PY_RETURN`` callback on 3.12+, ``sys.settrace``
return events before) that clones the same variables of the same code
objects and does nothing else.  The floor is what the mechanism itself
costs; the column "extra per record" is vartrace's time above its floor,
per record it keeps in a step.

``--instructions`` counts instead of timing: each contender runs in its own
process under ``valgrind --tool=callgrind`` (one torch thread,
``PYTHONHASHSEED=0``) with instrumentation off through start-up and warm-up;
the parent switches it on (``callgrind_control``) for the measured steps
only, and reads the instructions executed (Ir) from callgrind's output.
The counts do not depend on machine noise, so they show small changes to
the record path that timings cannot.
"""

from __future__ import annotations

import argparse

from _harness import add_threads, parser, set_threads
from _model import TRACED_PATHS, add_size
from _overhead.breakdown import bench_breakdown, bench_loop
from _overhead.instructions import INSTRUCTION_STEPS, bench_instructions, instructions_child
from _overhead.steps import bench_engine, bench_hf, bench_model, profile


def main() -> None:
    arguments = parser(__doc__, rounds=30, block=10)
    add_size(arguments)
    add_threads(arguments)
    arguments.add_argument("--engine", action="store_true", help="torch-free engine comparison")
    arguments.add_argument(
        "--hf", action="store_true", help="tiny transformers GPT-2: ** vs explicit"
    )
    arguments.add_argument(
        "--breakdown", action="store_true", help="vartrace's cost above the floor, by layer"
    )
    arguments.add_argument(
        "--loop", action="store_true", help="the breakdown in a tight loop of traced calls"
    )
    arguments.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    arguments.add_argument(
        "--profile", type=int, default=0, metavar="STEPS", help="cProfile STEPS traced steps"
    )
    arguments.add_argument(
        "--instructions",
        type=int,
        nargs="?",
        const=INSTRUCTION_STEPS,
        default=0,
        metavar="STEPS",
        help=f"count the instructions of STEPS steps under callgrind ({INSTRUCTION_STEPS})",
    )
    arguments.add_argument(
        "--_instructions-child", nargs=2, metavar=("CONTENDER", "STEPS"), help=argparse.SUPPRESS
    )
    args = arguments.parse_args()
    if args.engine:
        print(bench_engine(args.rounds, args.block))
        return
    if args._instructions_child:
        name, steps = args._instructions_child
        instructions_child(args.size, name, int(steps), args.breakdown)
        return
    if args.instructions:
        print(bench_instructions(args.size, args.instructions, args.markdown, args.breakdown))
        return
    set_threads(args.threads)
    if args.hf:
        print(bench_hf(args.rounds, args.block, args.markdown))
        return
    if args.breakdown:
        print(bench_breakdown(args.size, args.rounds, args.block, args.markdown))
        return
    if args.loop:
        print(bench_loop(args.rounds, args.block, args.markdown))
        return
    if args.profile:
        print(profile(args.size, args.profile, TRACED_PATHS))
        return
    print(bench_model(args.size, args.rounds, args.block, args.markdown))


if __name__ == "__main__":
    main()
