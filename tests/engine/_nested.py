"""Nested traced calls: a traced method calling another traced method, as a script of its own.

``Outer.step`` calls ``Inner.step`` (whose local ``y`` is read at return)
and the function ``_scale``; the outer method itself is traced in one of
three ways (:data:`VARIANTS`): ``plain`` (its local ``total`` at return),
``every`` (``total`` on every line) or ``callee`` (``_scale``'s local
``scaled``).  :func:`run_variant` runs one under the installed frame core
and returns what was captured; :data:`EXPECTED` is what that must be.

``python tests/engine/_nested.py CORE`` runs every variant under the frame
core ``CORE`` (``settrace`` or ``monitoring``) and prints one JSON line
``RECORDS {...}``: the records per variant and the trace function in
place at the end (run under ``coverage run`` by the tests).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vartrace.engine import Hook, Probe, Selector, attach, detach, methods_of, parse, set_core
from vartrace.engine.frames import MonitoringCore, SettraceCore

VARIANTS = ("plain", "every", "callee")
_INNER = {"inner.y": [1, 2, 3, 1, 2, 3]}
EXPECTED: dict[str, dict[str, list[int]]] = {
    "plain": {**_INNER, "outer.total": [36, 36]},
    "every": {**_INNER, "outer.total": [0, 2, 6, 12, 36, 0, 2, 6, 12, 36]},
    "callee": {**_INNER, "outer>_scale.scaled": [36, 36]},
}


def _scale(value: int) -> int:
    scaled = value * 3
    return scaled


class Inner:
    def step(self, x: int) -> int:
        y = x + 1
        return y * 2


class Outer:
    def __init__(self) -> None:
        self.inner = Inner()

    def step(self, n: int) -> int:
        total = 0
        for i in range(n):
            total = total + self.inner.step(i)
        total = _scale(total)
        return total


def _selector(site: str, variable: str, callee: Any = None) -> Selector:
    pattern = parse(site)
    states = pattern.step(pattern.step(pattern.start, site.rpartition(".")[0]), variable)
    return Selector(variable, site, pattern, states, callee=callee)


def run_variant(variant: str) -> dict[str, list[Any]]:
    """Trace ``Outer.step`` as ``variant`` says and ``Inner.step``'s ``y``; call it twice."""
    records: dict[str, list[Any]] = {}

    def sink(site: str, value: Any, grad: bool) -> None:
        records.setdefault(site, []).append(value)

    outer = Outer()
    if variant == "callee":
        (callee,) = methods_of(Outer)["step"].callees
        probe = Probe(calls=(_selector("outer>_scale.scaled", "scaled", callee.code),))
    else:
        total = (_selector("outer.total", "total"),)
        probe = Probe(exit=total) if variant == "plain" else Probe(every=total)
    hooks = [
        (outer, Hook(probe, sink)),
        (outer.inner, Hook(Probe(exit=(_selector("inner.y", "y"),)), sink)),
    ]
    for instance, hook in hooks:
        attach(instance, "step", methods_of(type(instance))["step"].code, hook)
    try:
        outer.step(3)
        outer.step(3)
    finally:
        for instance, hook in hooks:
            detach(instance, "step", hook)
    return records


def main(core: str) -> None:
    set_core(SettraceCore() if core == "settrace" else MonitoringCore())
    records = {variant: run_variant(variant) for variant in VARIANTS}
    print("RECORDS", json.dumps({"records": records, "trace": repr(sys.gettrace())}))


if __name__ == "__main__":
    main(sys.argv[1])
