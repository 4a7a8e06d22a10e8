"""Peak host memory of tracing large records into HDF5, in gathered chunks.

Usage::

    python tools/bench_host_memory.py                  # 30 MiB records, chunks of 4, 3 runs
    python tools/bench_host_memory.py --runs 5 --change-detection
    python tools/bench_host_memory.py --compression gzip    # a writer slower than the step

A model returns one fresh ``--record-mib`` float32 tensor a step (``x * 1.0001``);
the tracer records it and gathers every ``--every`` steps into
``H5PYSaverCallback``, in the foreground or with ``background=True``.  Each
measurement is a fresh process: it warms the model up untraced (so the heap
already holds the step's own temporaries), resets the kernel's peak resident
size (``/proc/self/clear_refs``), runs ``--steps`` steps and closes the saver,
and reports its peak resident size (``VmHWM``: every page ever touched counts,
no sampling misses a short peak) above its resident size before the steps.
The same loop untraced gives the step's own peak; the table shows, in chunks
(``every * record`` bytes), each mode's peak and its peak above the untraced
median: what tracing adds.  Linux only.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, when tests load this file

from _harness import REPO, fresh, last_int, parser, table

MODES = ("untraced", "foreground", "background")

_CHILD = """
import os, sys, warnings
import torch
from torch import nn
from vartrace import H5PYSaverCallback, ModelTracer

mode, path, record, every, steps, change, compression = sys.argv[1:]
record, every, steps = int(record), int(every), int(steps)

def status(key):
    with open("/proc/self/status") as lines:
        return 1024 * next(int(line.split()[1]) for line in lines if line.startswith(key))

class Big(nn.Module):
    def forward(self, x):
        return x * 1.0001

model, x = Big(), torch.randn(record // 4)
for _ in range(3):
    model(x)
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak resident size starts again from the current one
before = status("VmRSS:")
if mode == "untraced":
    for _ in range(steps):
        x.add_(1e-3)
        model(x)
else:
    saver = H5PYSaverCallback(
        path, background=mode == "background", metadata=False, compression=compression or None
    )
    with ModelTracer(
        model, ["forward"], gathering_interval=every, post_gather_callbacks=[saver],
        change_detection=change == "1",
    ):
        for _ in range(steps):
            x.add_(1e-3)
            model(x)
    saver.close()
print(status("VmHWM:") - before)
"""


def peak_above_start(
    mode: str,
    record: int,
    every: int,
    steps: int,
    change_detection: bool,
    compression: str = "",
) -> int:
    """Bytes of one fresh process's peak resident size above its size before the steps
    (`compression`: the saver's, e.g. `"gzip"`, a writer slower than the step; `""`: none)."""
    with tempfile.TemporaryDirectory() as folder:
        output = fresh(
            [
                "-c",
                _CHILD,
                mode,
                str(Path(folder) / "run.h5"),
                str(record),
                str(every),
                str(steps),
                "1" if change_detection else "0",
                compression,
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    return last_int(output)


def bench(
    record_mib: int,
    every: int,
    steps: int,
    runs: int,
    change_detection: bool,
    compression: str = "",
) -> str:
    """The table: each mode's peak in chunks, min / median / max over `runs` processes
    (`compression`: the saver's, `""`: none)."""
    record = record_mib << 20
    chunk = every * record
    peaks: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(runs):  # modes interleaved: the machine's state hits them alike
        for mode in MODES:
            peaks[mode].append(
                peak_above_start(mode, record, every, steps, change_detection, compression) / chunk
            )
    floor = statistics.median(peaks["untraced"])
    lines = [
        f"{record_mib} MiB records, {every} a gather (chunk {every * record_mib} MiB), "
        f"{steps} steps, change_detection={change_detection}, "
        f"compression={compression or None}, {runs} fresh processes a mode",
    ]
    rows = []
    for mode, values in peaks.items():
        low, middle, high = min(values), statistics.median(values), max(values)
        extra = "" if mode == "untraced" else f"{middle - floor:.2f}x"
        rows.append([mode, f"{low:.2f} / {middle:.2f} / {high:.2f}x", extra])
    header = ["mode", "peak above start, chunks (min / median / max)", "above untraced median"]
    return "\n".join([*lines, *table(header, rows, markdown=True)])


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--record-mib", type=int, default=30, help="MiB of a record")
    arguments.add_argument("--every", type=int, default=4, help="steps a gather")
    arguments.add_argument("--steps", type=int, default=12, help="traced steps a process")
    arguments.add_argument("--runs", type=int, default=3, help="fresh processes a mode")
    arguments.add_argument(
        "--change-detection", action="store_true", help="the tracer's default; off here"
    )
    arguments.add_argument(
        "--compression", default="", help="the saver's, e.g. gzip; none by default"
    )
    args = arguments.parse_args()
    print(
        bench(
            args.record_mib,
            args.every,
            args.steps,
            args.runs,
            args.change_detection,
            args.compression,
        )
    )


if __name__ == "__main__":
    main()
