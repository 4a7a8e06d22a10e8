"""Fixtures for the torch-free engine tests: every frame core this Python has."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator

import pytest

from vartrace.engine import patching
from vartrace.engine.frames import FrameCore, MonitoringCore, SettraceCore

#: Each frame core by name; the settrace core's common case in C (where it builds) and in Python.
CORES: dict[str, Callable[[], FrameCore]] = {
    "settrace": SettraceCore,
    "settrace-python": functools.partial(SettraceCore, compiled=False),
    **({"monitoring": MonitoringCore} if hasattr(sys, "monitoring") else {}),
}


@pytest.fixture(params=list(CORES))
def core(request: pytest.FixtureRequest) -> Iterator[FrameCore]:
    """Run the test under one frame core, restoring the default afterwards."""
    previous = patching.core()
    chosen = CORES[request.param]()
    patching.set_core(chosen)
    yield chosen
    patching.set_core(previous)
