"""What entering a tracer costs: `ModelTracer(...)` and `start()` on the 4-layer benchmark model.

Usage::

    python tools/bench_start.py                  # tiny model, TRACED_PATHS, 20 rounds
    python tools/bench_start.py --size small --rounds 50

In one fresh process: the time of `import vartrace` and the first `vartrace.ModelTracer`
(its modules), then, per round, the time of building a tracer (resolving the patterns)
and of `start()` (patching the methods, the hooks, the staging), their medians and the
first round's, and whether `torch._dynamo` got imported (it should not be, since no
model here is compiled: importing it costs seconds of CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _model import TRACED_PATHS, add_size, build_model


def main() -> None:
    parsed = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size(parsed)
    parsed.add_argument("--rounds", type=int, default=20)
    args = parsed.parse_args()

    began = time.perf_counter()
    import vartrace

    tracer_class = vartrace.ModelTracer
    imported = time.perf_counter() - began
    model, tokens = build_model(args.size)
    builds, starts, stops = [], [], []
    for _ in range(args.rounds):
        began = time.perf_counter()
        tracer = tracer_class(model, TRACED_PATHS)
        built = time.perf_counter()
        tracer.start()
        started = time.perf_counter()
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
    print(f"torch._dynamo imported: {'torch._dynamo' in sys.modules}")


if __name__ == "__main__":
    main()
