"""Failures around the step: the user's exception wins, a full disk never breaks the step.

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

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._env import run_script
from vartrace import H5PYSaverCallback, ModelTracer, stack_padded_tensors, stack_tensors
from vartrace.trace import Trace

REPO = Path(__file__).resolve().parents[2]


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
    background = {"1": True, "0": False, "-": None}[sys.argv[3]]
    at_exit = sys.argv[4] == "1"
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
            print("steps", i + 1, flush=True)
            raise KeyError("the user's own error")
    except Exception as error:
        print("raised", type(error).__name__, getattr(error, "errno", None), error, flush=True)
        print("notes", getattr(error, "__notes__", []), flush=True)
    failure = saver.failure
    print("failure", getattr(failure, "errno", None), failure, flush=True)
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


def _fill(
    path: Path, limit: int, *, background: bool | None, at_exit: bool, warnings: str = "default"
) -> tuple[str, str]:
    """Run the filling script (`background=None`: the saver's default); its stdout and
    stderr."""
    flags = [{True: "1", False: "0", None: "-"}[background], "1" if at_exit else "0"]
    done = run_script(_FILL, str(path), str(limit), *flags, flags=["-W", warnings])
    assert done.stdout.endswith("closed\n"), done.stdout
    return done.stdout, done.stderr


def _assert_committed_records_readable(path: Path) -> None:
    with vartrace.open(path) as run:
        site = run["forward.big"]
        assert len(site.iterations) >= 1
        for iteration in site.iterations:
            value = site.get(iteration=int(iteration))
            assert value.equal(torch.full((64, 1024), 2.0 * (int(iteration) - 1)))


def _cause(limit: int) -> tuple[int, str]:
    return (errno.EFBIG, "File too large") if limit else (errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    ("background", "warnings"),
    [
        (False, "default"),
        (True, "default"),
        (False, "error"),
        (None, "default"),
        (None, "error"),
    ],
    ids=[
        "foreground",
        "background",
        "warnings-as-errors",
        "writer-thread",
        "writer-thread-warnings-as-errors",
    ],
)
def test_a_full_disk_stops_the_saver_and_training_goes_on(
    small_disk: tuple[Path, int], background: bool | None, warnings: str
) -> None:
    directory, limit = small_disk
    path = directory / "run.h5"
    out, err = _fill(path, limit, background=background, at_exit=False, warnings=warnings)
    number, cause = _cause(limit)
    lines = out.splitlines()
    assert lines[0] == "steps 40", out  # every step ran
    assert lines[1] == 'raised KeyError None "the user\'s own error"', out
    assert lines[3].startswith(f"failure {number} [Errno {number}] writing the run file failed")
    assert cause in lines[3] and str(path) in lines[3], out
    first = f"H5PYSaverCallback stopped writing {path}: {cause} (errno {number})"
    again = "vartrace: H5PYSaverCallback stopped during this run: [Errno"
    if warnings == "default":  # shown as they arise, once each
        assert err.count(first) == 1 and err.count(again) == 1, err
    else:  # -W error: kept out of the step, then notes on the exception leaving the block
        assert first in lines[2] and again in lines[2], out
    if not limit:
        _assert_committed_records_readable(path)


def test_a_full_disk_at_exit_leaves_the_user_exception_in_place(
    small_disk: tuple[Path, int],
) -> None:
    directory, limit = small_disk
    path = directory / "run.h5"
    out, err = _fill(path, limit, background=False, at_exit=True)
    number, cause = _cause(limit)
    assert out.startswith('steps 40\nraised KeyError None "the user\'s own error"\n'), out
    assert f"failure {number} " in out, out
    assert err.count(f"H5PYSaverCallback stopped writing {path}: {cause}") == 1, err


# -- warnings as errors ------------------------------------------------------------------

_WARNED_STEPS = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from vartrace import H5PYSaverCallback, ModelTracer

    class Box:  # an object holding a tensor: recorded as its tensors, with a warning
        def __init__(self, tensor):
            self.tensor = tensor

    class Net(nn.Module):
        def forward(self, x):
            big = x * 2  # x does not require grad: big@grad warns
            box = Box(big)
            numbers = (n for n in range(3))  # cannot be copied: a marker, with a warning
            if x.sum() < 0:
                never = 0  # never bound: "recorded nothing" at exit
            return big

    model = Net()
    paths = ["forward.big", "forward.big@grad", "forward.box", "forward.numbers", "forward.never"]
    with H5PYSaverCallback(sys.argv[1], metadata=False) as saver, ModelTracer(
        model, paths, post_gather_callbacks=[saver], gathering_interval=3
    ):
        for step in range(10):
            model(torch.full((3,), float(step)))
            print("step", step + 1, flush=True)
    """
)


