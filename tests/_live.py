"""A writer that keeps writing in a subprocess: the live run the reading tests open.

Example:
    ```python
    with live_writer(tmp_path / "live.h5") as path:   # 3 records written, more coming
        with vartrace.open(path) as run:
            assert run.live
    ```
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_TRAINER = """
import sys
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace
saver = H5PYSaverCallback(sys.argv[1], metadata=False{options})
step = 0
while True:
    step += 1
    saver("x", Trace([torch.randn(64, 256)], [step], [0], [step]))
    saver.flush()
    if step == 3:
        print("writing", flush=True)
"""


@contextlib.contextmanager
def live_writer(path: Path, options: str = "") -> Iterator[Path]:
    """`path` being written by a subprocess (site `x`, a 64x256 record an iteration,
    flushed each time), once it holds 3 records; killed on exit.  `options`: more
    keyword arguments of the saver, as Python source (`', compression="gzip"'`)."""
    script = path.with_suffix(".trainer.py")
    script.write_text(_TRAINER.format(options=options))
    process = subprocess.Popen(
        [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "writing\n"
        yield path
    finally:
        process.kill()
        process.wait(timeout=60)
