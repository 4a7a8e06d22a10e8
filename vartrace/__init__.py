"""vartrace: record the values a PyTorch model's code holds while it trains.

Example:
    ```python
    from vartrace import ModelTracer, H5PYSaverCallback

    with H5PYSaverCallback("run.h5") as saver, \\
            ModelTracer(model, ["layers.*.attn.forward.scores"],
                        post_gather_callbacks=[saver], gathering_interval=8):
        train(model)

    run = vartrace.open("run.h5")
    run["layers.0.attn.forward.scores"].values
    ```

Torch-backed names are imported lazily (PEP 562), so `import vartrace` and
`import vartrace.engine` do not load torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from typing import TYPE_CHECKING, Any

from vartrace._version import __version__
from vartrace.markers import DROP, Unstored
from vartrace.trace import RunContext, Trace
from vartrace.tracing.manual import record

_OLDEST_TORCH = (2, 10)
"""The oldest torch release vartrace is tested on (`.ci/run` runs a job on it)."""


def _refuse_older_torch() -> None:
    """Raise ImportError where the installed torch is older than `_OLDEST_TORCH`, read from
    its distribution's metadata so that torch is not imported (the engine runs without it)."""
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return
    release = re.match(r"(\d+)\.(\d+)", installed)
    if release is not None and tuple(map(int, release.groups())) < _OLDEST_TORCH:
        raise ImportError(
            f"vartrace needs torch >= {'.'.join(map(str, _OLDEST_TORCH))}, found torch "
            f"{installed}: it is tested on torch 2.10 and newer only (its tests of staging "
            "on an accelerator need torch 2.10's Python backends), and before torch 2.3 "
            "every traced step fails (torch.compiler.is_compiling is missing); "
            "upgrade torch: pip install -U torch"
        )


_refuse_older_torch()


_LAZY = {
    "ModelTracer": "vartrace.tracing.tracer",
    "CallbackError": "vartrace.tracing.tracer",
    "Results": "vartrace.tracing.results",
    "list_sites": "vartrace.tracing.sites",
    "sites_of_type": "vartrace.tracing.sites",
    "stack_tensors": "vartrace.tracing.callbacks",
    "stack_padded_tensors": "vartrace.tracing.callbacks",
    "reduce_chunk": "vartrace.tracing.callbacks",
    "H5PYSaverCallback": "vartrace.storage.writer",
    "open": "vartrace.storage.reader:open_run",
    "Run": "vartrace.storage.reader",
    "Site": "vartrace.storage.reader",
    "compare": "vartrace.analysis.comparison",
    "Comparison": "vartrace.analysis.comparison",
    "stats": "vartrace.statistics.records",
    "Statistics": "vartrace.statistics.records",
    "ReducedFrom": "vartrace.reduced",
    "Placement": "vartrace.placements",
    "assemble": "vartrace.placements",
    "TensorBoardCallback": "vartrace.analysis.tensorboard",
    "active_tracers": "vartrace.tracing.running",
    "stop_all": "vartrace.tracing.running",
    "plot_stat": "vartrace.analysis.plot",
}

__all__ = [
    "DROP",
    "CallbackError",
    "Comparison",
    "H5PYSaverCallback",
    "ModelTracer",
    "Placement",
    "ReducedFrom",
    "Results",
    "Run",
    "RunContext",
    "Site",
    "Statistics",
    "TensorBoardCallback",
    "Trace",
    "Unstored",
    "__version__",
    "active_tracers",
    "assemble",
    "compare",
    "list_sites",
    "open",
    "plot_stat",
    "record",
    "reduce_chunk",
    "sites_of_type",
    "stack_padded_tensors",
    "stack_tensors",
    "stats",
    "stop_all",
]

if TYPE_CHECKING:
    from vartrace.analysis.comparison import Comparison, compare
    from vartrace.analysis.plot import plot_stat
    from vartrace.analysis.tensorboard import TensorBoardCallback
    from vartrace.placements import Placement, assemble
    from vartrace.reduced import ReducedFrom
    from vartrace.statistics.records import Statistics, stats
    from vartrace.storage.reader import Run, Site
    from vartrace.storage.reader import open_run as open
    from vartrace.storage.writer import H5PYSaverCallback
    from vartrace.tracing.callbacks import reduce_chunk, stack_padded_tensors, stack_tensors
    from vartrace.tracing.results import Results
    from vartrace.tracing.running import active_tracers, stop_all
    from vartrace.tracing.sites import list_sites, sites_of_type
    from vartrace.tracing.tracer import CallbackError, ModelTracer


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'vartrace' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module_name), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