@pytest.mark.warnings_as_errors
def test_warnings_as_errors_never_break_the_step_and_the_file_keeps_every_record(
    tmp_path: Path,
) -> None:
    path, script = tmp_path / "run.h5", tmp_path / "script.py"
    script.write_text(_WARNED_STEPS)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    # Every step ran; the first warning is raised once the tracer is done, the others
    # are notes on it.
    assert done.stdout.splitlines() == [f"step {i}" for i in range(1, 11)], done.stderr
    assert done.returncode == 1, done.stderr
    assert "in __exit__" in done.stderr, done.stderr
    assert "UserWarning: vartrace: forward.box is a Box holding tensors" in done.stderr
    for kept in ("no gradient is recorded for forward.big@grad", "cannot copy a generator"):
        assert kept in done.stderr, done.stderr
    assert "pattern 'forward.never' recorded nothing" in done.stderr, done.stderr
    with vartrace.open(path) as run:
        assert run["forward.big"].iterations.tolist() == list(range(1, 11))
        assert run["forward.box.tensor"].iterations.tolist() == list(range(1, 11))
        assert isinstance(run["forward.numbers"].get(iteration=10), vartrace.Unstored)


@pytest.mark.warnings_as_errors
def test_a_warning_kept_during_the_steps_is_a_note_on_the_exception_leaving_the_block(
    tmp_path: Path,
) -> None:
    class Box:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def boxed(name: str, value: Any, iteration: int) -> Any:
        return Box(value)  # split into its tensors, with a warning, inside the step

    model = Step()
    with (
        warnings.catch_warnings(),
        H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver,
        pytest.raises(ValueError, match="the user's step failed") as caught,
    ):
        warnings.simplefilter("error")
        with ModelTracer(
            model, ["forward.big"], pre_save_callbacks=[boxed], post_gather_callbacks=[saver]
        ):
            model(torch.ones(2))
            model(-torch.ones(2))
    notes = getattr(caught.value, "__notes__", [])
    assert sys.version_info < (3, 11) or any("holding tensors" in note for note in notes)
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["forward.big.tensor"].iterations.tolist() == [1]


# -- Ctrl-C in a callback ----------------------------------------------------------------


