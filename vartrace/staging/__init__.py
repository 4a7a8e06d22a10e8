"""How records leave the step: one `Staging` interface, two implementations.

The tracer admits each record to its staging and gets it back, in capture order,
through the receiver it gave it (`vartrace.staging.protocol`):

* `vartrace.staging.blocking`: `BlockingStaging`, the copy on the capturing thread
  and the delivery at once (`staging="sync"`);
* `vartrace.staging.stager`: `Stager`, the asynchronous record path of accelerator
  tensors (`staging="async"`): admission (a device clone, no event, no lock),
  per-step batches, change detection (on the device, within `max_device_bytes`
  of previous records; past it on the host), the copies to the host, delivery on
  a thread of its own;
* `vartrace.staging.ring`: the host memory those copies land in, allocated once;
* `vartrace.staging.threads`: the staging thread's own single OpenMP thread.
"""

from vartrace.staging.blocking import BlockingStaging
from vartrace.staging.device import stageable
from vartrace.staging.protocol import Staging
from vartrace.staging.ring import HostRing
from vartrace.staging.stager import OnFull, Stager, check_device_bytes
from vartrace.staging.stats import StagingStats

__all__ = [
    "BlockingStaging",
    "HostRing",
    "OnFull",
    "Stager",
    "Staging",
    "StagingStats",
    "check_device_bytes",
    "stageable",
]
