"""Frame capture: reading a running method's locals, with one interface and two cores.

A patched method that needs locals at return (or every value a variable
takes) calls the method through `FrameCore.run`, which returns the
method's result and a snapshot of the requested variables as they were
when it returned.  How the frame is observed depends on the Python:

* `MonitoringCore` (Python >= 3.12) enables `sys.monitoring`
  *local* events (`PY_RETURN`, and `LINE` for `@every`) on exactly
  the code objects being traced.  Other code runs at full speed, and the
  `sys.settrace` / `sys.monitoring` use of other tools is untouched.
* `SettraceCore` (older Pythons) arms `sys.settrace` only until the
  traced call's frame starts (for its whole duration with `@every` or
  callees), chains
  every event to the trace function already installed (a debugger,
  coverage.py), and reads the locals from the finished frame afterwards.

Both cores leave other tools' state alone: the `sys.monitoring` tool ids
that Python assigns to debuggers, coverage, profilers and optimizers are
taken only when the free ones are not, and a trace function that another
tool installs during a traced call (`breakpoint()`) stays installed.

A frame is recognised as the traced call when its code object is the
method's and its caller chain reaches the `run` frame
(through at most a few decorator frames, never through another frame of
the same code): calls of the same code on untraced instances, or nested
recursive calls, are not mistaken for it.

*Callees* are plain functions the traced method calls (Hugging Face's
`eager_attention_forward`), each described by a `Callee`: a frame
of a callee's code whose caller is the traced call's frame is read when it
returns (and on each line for `@every`), once per call, and handed to the
callee's callbacks at once.

A line event comes before its line runs: the values `@every` finds changed
there were bound (or changed in place) by the line that ran before it, which
`binding_line` names while a line callback runs.  The values found at
return belong to the last line that ran; arguments (and other names bound
before the first line) to the function's first line (`co_firstlineno`).
"""

from __future__ import annotations

import sys

from vartrace.engine.frames.bindings import binding_line, set_change_test
from vartrace.engine.frames.monitoring import MonitoringCore
from vartrace.engine.frames.settrace import SettraceCore
from vartrace.engine.frames.watch import Callee, FrameCore

__all__ = [
    "Callee",
    "FrameCore",
    "MonitoringCore",
    "SettraceCore",
    "binding_line",
    "default_core",
    "set_change_test",
]


def default_core() -> FrameCore:
    """The best core for this Python: `sys.monitoring` where it exists."""
    return MonitoringCore() if hasattr(sys, "monitoring") else SettraceCore()
