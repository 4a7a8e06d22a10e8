"""What entering a tracer costs: `ModelTracer(...)` and `start()` on the 4-layer benchmark model.

Usage::

    python tools/bench_start.py                  # tiny model, TRACED_PATHS, 20 rounds
    python tools/bench_start.py --size small --rounds 50

In one fresh process: the time of `import vartrace` and the first `vartrace.ModelTracer`
(its modules), then, per round, the time of building a tracer (resolving the patterns)
and of `start()` (patching the methods, the hooks, the staging), their medians and the
first round's, and whether `torch._dynamo` got imported (it should not be, since no
model here is compiled: importing it costs seconds of CPU).  A full garbage collection
(generation 2: a pass over every object torch made, 0.1-0.4 s) falls due by allocation
counts wherever the program stands then, the first `start()` too: the time it takes
inside `start()` is printed apart.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

from _model import TRACED_PATHS, add_size, build_model


class _Collections:
    """The time the garbage collector spent in full (generation 2) passes."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


def main() -> None:
    parsed = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size(parsed)
    parsed.add_argument("--rounds", type=int, default=20)
    args = parsed.parse_args()

    collections = _Collections()
    gc.callbacks.append(collections)
    began = time.perf_counter()
    import vartrace

    tracer_class = vartrace.ModelTracer
    imported = time.perf_counter() - began
    model, tokens = build_model(args.size)
    builds, starts, stops, collected = [], [], [], []
    for _ in range(args.rounds):
        began = time.perf_counter()
        tracer = tracer_class(model, TRACED_PATHS)
        built = time.perf_counter()
        collections.seconds = 0.0
        tracer.start()
        started = time.perf_counter()
        collected.append(collections.seconds)
        model(tokens)
        stopping = time.perf_counter()
        tracer.stop()
        stops.append(time.perf_counter() - stopping)
        builds.append(built - began)
        starts.append(started - built)
    print(f"import vartrace + ModelTracer: {imported * 1e3:.0f} ms")
    for name, times in (("ModelTracer(...)", builds), ("start()", starts), ("stop()", stops)):
        print(
            f"{name}: first {times[0] * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms"
        )
    print(
        f"full garbage collections inside start(): {sum(c > 0 for c in collected)} of "
        f"{args.rounds} rounds, {max(collected) * 1e3:.1f} ms at most (Python's own pass over "
        "every object, due whatever runs then)"
    )
    print(f"torch._dynamo imported: {'torch._dynamo' in sys.modules}")


if __name__ == "__main__":
    main()
