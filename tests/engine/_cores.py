"""Every frame core this Python has, by name: each core's common case in C (where it
builds) and in Python (`-python`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from vartrace.engine.frames import FrameCore, MonitoringCore, SettraceCore

CORES: dict[str, Callable[[], FrameCore]] = {
    "settrace": SettraceCore,
    "settrace-python": functools.partial(SettraceCore, compiled=False),
}
if hasattr(sys, "monitoring"):
    CORES["monitoring"] = MonitoringCore
    CORES["monitoring-python"] = functools.partial(MonitoringCore, compiled=False)
