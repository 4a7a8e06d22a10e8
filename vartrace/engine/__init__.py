"""The tracing engine: the path language, method patching and frame capture.

It knows nothing of torch, so it runs (and is tested) on every supported
Python, with or without torch installed:

* `paths` parses patterns and matches segments;
* `code` reads methods, arguments and locals from classes;
* `structures` splits captured values into leaves;
* `frames` reads a running method's locals
  (`sys.monitoring` on Python >= 3.12, `sys.settrace` before; each core's
  common case in C: `frames/cores.c`);
* `patching` patches methods of single objects;
* `arguments` binds a patched call's arguments to parameter names.
"""

from vartrace.engine.code import MethodInfo, methods_of
from vartrace.engine.frames import (
    FrameCore,
    MonitoringCore,
    SettraceCore,
    default_core,
    set_change_test,
)
from vartrace.engine.patching import Hook, Probe, Selector, attach, core, detach, set_core
from vartrace.engine.paths import Pattern, parse
from vartrace.engine.structures import children, leaves, register_container, select

__all__ = [
    "FrameCore",
    "Hook",
    "MethodInfo",
    "MonitoringCore",
    "Pattern",
    "Probe",
    "Selector",
    "SettraceCore",
    "attach",
    "children",
    "core",
    "default_core",
    "detach",
    "leaves",
    "methods_of",
    "parse",
    "register_container",
    "select",
    "set_change_test",
    "set_core",
]
