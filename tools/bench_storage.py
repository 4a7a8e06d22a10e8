"""HDF5 storage benchmarks: append throughput against the raw floor, memory of long runs, step cost.

Usage::

    python tools/bench_storage.py throughput   # saver vs numpy tofile, with and without compression
    python tools/bench_storage.py memory       # peak RSS of 200 vs 2000 streamed iterations
    python tools/bench_storage.py overhead --size small   # training step traced into HDF5
    python tools/bench_storage.py pagecache    # what the kernel charges per MiB as a file grows
    python tools/bench_storage.py size         # file bytes against record bytes, compressed too
    python tools/bench_storage.py sites --sites 10000 --steps 8   # many sites: saver vs
                                                  # plain h5py, then open + list the run
    python tools/bench_storage.py sites --instructions   # the same, in callgrind's instructions

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
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _harness import REPO, bytes_text, fresh, last_int, parser, rotated
from _model import TRACED_PATHS, add_size, build_model
from _storage import GATHER
from _storage.sites import bench_sites, bench_sites_instructions, sites_child
from _storage.size import bench_size

_STATISTICS = "HDF5 statistics (vartrace.stats())"


def _capture(size: str, which: str, steps: int) -> list[object]:
    """Float32 activations of a few training steps of the benchmark GPT."""
    import torch

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
                    for name in rotated(names, round_):
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
sys.path[:0] = [{tools!r}, {root!r}]
from _model import build_model, TRACED_PATHS
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
                    tools=str(REPO / "tools"),
                    root=str(REPO),
                    path=str(Path(folder) / "run.h5"),
                    iterations=count,
                    contender=contender,
                )
                peaks.append(last_int(fresh(["-c", code])) / 1024)
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
        lines.append(f"{name:<48} {bytes_text(size):>10} {whole / size:9.0f}x smaller")
    return "\n".join(lines)


def main() -> None:
    arguments = parser(__doc__, rounds=5)
    arguments.add_argument(
        "mode", choices=["throughput", "memory", "overhead", "pagecache", "size", "sites"]
    )
    add_size(arguments)
    arguments.add_argument(
        "--mib", type=int, default=256, help="throughput: MiB per measurement; pagecache: in all"
    )
    arguments.add_argument(
        "--no-fsync", action="store_true", help="throughput: leave out the final fsync"
    )
    arguments.add_argument("--block", type=int, default=16, help="overhead: steps per block")
    arguments.add_argument("--counts", default="200,2000", help="memory: iteration counts")
    arguments.add_argument("--sites", type=int, default=1000, help="sites: sites written")
    arguments.add_argument("--steps", type=int, default=32, help="sites: steps (records a site)")
    arguments.add_argument(
        "--instructions", action="store_true", help="sites: count instructions under callgrind"
    )
    arguments.add_argument(
        "--_sites-child", nargs=3, metavar=("CONTENDER", "SITES", "STEPS"), help=argparse.SUPPRESS
    )
    arguments.add_argument(
        "--compressions",
        help="comma-separated compression names (vartrace.storage.COMPRESSIONS, gzip, lzf); "
        "default: blosc,blosc2,blosc2-zstd,lzf,gzip for throughput, blosc,gzip,lzf for size, "
        "blosc for overhead",
    )
    args = arguments.parse_args()
    if args._sites_child:
        name, sites, steps = args._sites_child
        sites_child(name, int(sites), int(steps))
        return
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
    elif args.mode == "sites" and args.instructions:
        print(bench_sites_instructions(args.sites, args.steps))
    elif args.mode == "sites":
        print(bench_sites(args.sites, args.steps, args.rounds))
    elif args.mode == "memory":
        print(bench_memory([int(count) for count in args.counts.split(",")]))
    else:
        print(bench_overhead(args.size, args.rounds, args.block, compressions))


if __name__ == "__main__":
    main()
