"""What the benchmarks under ``tools/`` share: interleaved timing, tables, callgrind, children.

A benchmark keeps only what it measures: its step, its contenders, the title of its table::

    import contextlib

    from _harness import Context, parser, ratio_table, round_robin, traced

    arguments = parser(__doc__, rounds=30, block=10).parse_args()
    contenders: dict[str, Context] = {
        "untraced": contextlib.nullcontext,
        "vartrace: forward.x": lambda: traced(model, ["forward.x"]),
    }
    times = round_robin(contenders, step, arguments.rounds, arguments.block)
    print(ratio_table("my step, median of interleaved rounds", times))

Contenders are context managers entered around a block of steps; every timing function here
interleaves them (shuffled, rotated or alternated round by round) so that machine noise hits
them alike, and compares them with the untraced run of the same process.  Importing this
module puts the checkout first on ``sys.path``: the tools measure the ``vartrace`` beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

Context = Callable[[], contextlib.AbstractContextManager[Any]]
T = TypeVar("T")

# -- interleaving ---------------------------------------------------------------------------


def round_robin(
    contenders: Mapping[str, Context],
    step: Callable[[], None],
    rounds: int,
    block: int,
    summary: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Seconds of ``step`` under each contender's context (the ``summary`` of all samples,
    by default their median), interleaved round-robin.

    The order of the contenders is shuffled every round, so that none always
    runs first after the untraced step (or last before it), and the first step
    after entering a context is a warm-up, not timed.
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            with contenders[name]():
                step()
                for _ in range(block):
                    start = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - start)
    return {name: summary(samples) for name, samples in times.items()}


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in round ``round_``'s order: rotated by one each round, so that each
    contender runs first in turn."""
    shift = round_ % len(items)
    return [*items[shift:], *items[:shift]]


def alternated(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in round ``round_``'s order: as given, reversed every other round."""
    return list(items) if round_ % 2 == 0 else list(items)[::-1]


def timed_calls(calls: Mapping[str, Callable[[], object]], budget: float) -> dict[str, float]:
    """Median seconds of each call, the calls interleaved round by round (so that load
    from elsewhere hits them alike) for about ``budget`` seconds (3 rounds at least)."""
    start = time.perf_counter()
    for call in calls.values():
        call()
    once = time.perf_counter() - start
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(3, min(100, int(budget / max(once, 1e-9))))):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


# -- contenders -----------------------------------------------------------------------------


def discard(name: str, trace: Any) -> None:
    """A post-gather callback that empties each chunk, as a saver does after writing it."""
    trace.clear()


@contextlib.contextmanager
def traced(model: object, paths: list[str], **options: Any) -> Iterator[None]:
    """A tracer that discards each chunk after the gather (as the HDF5 saver does).

    Patterns that record nothing on purpose (an idle contender's, or a method
    the model never calls) are not reported.
    """
    from vartrace import ModelTracer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*recorded nothing")
        with ModelTracer(model, paths, post_gather_callbacks=[discard], **options):  # type: ignore[arg-type]
            yield


# -- tables ---------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``seconds`` in ms, or in µs below a millisecond (written ``us``)."""
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} us"


