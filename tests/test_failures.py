"""Failures around the step: the user's exception wins, and a full disk never crashes the process.

The full-disk tests fill a real file system in a subprocess: a 1 MiB tmpfs
mounted for the test (needs root and ``mount``), or a file-size limit
(``RLIMIT_FSIZE``, any user on POSIX), under which writes fail with
``EFBIG`` instead of ``ENOSPC``.  Each is skipped, saying why, where its
mechanism is not available.  Only on the tmpfs is the file read back: a real
full disk lets the saver pad the file to the size its superblock records (a
hole, which takes no space), a file-size limit does not, and HDF5 refuses a
file shorter than that.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

REPO = Path(__file__).resolve().parent.parent


class Step(nn.Module):
    """Doubles its input; raises ValueError on the batch whose first entry is negative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * 2
        if x.flatten()[0] < 0:
            raise ValueError("the user's step failed")
        return big


def test_the_step_exception_propagates_when_the_final_flush_fails(tmp_path: Path) -> None:
    def refuse(name: str, trace: Any) -> None:
        raise RuntimeError(f"a gather callback refused {name}")

    model = Step()
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    tracer = ModelTracer(
        model, ["forward.big"], post_gather_callbacks=[refuse, saver], gathering_interval=100
    )
    with (
        pytest.warns(RuntimeWarning, match="final flush failed while the step was raising"),
        pytest.raises(ValueError, match="the user's step failed") as caught,
        tracer,
    ):
        model(torch.ones(2))
        model(-torch.ones(2))
    notes = getattr(caught.value, "__notes__", [])
    assert sys.version_info < (3, 11) or any("a gather callback refused" in n for n in notes)
    with pytest.warns(UserWarning, match="received no record, so it removed the empty"):
        saver.close()
    assert not (tmp_path / "run.h5").exists()


def test_a_failing_saver_close_does_not_replace_the_block_exception(tmp_path: Path) -> None:
    class Exploding(H5PYSaverCallback):
        def close(self) -> None:
            super().close()
            raise OSError(errno.EIO, "simulated", str(self.path))

    with (
        pytest.warns(RuntimeWarning, match=r"H5PYSaverCallback.close\(\) failed"),
        pytest.raises(KeyError, match="mine"),
        Exploding(tmp_path / "run.h5", metadata=False),
    ):
        raise KeyError("mine")


# -- a full disk -------------------------------------------------------------------------

_FILL = textwrap.dedent(
    """
    import resource, signal, sys
    import torch
    from torch import nn
    import vartrace
    from vartrace import H5PYSaverCallback, ModelTracer

    class Net(nn.Module):
        def forward(self, x):
            big = x * 2
            return big

    path, limit = sys.argv[1], int(sys.argv[2])
    background, at_exit = sys.argv[3] == "1", sys.argv[4] == "1"
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    model = Net()
    saver = H5PYSaverCallback(path, metadata=False, background=background)
    try:
        with saver, ModelTracer(
            model, ["forward.big"], post_gather_callbacks=[saver],
            gathering_interval=1000 if at_exit else 1,
        ):
            for i in range(40):
                model(torch.full((64, 1024), float(i)))  # 256 KiB a record
            raise KeyError("the user's own error")
    except Exception as error:
        print("raised", type(error).__name__, getattr(error, "errno", None), error, flush=True)
    saver.close()  # closing again is harmless
    print("closed", flush=True)
    """
)


@pytest.fixture(params=["tmpfs", "rlimit"])
def small_disk(request: Any, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A directory where writes fail past about 1 MiB, and the file-size limit to set (or 0)."""
    if request.param == "rlimit":
        if os.name != "posix":
            pytest.skip("RLIMIT_FSIZE needs a POSIX system")
        yield tmp_path, 1 << 20
        return
    mount = shutil.which("mount")
    if os.name != "posix" or os.geteuid() != 0 or mount is None:
        pytest.skip("mounting a small tmpfs needs root and the mount command")
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where, 0
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _fill(path: Path, limit: int, *, background: bool, at_exit: bool) -> str:
    flags = ["1" if background else "0", "1" if at_exit else "0"]
    done = subprocess.run(
        [sys.executable, "-c", _FILL, str(path), str(limit), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.endswith("closed\n"), done.stdout
    return done.stdout + done.stderr


def _assert_committed_records_readable(path: Path) -> None:
    with vartrace.open(path) as run:
        site = run["forward.big"]
        assert len(site.iterations) >= 1
        for iteration in site.iterations:
            value = site.get(iteration=int(iteration))
            assert value.equal(torch.full((64, 1024), 2.0 * (int(iteration) - 1)))


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_full_disk_closes_the_file_and_keeps_what_was_committed(
    small_disk: tuple[Path, int], background: bool
) -> None:
    directory, limit = small_disk
    path = directory / "run.h5"
    output = _fill(path, limit, background=background, at_exit=False)
    first = output.splitlines()[0]
    assert first.startswith("raised"), output
    assert str(path) in first and "writing the run file failed" in first, output
    cause = "No space left on device" if not limit else "File too large"
    assert cause in first, output
    if not limit:
        _assert_committed_records_readable(path)


def test_a_full_disk_at_exit_leaves_the_user_exception_in_place(
    small_disk: tuple[Path, int],
) -> None:
    directory, limit = small_disk
    path = directory / "run.h5"
    output = _fill(path, limit, background=False, at_exit=True)
    assert output.startswith('raised KeyError None "the user\'s own error"\n'), output
    assert "the tracer's final flush failed while the step was raising KeyError" in output