@pytest.mark.warnings_as_errors
def test_a_keyboard_interrupt_in_a_callback_keeps_the_chunk_for_the_final_flush(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    def interrupt_once(name: str, trace: Any) -> None:
        calls.append(len(trace))
        if len(calls) == 1:
            raise KeyboardInterrupt

    model = Step()
    with (
        H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver,
        pytest.raises(KeyboardInterrupt),
        ModelTracer(
            model,
            ["forward.big"],
            post_gather_callbacks=[interrupt_once, saver],
            gathering_interval=2,
        ),
    ):
        for step in range(5):
            model(torch.full((2,), float(step)))
    assert calls == [2, 2]  # the interrupted chunk came back at the final flush
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["forward.big"].iterations.tolist() == [1, 2]
        assert torch.equal(torch.as_tensor(run["forward.big"].get(iteration=2)), 2 * torch.ones(2))


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("saver", [True, False], ids=["saver", "results"])
@pytest.mark.parametrize("after", ["exit", "continued"])
def test_a_keyboard_interrupt_after_a_stacking_callback_keeps_the_chunk_exactly_once(
    tmp_path: Path, saver: bool, after: str
) -> None:
    """Ctrl-C lands in a callback after stack_tensors changed the chunk (stacked it): the
    stacked chunk goes back to the tracer and reaches the file (or the results) once, at the
    final flush (``exit``) or, when the loop catches the interrupt and trains on
    (``continued``: a notebook cell interrupted and run again), joined with later records."""
    seen: list[tuple[str, list[int]]] = []

    def interrupt_once(name: str, trace: Any) -> None:
        seen.append((type(trace.values).__name__, [int(i) for i in trace.iterations]))
        if len(seen) == 1:
            raise KeyboardInterrupt

    model = Step()
    path = tmp_path / "run.h5"
    writer = H5PYSaverCallback(path, metadata=False) if saver else None
    callbacks = [stack_tensors, interrupt_once, *([writer] if writer else [])]
    steps = 0

    def train(count: int) -> None:
        nonlocal steps
        for _ in range(count):
            steps += 1
            model(torch.full((2,), float(steps)))

    with (
        contextlib.nullcontext() if after == "continued" else pytest.raises(KeyboardInterrupt),
        writer or contextlib.nullcontext(),
        ModelTracer(
            model, ["forward.big"], post_gather_callbacks=callbacks, gathering_interval=2
        ) as tracer,
    ):
        if after == "exit":  # Ctrl-C leaves the with-block: the final flush hands the chunk on
            train(5)
        with contextlib.suppress(KeyboardInterrupt):
            train(5)
        train(3)  # trains on after the interrupt
    interrupted = seen[0][1]
    assert seen[0][0] == "Tensor" and interrupted == [1, 2]  # stacked before the interrupt
    assert all(kind == "Tensor" for kind, _ in seen)  # the kept chunk stacks again, exactly
    handed = [i for _, iterations in seen[1:] for i in iterations]
    assert handed == list(range(1, steps + 1)), seen  # every record handed on, once
    if saver:
        with vartrace.open(path) as run:
            site = run["forward.big"]
            assert site.iterations.tolist() == list(range(1, steps + 1))
            records = [torch.as_tensor(site.record(i)) for i in range(len(site))]
        assert "forward.big" not in tracer.results  # the saver took every record
    else:
        kept = tracer.results["forward.big"]
        assert [int(i) for i in kept.iterations] == list(range(1, steps + 1))
        records = [kept.values[i] for i in range(len(kept))]
    for step, record in enumerate(records, start=1):
        assert torch.equal(record, torch.full((2,), 2.0 * step)), (step, record)


# -- mixed dtypes in the built-in stacking callbacks --------------------------------------


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("stack", [stack_tensors, stack_padded_tensors])
def test_mixed_dtypes_stack_in_the_dtype_that_holds_every_value(stack: Any) -> None:
    half = torch.tensor([1.5, -(2.0**-20), 3e38], dtype=torch.float32).to(torch.bfloat16)
    autocast = Trace([torch.tensor([0.1, 2.0, 3.0]), half], [1, 2], [0, 0], [1, 2])
    stack("a", autocast)
    assert autocast.values.dtype == torch.float32
    assert torch.equal(autocast.values[1], half.float())
    assert autocast.values[0].tolist() == torch.tensor([0.1, 2.0, 3.0]).tolist()
    ints = Trace(
        [torch.tensor([2**40 + 1]), torch.tensor([0.5]), torch.tensor([7], dtype=torch.int32)],
        [1, 2, 3],
        [0] * 3,
        [1, 2, 3],
    )
    stack("i", ints)
    assert ints.values.dtype == torch.float64
    assert ints.values.flatten().tolist() == [2**40 + 1, 0.5, 7.0]
    assert ints.iterations.tolist() == [1, 2, 3]


@pytest.mark.warnings_as_errors
def test_a_site_alternating_float32_and_bfloat16_is_stacked_at_each_gather(
    tmp_path: Path,
) -> None:
    class Alternating(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x * 2 if x.flatten()[0] % 2 else (x * 2).to(torch.bfloat16)
            return out

    model = Alternating()
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    with (
        saver,
        ModelTracer(
            model,
            ["forward.out"],
            post_gather_callbacks=[stack_tensors, saver],
            gathering_interval=4,
        ),
    ):
        for step in range(8):
            model(torch.full((3,), float(step)))
    with vartrace.open(tmp_path / "run.h5") as run:
        site = run["forward.out"]
        assert site.iterations.tolist() == list(range(1, 9))
        got = [torch.as_tensor(site.get(iteration=i)) for i in range(1, 9)]
    assert all(value.dtype == torch.float32 for value in got)
    assert [value[0].item() for value in got] == [2.0 * step for step in range(8)]