def bytes_text(count: float) -> str:
    """``count`` bytes in B, KiB or MiB (``12 B``, ``3.4 KiB``, ``1024.0 MiB``)."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024 or unit == "MiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def versions(threads: bool = False) -> str:
    """``Python 3.x.y, torch 2.x`` (and torch's thread count): for a table's title."""
    import torch

    text = f"Python {sys.version.split()[0]}, torch {torch.__version__}"
    return f"{text}, {torch.get_num_threads()} threads" if threads else text


def table(
    header: list[str], rows: list[list[str]], left: Iterable[int] = (0,), markdown: bool = False
) -> list[str]:
    """The lines of a table: columns aligned, the ``left`` ones to the left, the others to
    the right; or a Markdown table with the same alignment."""
    aligned_left = {i % len(header) for i in left}
    if markdown:
        rule = ["---" if i in aligned_left else "---:" for i in range(len(header))]
        cells = ["| " + " | ".join(row) + " |" for row in rows]
        return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|", *cells]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            f"{cell:<{w}}" if i in aligned_left else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(row) for row in [header, *rows]]


def ratio_table(
    title: str,
    costs: Mapping[str, float],
    base: str = "untraced",
    extra: Mapping[str, str] | None = None,
    markdown: bool = False,
    unit: Callable[[float], str] = duration,
) -> str:
    """Each contender's cost of a step and its ratio to contender ``base``'s.

    The cost is in seconds, or what ``unit`` formats.  ``extra`` maps a
    contender to the text of a last column, "extra per record" (blank for others).
    """
    extra = extra or {}
    header = ["contender", "step", "ratio", *(["extra per record"] if extra else [])]
    rows = [
        [name, unit(cost), f"{cost / costs[base]:.3f}x", *([extra.get(name, "")] if extra else [])]
        for name, cost in costs.items()
    ]
    lines = table(header, rows, markdown=markdown)
    return "\n".join([f"**{title}**", "", *lines] if markdown else [title, *lines])


# -- processes ------------------------------------------------------------------------------


def fresh(argv: list[str], **options: Any) -> str:
    """What a fresh Python process running ``argv`` prints (it must succeed); ``options``
    go to :func:`subprocess.run` (``env``, ``cwd``)."""
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, check=True, **options
    )
    return done.stdout


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def last_int(output: str) -> int:
    """The last word of ``output``, a number (what a child measured of itself)."""
    return int(output.split()[-1])


# -- instructions ---------------------------------------------------------------------------


def need_callgrind(control: bool = False) -> None:
    """Exit unless valgrind (and, with ``control``, ``callgrind_control``) is installed."""
    if control and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("--instructions needs valgrind's callgrind and callgrind_control")
    if not shutil.which("valgrind"):
        sys.exit("--instructions needs valgrind")


def handshake() -> None:
    """A child's side of :func:`instructions` with ``switched`` (and of
    :func:`instructions_by_window`): tell the parent that this child is at an edge of a
    measured part, and wait for it."""
    print("ready", flush=True)
    sys.stdin.readline()


def instructions(
    argv: list[str],
    out: Path,
    env: Mapping[str, str],
    switched: bool = False,
    main_thread: bool = False,
) -> int:
    """Instructions (callgrind's Ir) a fresh Python process running ``argv`` executes,
    callgrind's output written to ``out``.

    ``switched``: instrumentation starts off; the child calls :func:`handshake` at both
    edges of what it measures, and the parent switches instrumentation on at the first and
    off at the second (``callgrind_control``), so start-up, warm-up and exit are not counted.
    ``main_thread``: count the process's main thread alone (``--separate-threads=yes``:
    callgrind writes a file a thread, ``out`` then the main thread's).
    """
    if switched:
        return instructions_by_window(argv, out, env, 1, main_thread)[0]
    _run_callgrind(["valgrind", "--tool=callgrind"], argv, out, env, windows=0)
    return _totals(out)


def instructions_by_window(
    argv: list[str], out: Path, env: Mapping[str, str], windows: int, main_thread: bool = False
) -> list[int]:
    """The instructions of each of ``windows`` measured parts of one fresh Python process
    running ``argv``: :func:`instructions` with ``switched``, the child calling
    :func:`handshake` at both edges of each part, one dump a part (``out.1``, ``out.2`` ...).

    One process for several counts: importing torch under callgrind costs far more CPU
    than most of what is measured.
    """
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    command += ["--separate-threads=yes"] if main_thread else []
    _run_callgrind(command, argv, out, env, windows)
    # callgrind numbers the files of the threads when they are apart: the main thread is 1.
    thread = "-01" if main_thread else ""
    return [_totals(out.with_name(f"{out.name}.{n}{thread}")) for n in range(1, windows + 1)]


def _run_callgrind(
    command: list[str], argv: list[str], out: Path, env: Mapping[str, str], windows: int
) -> None:
    """Run ``argv`` under ``command``; switch instrumentation on and off around each of
    ``windows`` parts the child marks with :func:`handshake`, dumping the counts of each."""
    command = [*command, f"--callgrind-out-file={out}", sys.executable, *argv]
    with (
        tempfile.TemporaryFile("w+") as log,
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=dict(env),
        ) as child,
    ):
        assert child.stdin and child.stdout
        for switch in ("on", "off") * windows:
            if child.stdout.readline() != "ready\n":
                break
            control = ["callgrind_control", f"--instr={switch}", str(child.pid)]
            subprocess.run(control, check=True, capture_output=True)
            if switch == "off":
                dump = ["callgrind_control", "--dump", str(child.pid)]
                subprocess.run(dump, check=True, capture_output=True)
            child.stdin.write("go\n")
            child.stdin.flush()
        child.stdout.read()
        if child.wait():
            log.seek(0)
            raise RuntimeError(
                f"{' '.join(argv)}: the callgrind child failed\n{log.read()[-4000:]}"
            )


def _totals(out: Path) -> int:
    """The instructions a callgrind output file counts."""
    # "totals:", not "summary:", which callgrind leaves at 0 when instrumentation starts off.
    lines = out.read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith("totals:")))


# -- command lines --------------------------------------------------------------------------


def parser(doc: str | None, rounds: int = 0, block: int = 0) -> argparse.ArgumentParser:
    """A command line described by the first line of ``doc``; with ``rounds`` (and
    ``block``), ``--rounds`` (``--block``) with those defaults."""
    parsed = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    if rounds:
        parsed.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds")
    if block:
        parsed.add_argument(
            "--block", type=int, default=block, help="steps timed per contender a round"
        )
    return parsed


def add_threads(parsed: argparse.ArgumentParser, default: int = 0) -> None:
    """``--threads``: torch's intra-op threads (0: torch's default); see :func:`set_threads`."""
    parsed.add_argument(
        "--threads", type=int, default=default, help="torch threads (0: torch's default)"
    )


def set_threads(threads: int) -> None:
    """Set torch's intra-op threads, unless ``threads`` is 0."""
    if threads:
        import torch

        torch.set_num_threads(threads)
