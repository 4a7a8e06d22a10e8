"""A traced method run under another tool (coverage.py, pdb), as a script of its own.

``python tests/engine/_scenario.py CORE [debug] [every]`` traces
``Worker.step`` (``y`` at return, and ``acc`` on every line with ``every``)
under the frame core ``CORE`` (a name of ``tests/engine/_cores.py``), calls it
twice, and prints one JSON line ``RECORDS {...}``: what was captured, and
the trace function and ``sys.monitoring`` tools in place at the end.  With
``debug`` the method calls ``breakpoint()`` on its first call;
:data:`AFTER_CALL` is the line where a debugger can stop again once the
method has returned.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.engine._cores import CORES
from vartrace.engine import Hook, Probe, Selector, attach, detach, methods_of, parse, set_core

AFTER_CALL = 'outcome = "after"'


class Worker:
    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def step(self, x: int) -> int:
        acc = 0
        for i in range(x):
            acc = acc + i
        if self.debug:
            self.debug = False
            breakpoint()
        y = acc * 10
        z = y + 1
        return z


def _selector(variable: str) -> Selector:
    pattern = parse(f"step.{variable}")
    states = pattern.step(pattern.step(pattern.start, "step"), variable)
    return Selector(variable, f"step.{variable}", pattern, states)


def main(core: str, debug: bool, every: bool) -> None:
    set_core(CORES[core]())
    records: dict[str, list[Any]] = {}

    def sink(site: str, value: Any, grad: bool) -> None:
        records.setdefault(site, []).append(value)

    worker = Worker(debug)
    probe = Probe(exit=(_selector("y"),), every=(_selector("acc"),) if every else ())
    hook = Hook(probe, sink)
    attach(worker, "step", methods_of(Worker)["step"].code, hook)
    worker.step(4)
    outcome = "after"
    worker.step(3)
    detach(worker, "step", hook)
    monitoring = getattr(sys, "monitoring", None)
    state = {
        "records": records,
        "outcome": outcome,
        "trace": repr(sys.gettrace()),
        "tools": [monitoring.get_tool(i) for i in range(6)] if monitoring else [],
    }
    print("RECORDS", json.dumps(state))


if __name__ == "__main__":
    main(sys.argv[1], debug="debug" in sys.argv[2:], every="every" in sys.argv[2:])
