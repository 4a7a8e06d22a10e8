"""The accelerator record path: one room with one door.

The tracer hands each record of an accelerator tensor to a
`Stager` (`admit`)
and gets it back, in capture order, on the stager's thread.  Behind that door:

* `vartrace.staging.stager`: admission (a device clone, no event, no lock),
  per-step batches, change detection (on the device, within `max_device_bytes`
  of previous records; past it on the host), the copies to the host;
* `vartrace.staging.ring`: the host memory those copies land in, allocated once;
* `vartrace.staging._threads`: the staging thread's own single OpenMP thread.
"""

from vartrace.staging.ring import HostRing
from vartrace.staging.stager import (
    OnFull,
    Stager,
    StagingStats,
    check_device_bytes,
    stageable,
)

__all__ = [
    "HostRing",
    "OnFull",
    "Stager",
    "StagingStats",
    "check_device_bytes",
    "stageable",
]
