"""Fixtures for the torch-free engine tests: every frame core this Python has."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine._cores import CORES
from vartrace.engine import patching
from vartrace.engine.frames import FrameCore


@pytest.fixture(params=list(CORES))
def core(request: pytest.FixtureRequest) -> Iterator[FrameCore]:
    """Run the test under one frame core, restoring the default afterwards."""
    previous = patching.core()
    chosen = CORES[request.param]()
    patching.set_core(chosen)
    yield chosen
    patching.set_core(previous)
