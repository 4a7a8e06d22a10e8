"""Long offline work shows progress on a terminal, and nothing of it in a notebook.

The terminal is real: the command runs as a subprocess whose stderr is the slave side of a
pty, and what it writes is read from the master side.  The notebook is a real Jupyter kernel
driven by nbclient, in this environment (no ipywidgets: `tqdm.auto` would warn "IProgress not
found").
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace

#: Records of the one site of the big run: writing them to TensorBoard (a histogram each)
#: takes several seconds, past the second a bar waits before it is drawn.
RECORDS = 2000


def _big_run(path: Path) -> None:
    """One site of `RECORDS` records: a single site is where a bar by site never moved."""
    with H5PYSaverCallback(path, metadata=False) as saver:
        for start in range(0, RECORDS, 500):
            steps = list(range(start + 1, start + 501))
            values = [torch.randn(16, 16) for _ in steps]
            saver("forward", Trace(values, steps, [0] * len(steps), steps))


def _on_a_terminal(*args: str, size: tuple[int, int]) -> tuple[int, str]:
    """Run `python -m vartrace ARGS` with a pty of `size` (rows, columns) for stdin, stdout
    and stderr; (exit status, everything it wrote)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "vartrace", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError as exc:  # EIO: the child closed its side
                if exc.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        status = process.wait(timeout=300)
    return status, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize("size", [(24, 80), (0, 0)], ids=["sized", "unsized"])
def test_tensorboard_shows_a_bar_of_records_on_a_terminal(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    """A bar by site never moved on a run of one big site; on a pty nobody sized (0 x 0),
    tqdm drew nothing at all."""
    pytest.importorskip("tensorboard")
    path = tmp_path / "big.h5"
    _big_run(path)
    logdir = str(tmp_path / "tb")
    status, shown = _on_a_terminal("tensorboard", str(path), "--logdir", logdir, size=size)
    assert status == 0, shown
    assert f"wrote {RECORDS} record(s) of 1 site(s)" in shown
    frames = [part for part in shown.split("\r") if part.startswith("tensorboard:")]
    assert frames, f"no frame of a progress bar reached the terminal: {shown!r}"
    assert any(f"/{RECORDS} " in frame and "record" in frame for frame in frames), frames


_CELLS = [
    "import sys, warnings\nwarnings.simplefilter('always')",
    "from vartrace.analysis.plot import plot_stat\n"
    "figure = plot_stat({path!r}, 'forward', 'mean,absmax', progress=False)\n"
    "print(len(figure.axes))",
]


def test_plot_stat_in_a_notebook_prints_no_progress_warning(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        steps = [1, 2, 3]
        saver("forward", Trace([torch.randn(4, 4) for _ in steps], steps, [0] * 3, steps))
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(cell.format(path=str(path))) for cell in _CELLS]
    )
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute()
    outputs = [output for cell in notebook.cells for output in cell.outputs]
    streams = {(o["name"], o["text"]) for o in outputs if o["output_type"] == "stream"}
    assert streams == {("stdout", "2\n")}, streams
