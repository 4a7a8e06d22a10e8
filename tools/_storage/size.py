"""``bench_storage.py size``: file bytes against record bytes, for short, long, ragged and
statistics runs, uncompressed and with each compression."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import bytes_text

from _storage import GATHER

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
        files = " ".join(f"{bytes_text(size):>10} {size / data:6.2f}x" for size in sizes)
        return f"{label:<68} {bytes_text(data):>9} {files}"

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
