"""Fixtures for the torch-free engine tests: every frame core this Python has."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from vartrace.engine import patching
from vartrace.engine.frames import FrameCore, MonitoringCore, SettraceCore

CORES = [SettraceCore] + ([MonitoringCore] if hasattr(sys, "monitoring") else [])


@pytest.fixture(params=CORES, ids=lambda c: c.name)
def core(request: pytest.FixtureRequest) -> Iterator[FrameCore]:
    """Run the test under one frame core, restoring the default afterwards."""
    previous = patching.core()
    chosen = request.param()
    patching.set_core(chosen)
    yield chosen
    patching.set_core(previous)
