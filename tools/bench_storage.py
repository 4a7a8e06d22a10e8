"""HDF5 storage benchmarks: append throughput against the raw floor, memory of long runs, step cost.

Usage::

    python tools/bench_storage.py throughput   # saver vs numpy tofile, with and without compression
    python tools/bench_storage.py memory       # peak RSS of 200 vs 2000 streamed iterations
    python tools/bench_storage.py overhead --size small   # training step traced into HDF5
    python tools/bench_storage.py pagecache    # what the kernel charges per MiB as a file grows
    python tools/bench_storage.py size         # file bytes against record bytes, compressed too
    python tools/bench_storage.py sites --sites 10000 --steps 8   # many sites: saver vs
                                                  # plain h5py, then open + list the run

``throughput`` writes the same records (float32 tensors captured from the GPT
of ``tools/bench_overhead.py``) through ``H5PYSaverCallback`` in gathers of 8,
flushing after each, and with ``numpy.ndarray.tofile``; both end with an
fsync (unless ``--no-fsync``: then the page cache is the limit, which shows
the saver's CPU cost) and are timed end to end.  Every round runs each
contender once, in a rotating order, and the best round of each is shown;
the compressed contenders run in rounds of their own after the raw floor and
the uncompressed saver, because on a shared virtual machine a write right
after a CPU-heavy compressor runs several times slower.  ``stored`` is the
bytes of the records divided by the bytes of the file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import TRACED_PATHS

GATHER = 8
_STATISTICS = "HDF5 statistics (vartrace.stats())"


def _capture(size: str, which: str, steps: int) -> list[object]:
    """Float32 activations of a few training steps of the benchmark GPT."""
    import torch
    from bench_overhead import build_model

    model, tokens = build_model(size)
    owners = [block.attn if which == "scores" else block.mlp for block in model.layers]
    for owner in owners:
        owner.floor = []
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
    return [record for owner in owners for record in owner.floor]


def _datasets() -> dict[str, list[object]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    scores = _capture("small", "scores", 4)
    gelu = _capture("small", "mlp", 2)
    return {
        "tiny scores (2,4,32,32) 32 KiB": _capture("tiny", "scores", 8),
        "small scores (8,4,128,128) 2 MiB": scores,
        "softmax(small scores) 2 MiB": [s.softmax(-1) for s in scores],
        "small mlp gelu (8,128,1024) 4 MiB": gelu,
        "gelu at bf16 precision, f32 4 MiB": [h.bfloat16().float() for h in gelu],
        "random normal (8,4,128,128) 2 MiB": [
            torch.randn(8, 4, 128, 128, generator=generator) for _ in range(16)
        ],
    }


def _raw(records: list[object], path: Path, count: int, sync: bool) -> None:
    arrays = [record.numpy() for record in records]  # type: ignore[attr-defined]
    with open(path, "wb") as handle:
        for index in range(count):
            arrays[index % len(arrays)].tofile(handle)
        handle.flush()
        if sync:
            os.fsync(handle.fileno())


def _saver(
    records: list[object], path: Path, count: int, compression: str | None, sync: bool
) -> None:
    from vartrace.storage import H5PYSaverCallback
    from vartrace.trace import Trace

    with H5PYSaverCallback(path, overwrite=True, metadata=False, compression=compression) as saver:
        for start in range(0, count, GATHER):
            trace = Trace()
            for index in range(start, min(start + GATHER, count)):
                trace.append(records[index % len(records)], index // GATHER + 1, 0, index)
            saver("layers.0.attn.forward.scores", trace)
            saver.flush()
    if sync:
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())


#: Runs for ``size``: label -> (iterations, records a gather, {site: record shape}), float32.
SIZE_RUNS: dict[str, tuple[int, int, dict[str, tuple[int, ...]]]] = {
    "36 tiny records (4 scalar sites x 9 steps, gather every step)": (
        9,
        1,
        {f"loss{i}": () for i in range(4)},
    ),
    "quickstart --steps 20 (one gather at the end)": (
        20,
        25,
        {
            "tokens": (32, 8),
            "scores0": (32, 4, 8, 8),
            "scores1": (32, 4, 8, 8),
            "h0": (3,),
            "h1": (3,),
            "loss": (),
        },
    ),
    "quickstart --steps 60 (gather every 25 steps)": (
        60,
        25,
        {
            "tokens": (32, 8),
            "scores0": (32, 4, 8, 8),
            "scores1": (32, 4, 8, 8),
            "h0": (3,),
            "h1": (3,),
            "loss": (),
        },
    ),
    "100 KiB records, 5 sites x 20 steps, gather every 8": (
        20,
        8,
        {f"act{i}": (25, 1024) for i in range(5)},
    ),
    "100 sites x 4 KiB x 16 steps, gather every step": (
        16,
        1,
        {f"site{i}": (1024,) for i in range(100)},
    ),
    "long run: 2,000 steps of 32 KiB and scalar records, gather every 8": (
        2000,
        8,
        {"scores": (32, 4, 8, 8), "loss": ()},
    ),
}

#: Sites whose record shape changes between steps: label -> the shape of each step's record,
#: one gather a step.
RAGGED_RUNS: dict[str, list[tuple[int, ...]]] = {
    "ragged: (256, 1) then (1, 256)": [(256, 1), (1, 256)],
    "ragged: (4096, 1) then (1, 4096)": [(4096, 1), (1, 4096)],
    "ragged: prefill (1,4,128,128) + 32 decode steps (1,4,1,129..160)": [
        (1, 4, 128, 128),
        *((1, 4, 1, 129 + step) for step in range(32)),
    ],
    "ragged: L x 512, L from 16 to 496 (20 steps)": [
        (16 + (step * 197) % 481, 512) for step in range(20)
    ],
}


def _activation(shape: tuple[int, ...], seed: int) -> Any:
    """Float32 values at bfloat16 precision (as activations of a bf16 model are): compressible."""
    import numpy as np

    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)


def _write_steps(
    path: Path, compression: str | None, steps: list[dict[str, Any]], gather: int
) -> None:
    """Write ``steps`` ({site: record} each) through the saver, flushing every ``gather`` steps."""
    from vartrace.storage import H5PYSaverCallback
    from vartrace.trace import Trace

    names = list(dict.fromkeys(name for step in steps for name in step))
    with H5PYSaverCallback(path, overwrite=True, metadata=False, compression=compression) as saver:
        for start in range(0, len(steps), gather):
            for order, name in enumerate(names):
                trace = Trace()
                for index in range(start, min(start + gather, len(steps))):
                    if name in steps[index]:
                        trace.append(steps[index][name], index + 1, 0, index * len(names) + order)
                if len(trace):
                    saver(name, trace)
            saver.flush()


def _writing(path: Path, steps: list[dict[str, Any]], gather: int) -> Callable[[str | None], None]:
    """A function writing ``steps`` to ``path`` with the compression it is given."""
    return lambda compression: _write_steps(path, compression, steps, gather)


def _statistics_run(path: Path, compression: str | None, steps: int) -> int:
    """Trace ``steps`` calls of 8 small blocks as statistics (``vartrace.stats()``,
    gathering_interval 8); returns the records written."""
    import torch

    import vartrace

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x * 1.5)
            return h

    model = torch.nn.Sequential(*(Block() for _ in range(8)))
    generator = torch.Generator().manual_seed(0)
    with (
        vartrace.H5PYSaverCallback(
            path, overwrite=True, metadata=False, compression=compression
        ) as saver,
        vartrace.ModelTracer(
            model,
            ["*.forward.h"],
            pre_save_callbacks=[vartrace.stats()],
            post_gather_callbacks=[saver],
            gathering_interval=GATHER,
        ),
    ):
        for _ in range(steps):
            model(torch.randn(16, 64, generator=generator))
    with vartrace.open(path) as run:
        return sum(len(run[name]) for name in run.names)


def bench_size(compressions: list[str]) -> str:
    """File bytes against record bytes for short and long runs, ragged sites and statistics
    records, uncompressed and with each of ``compressions`` (``metadata=False``)."""
    import numpy as np

    contenders = [None, *compressions]
    header = " ".join(f"{name or 'uncompressed':>19}" for name in contenders)
    lines = [f"{'run':<68} {'records':>9} {header}"]

    def row(label: str, data: float, sizes: list[int]) -> str:
        files = " ".join(f"{_bytes(size):>10} {size / data:6.2f}x" for size in sizes)
        return f"{label:<68} {_bytes(data):>9} {files}"

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "size.h5"

        def sizes(write: Callable[[str | None], None]) -> list[int]:
            found = []
            for compression in contenders:
                write(compression)
                found.append(path.stat().st_size)
            return found

        for label, (steps, gather, sites) in SIZE_RUNS.items():
            values = {
                name: _activation(shape, seed) for seed, (name, shape) in enumerate(sites.items())
            }
            records = [
                {name: value * step for name, value in values.items()}
                for step in range(1, steps + 1)
            ]
            data = steps * sum(value.nbytes for value in values.values())
            lines.append(row(label, data, sizes(_writing(path, records, gather))))
        for label, shapes in RAGGED_RUNS.items():
            records = [{"site": _activation(shape, seed)} for seed, shape in enumerate(shapes)]
            data = sum(4 * int(np.prod(shape)) for shape in shapes)
            files = sizes(_writing(path, records, 1))
            lines.append(row(label, data, files))
            # The fixed cost of a file and its site: one 4-byte record of the same rank.
            single = [{"site": np.zeros((1,) * len(shapes[0]), np.float32)}]
            fixed = sizes(_writing(path, single, 1))
            above = [file - base for file, base in zip(files, fixed, strict=True)]
            lines.append(row("  the same, above a file of one 4-byte record", data, above))
        counts: list[int] = []
        added: list[float] = []
        whole: list[float] = []
        for compression in contenders:
            files = []
            for steps in (10 * GATHER, 50 * GATHER):
                counts.append(_statistics_run(path, compression, steps))
                files.append(path.stat().st_size)
            whole.append(files[1] / counts[-1])
            added.append((files[1] - files[0]) / (counts[-1] - counts[-2]))
        for label, figures in (
            (f"statistics (vartrace.stats()), {counts[-1]} records: file a record", whole),
            (f"statistics: what a record adds ({counts[-2]} -> {counts[-1]} records)", added),
        ):
            per_record = " ".join(f"{size:>17.0f} B" for size in figures)
            lines.append(f"{label:<68} {'':>9} {per_record}")
    return "\n".join(lines)


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024 or unit == "MiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def bench_throughput(total_mib: int, rounds: int, compressions: list[str], sync: bool) -> str:
    data = _datasets()
    ending = "fsync at the end" if sync else "no fsync (page cache only)"
    lines = [
        f"throughput: {total_mib} MiB per measurement, gathers of {GATHER} records, "
        f"best of {rounds} rounds (contenders rotate), {ending}",
        f"{'records':<36} {'contender':<14} {'MiB/s':>8} {'vs raw':>7} {'stored':>7}",
    ]
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        for label, records in data.items():
            nbytes = records[0].numel() * records[0].element_size()  # type: ignore[attr-defined]
            count = max(GATHER, (total_mib << 20) // nbytes)
            written = count * nbytes
            plain: dict[str, Callable[[Path], None]] = {
                "raw tofile": lambda p, r=records, c=count: _raw(r, p, c, sync),
                "saver": lambda p, r=records, c=count: _saver(r, p, c, None, sync),
            }
            compressed: dict[str, Callable[[Path], None]] = {
                name: lambda p, r=records, c=count, n=name: _saver(r, p, c, n, sync)
                for name in compressions
            }
            times: dict[str, list[float]] = {}
            sizes: dict[str, int] = {}
            for contenders in (plain, compressed):  # compressors apart: they slow later writes
                names = list(contenders)
                for round_ in range(rounds + 1):  # round 0 warms up and is not counted
                    for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                        path = directory / f"{name}.bin"
                        start = time.perf_counter()
                        contenders[name](path)
                        if round_:
                            times.setdefault(name, []).append(time.perf_counter() - start)
                        sizes[name] = path.stat().st_size
                        path.unlink()
            raw = min(times["raw tofile"])
            for name in [*plain, *compressed]:
                samples = times[name]
                lines.append(
                    f"{label:<36} {name:<14} {written / min(samples) / 2**20:8.0f} "
                    f"{raw / min(samples):6.2f}x {written / sizes[name]:6.2f}x"
                )
    return "\n".join(lines)


_MEMORY_CHILD = """
import contextlib, resource, sys, torch
sys.path.insert(0, {tools!r})
from bench_overhead import build_model, TRACED_PATHS
from vartrace.tracing.tracer import ModelTracer
contender = {contender!r}
if "h5py" in contender:
    from vartrace.storage import H5PYSaverCallback
