"""HDF5 storage of traced runs: the streaming writer and the offline reader.

Example:
    ```python
    from vartrace.storage import H5PYSaverCallback, open_run

    with H5PYSaverCallback("run.h5") as saver:
        ...  # pass saver as a post-gather callback of ModelTracer
    with open_run("run.h5") as run:
        run["forward.x"].get(iteration=1)
    ```

Files are written in HDF5's SWMR mode, so a killed training process leaves a
readable file holding every flushed record; `recover` clears the flags
that make plain `h5py.File` refuse such a file.  The layout is described in
`vartrace.storage.layout`.  This package imports no torch; tensors are
converted where they are read or written.
"""

from vartrace.errors import WorkerError
from vartrace.markers import Unstored
from vartrace.storage.codec import PickleNotAllowedError
from vartrace.storage.filters import COMPRESSIONS
from vartrace.storage.lifecycle import recover
from vartrace.storage.metadata import collect_metadata
from vartrace.storage.reader import Run, Site, open_run
from vartrace.storage.writer import H5PYSaverCallback

__all__ = [
    "COMPRESSIONS",
    "H5PYSaverCallback",
    "PickleNotAllowedError",
    "Run",
    "Site",
    "Unstored",
    "WorkerError",
    "collect_metadata",
    "open_run",
    "recover",
]