torch.set_num_threads(1)
model, tokens = build_model("tiny")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
with contextlib.ExitStack() as stack:
    if contender.startswith("traced into HDF5"):
        callback = stack.enter_context(H5PYSaverCallback({path!r}, overwrite=True))
    else:
        callback = lambda name, trace: trace.clear()
    if contender != "untraced":
        stack.enter_context(ModelTracer(
            model, TRACED_PATHS, post_gather_callbacks=[callback], gathering_interval=8
        ))
    for _ in range({iterations}):
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
_CONTENDERS = (
    "untraced",
    "traced, chunks discarded",
    "traced, discarded, h5py imported",
    "traced into HDF5 (h5py)",
)


def bench_pagecache(total_mib: int) -> str:
    """CPU time of plain ``os.write`` calls of 64 MiB as one file grows: the machine's floor.

    On some virtual machines a file growing into page-cache pages the host has
    not backed yet costs several times what the first writes cost; every
    writer (the saver, ``tofile``) pays it, so it bounds the ``overhead`` mode.
    """
    import numpy as np

    block = np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32)  # 64 MiB
    lines = [f"{'written so far':>15} {'write of 64 MiB':>16} {'CPU':>9} {'per MiB':>9}"]
    with tempfile.TemporaryDirectory() as folder:
        fd = os.open(Path(folder) / "floor.bin", os.O_WRONLY | os.O_CREAT)
        try:
            for index in range(max(1, total_mib // 64)):
                start, cpu = time.perf_counter(), time.process_time()
                os.write(fd, memoryview(block).cast("B"))
                wall, used = time.perf_counter() - start, time.process_time() - cpu
                lines.append(
                    f"{index * 64:>11} MiB {wall * 1e3:>13.1f} ms {used * 1e3:>6.1f} ms "
                    f"{wall * 1e3 / 64:>6.2f} ms"
                )
        finally:
            os.close(fd)
    return "\n".join(lines)


def bench_memory(counts: list[int]) -> str:
    tools = str(Path(__file__).resolve().parent)
    lines = [
        "memory: peak RSS (ru_maxrss) of a fresh process training the tiny GPT, traced "
        f"({', '.join(TRACED_PATHS)}) with gathering_interval=8",
        f"{'contender':<34} " + " ".join(f"{count:>9} it" for count in counts) + "   last/first",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for contender in _CONTENDERS:
            peaks = []
            for count in counts:
                code = _MEMORY_CHILD.format(
                    tools=tools,
                    path=str(Path(folder) / "run.h5"),
                    iterations=count,
                    contender=contender,
                )
                done = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, check=True
                )
                peaks.append(int(done.stdout.split()[-1]) / 1024)
            cells = " ".join(f"{peak:8.1f} MiB" for peak in peaks)
            lines.append(f"{contender:<34} {cells}   {peaks[-1] / peaks[0]:9.3f}x")
    return "\n".join(lines)


class _TofileFloor:
    """A post-gather callback writing the records' bytes with ``tofile``, flushed per gather."""

    def __init__(self, path: Path) -> None:
        self.handle = open(path, "wb")  # noqa: SIM115 - kept open across gathers

    def __call__(self, name: str, trace: Any) -> None:
        for value in trace.values:
            value.numpy().tofile(self.handle)
        trace.clear()

    def flush(self, *, wait: bool = False) -> None:
        self.handle.flush()


def bench_overhead(size: str, rounds: int, block: int, compressions: list[str]) -> str:
    import torch
    from bench_overhead import build_model

    from vartrace import stats
    from vartrace.storage import H5PYSaverCallback
    from vartrace.tracing.tracer import ModelTracer

    model, tokens = build_model(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    paths = ["layers.*.attn.forward.scores"]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()

    with tempfile.TemporaryDirectory() as folder:
        savers = {
            f"HDF5 ({name or 'uncompressed'})": H5PYSaverCallback(
                Path(folder) / f"{name}.h5", compression=name
            )
            for name in [None, *compressions]
        }
        savers["HDF5 (uncompressed, background)"] = H5PYSaverCallback(
            Path(folder) / "background.h5", background=True
        )
        floor = _TofileFloor(Path(folder) / "floor.bin")

        def traced(
            callback: Any, reduce: bool = False
        ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
            @contextlib.contextmanager
            def context() -> Iterator[Callable[[], None]]:
                with ModelTracer(
                    model,
                    paths,
                    pre_save_callbacks=[stats()] if reduce else [],
                    post_gather_callbacks=[callback],
                    gathering_interval=GATHER,
                ):
                    yield getattr(callback, "flush", lambda **_: None)

            return context

        contenders: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
            "untraced": lambda: contextlib.nullcontext(lambda **_: None),
            "scores traced, chunks discarded": traced(lambda name, trace: trace.clear()),
            "scores traced -> raw tofile floor": traced(floor),
        }
        for name, saver in savers.items():
            contenders[f"scores -> {name}"] = traced(saver)
        statistics_saver = H5PYSaverCallback(Path(folder) / "statistics.h5")
        savers[_STATISTICS] = statistics_saver
        contenders[f"scores -> {_STATISTICS}"] = traced(statistics_saver, reduce=True)
        for _ in range(3):
            step()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, context in contenders.items():
                with context() as flush:
                    start = time.perf_counter()
                    for _ in range(block):
                        step()
                    flush(wait=True)  # a background writer's work counts unless it overlapped
                    times[name].append((time.perf_counter() - start) / block)
        for saver in savers.values():
            saver.close()
        floor.handle.close()
        steps = rounds * block
        per_step = {name: os.path.getsize(saver.path) / steps for name, saver in savers.items()}
    base = statistics.median(times["untraced"])
    lines = [
        f"overhead --size {size}: mean step time over blocks of {block} steps (a block spans "
        f"{block // GATHER} gathers, so the writes are included), median of {rounds} rounds, "
        f"gathering_interval={GATHER}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        f"{'contender':<48} {'step':>10} {'ratio':>7}",
    ]
    for name, samples in times.items():
        seconds = statistics.median(samples)
        lines.append(f"{name:<48} {seconds * 1e3:7.2f} ms {seconds / base:6.3f}x")
    whole = per_step["HDF5 (uncompressed)"]
    lines.append(f"file bytes per step ({steps} steps each; {_STATISTICS} against uncompressed)")
    for name, size in per_step.items():
        lines.append(f"{name:<48} {_bytes(size):>10} {whole / size:9.0f}x smaller")
    return "\n".join(lines)


def _sites_raw(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """The floor: every record's bytes through ``os.write``, one file, one write a record."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(0, steps, gather):
            for site in range(sites):
                for step in range(gather):
                    os.write(fd, records[(site + step) % len(records)])
    finally:
        os.close(fd)


def _sites_h5py(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """What a user would write by hand: one chunked dataset a site, resized and written each
    gather, a flush after each gather (the datasets stay open)."""
    import h5py
    import numpy as np

    width = len(records[0])
    with h5py.File(path, "w", libver="latest") as handle:
        datasets = [
            handle.create_dataset(
                f"site{site}",
                (0, width),
                np.float32,
                maxshape=(None, width),
                chunks=(gather, width),
            )
            for site in range(sites)
        ]
        handle.swmr_mode = True
        for start in range(0, steps, gather):
            for site, dataset in enumerate(datasets):
                block = np.stack([records[(site + step) % len(records)] for step in range(gather)])
                dataset.resize(start + gather, axis=0)
                dataset[start : start + gather] = block
            handle.flush()


def _sites_saver(path: Path, records: list[Any], sites: int, steps: int, gather: int) -> None:
    """The saver, called as the tracer calls it: one call a site a gather, a flush a gather."""
    from vartrace.storage import H5PYSaverCallback
    from vartrace.trace import Trace

    names = [f"layers.{site}.forward.x" for site in range(sites)]
    with H5PYSaverCallback(path, overwrite=True, metadata=False) as saver:
        for start in range(0, steps, gather):
            for site, name in enumerate(names):
                trace = Trace()
                for step in range(start, start + gather):
                    record = records[(site + step) % len(records)]
                    trace.append(record, step + 1, 0, step * sites + site)
                saver(name, trace)
            saver.flush()


def _open_and_list(path: Path) -> float:
    """Seconds ``vartrace.open(path)`` and its ``names`` take (the run closed after)."""
    import vartrace

    start = time.perf_counter()
    with vartrace.open(path) as run:
        _ = run.names
        return time.perf_counter() - start


def bench_sites(sites: int, steps: int, rounds: int) -> str:
    """``sites`` sites of one 4 KiB float32 record a step, ``steps`` steps gathered every
    :data:`GATHER`: wall and CPU time of the saver against plain h5py and ``os.write``;
    then the time to open the saver's file and list its sites (``vartrace.open(path).names``)."""
    import numpy as np

    generator = np.random.default_rng(0)
    records = [generator.standard_normal(1024).astype(np.float32) for _ in range(16)]
    contenders: dict[str, Callable[[Path, list[Any], int, int, int], None]] = {
        "raw os.write": _sites_raw,
        "plain h5py": _sites_h5py,
        "vartrace saver": _sites_saver,
    }
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    listing: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        names = list(contenders)
        for round_ in range(rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                path = Path(folder) / "sites.bin"
                start, used = time.perf_counter(), time.process_time()
                contenders[name](path, records, sites, steps, GATHER)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - used)
                if name == "vartrace saver":
                    listing.append(_open_and_list(path))
                path.unlink()
    count = sites * steps
    lines = [
        f"sites: {sites} sites x 4 KiB float32 records x {steps} steps ({count} records), "
        f"gather every {GATHER} steps, flush a gather; min / median / max of {rounds} rounds "
        "(contenders rotate)",
        f"{'contender':<16} {'wall s':>24} {'vs h5py':>21} {'CPU a record':>16}",
    ]
    base = [f(wall["plain h5py"]) for f in (min, statistics.median, max)]
    for name in names:
        spread = [f(wall[name]) for f in (min, statistics.median, max)]
        per = min(cpu[name]) / count * 1e6, statistics.median(cpu[name]) / count * 1e6
        lines.append(
            f"{name:<16} {' / '.join(f'{t:6.2f}' for t in spread)} "
            f"{' / '.join(f'{t / b:5.2f}' for t, b in zip(spread, base, strict=True))}x "
            f"{per[0]:6.0f} / {per[1]:4.0f} µs"
        )
    opened = " / ".join(f"{f(listing):.3f}" for f in (min, statistics.median, max))
    lines.append(f"vartrace.open(path).names of the saver's file: {opened} s (min / median / max)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "mode", choices=["throughput", "memory", "overhead", "pagecache", "size", "sites"]
    )
    parser.add_argument(
        "--mib", type=int, default=256, help="throughput: MiB per measurement; pagecache: in all"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-fsync", action="store_true", help="throughput: leave out the final fsync"
    )
    parser.add_argument("--block", type=int, default=16, help="overhead: steps per block")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--counts", default="200,2000", help="memory: iteration counts")
    parser.add_argument("--sites", type=int, default=1000, help="sites: sites written")
    parser.add_argument("--steps", type=int, default=32, help="sites: steps (records a site)")
    parser.add_argument(
        "--compressions",
        help="comma-separated compression names (vartrace.storage.COMPRESSIONS, gzip, lzf); "
        "default: blosc,blosc2,blosc2-zstd,lzf,gzip for throughput, blosc,gzip,lzf for size, "
        "blosc for overhead",
    )
    args = parser.parse_args()
    default = "blosc,blosc2,blosc2-zstd,lzf,gzip" if args.mode == "throughput" else "blosc"
    compressions = [name for name in (args.compressions or default).split(",") if name]
    if args.mode == "throughput":
        print(bench_throughput(args.mib, args.rounds, compressions, not args.no_fsync))
    elif args.mode == "pagecache":
        print(bench_pagecache(args.mib))
    elif args.mode == "size":
        print(
            bench_size(
                [name for name in (args.compressions or "blosc,gzip,lzf").split(",") if name]
            )
        )
    elif args.mode == "sites":
        print(bench_sites(args.sites, args.steps, args.rounds))
    elif args.mode == "memory":
        print(bench_memory([int(count) for count in args.counts.split(",")]))
    else:
        print(bench_overhead(args.size, args.rounds, args.block, compressions))


if __name__ == "__main__":
    main()
