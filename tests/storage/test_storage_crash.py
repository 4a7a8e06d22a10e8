"""A training process killed with SIGKILL leaves a readable file holding every flushed record.

A real subprocess trains a small model under ModelTracer with an
H5PYSaverCallback, printing a line after each flush; the test kills it with
SIGKILL at a random moment after some flushes (sometimes right in the middle
of the next gather's writes) and then reads the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest
import torch

from tests._reader_fuzz import leave_open_for_writing
from vartrace.storage import H5PYSaverCallback, open_run, recover
from vartrace.storage import lifecycle as writer_module
from vartrace.storage import swmr as _swmr
from vartrace.trace import RunContext, Trace

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

_TRAINER = """
import sys
import torch
from torch import nn
import vartrace
from vartrace.storage import H5PYSaverCallback
from vartrace.tracing.tracer import ModelTracer

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x).relu()
        return h.sum()

class Report:
    def __call__(self, name, trace):
        pass

    def flush(self):
        print("flushed", tracer.iteration, flush=True)

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
saver = H5PYSaverCallback(
    sys.argv[1], compression=sys.argv[2] or None, background=sys.argv[3] == "background"
)
with ModelTracer(
    model, ["forward.x", "lin.forward"], post_gather_callbacks=[saver, Report()],
    gathering_interval=2,
) as tracer:
    step = 0
    while True:
        step += 1
        vartrace.record("note", f"step {step}")
        if step >= 7:
            vartrace.record("late", step)  # a site that appears after SWMR mode is on
        x = torch.full((2 + step % 3, 8), float(step))  # ragged: the batch size varies
        # uniform for 6 steps, then ragged: its shapes dataset is made under SWMR
        vartrace.record("grows", torch.full((2 if step < 7 else 2 + step % 3, 4), float(step)))
        model(x).backward()
        opt.step()
        opt.zero_grad()
"""


def _expected_x(iteration: int) -> torch.Tensor:
    return torch.full((2 + iteration % 3, 8), float(iteration))


def _expected_grows(iteration: int) -> torch.Tensor:
    return torch.full((2 if iteration < 7 else 2 + iteration % 3, 4), float(iteration))


def _train_and_kill(
    path: Path, compression: str, flushes: int, delay: float, writer: str = "inline"
) -> int:
    """Run the trainer until ``flushes`` flushes were reported, SIGKILL it; return the last one."""
    script = path.parent / "trainer.py"
    script.write_text(_TRAINER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), compression, writer],
        stdout=subprocess.PIPE,
        text=True,
    )
    last = 0
    try:
        assert process.stdout is not None
        for count, line in enumerate(process.stdout, start=1):
            last = int(line.split()[1])
            if count >= flushes:
                break
        time.sleep(delay)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert last > 0, "the trainer reported no flush"
    return last


@contextlib.contextmanager
def _live_trainer(path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The trainer writing ``path`` (inline, uncompressed), after its first flush: the process
    and the iteration it flushed; killed with SIGKILL at the end."""
    script = path.parent / "trainer.py"
    script.write_text(_TRAINER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), "", "inline"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield process, _flushed(process)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


def _flushed(process: subprocess.Popen[str]) -> int:
    """The iteration of the trainer's next flush (its next line)."""
    assert process.stdout is not None
    return int(process.stdout.readline().split()[1])


def _check_records(path: Path, flushed: int) -> int:
    """Every record read back is exact, and every iteration up to ``flushed`` is there."""
    with open_run(path) as run:
        assert {"forward.x", "lin.forward", "note"} <= set(run.names)
        site = run["forward.x"]
        count = len(site)
        assert site.iterations.tolist() == list(range(1, count + 1))
        assert count >= flushed
        for index in range(count):
            assert torch.equal(site.record(index), _expected_x(index + 1))
        assert site.shapes[:, 0].tolist() == [2 + (i + 1) % 3 for i in range(count)]
        notes = run["note"]
        assert [notes.record(i) for i in range(len(notes))] == [
            f"step {i}" for i in range(1, len(notes) + 1)
        ]
        assert len(run["lin.forward"]) == len(run["lin.forward"].iterations)
        assert run["lin.forward"].values.shape[0] == len(run["lin.forward"])
        if flushed >= 8:
            assert run["late"].record(0) == 7
        grows = run["grows"]
        # recorded before the step's forward: under the iteration before
        assert grows.iterations.tolist() == list(range(len(grows)))
        assert len(grows) >= flushed
        for index in range(len(grows)):
            assert torch.equal(grows.record(index), _expected_grows(index + 1))
        return count


@pytest.mark.parametrize(
    ("compression", "flushes", "delay", "writer"),
    [
        ("", 3, 0.0, "inline"),
        ("", 9, 0.003, "inline"),
        ("gzip", 6, 0.0, "inline"),
        ("gzip", 12, 0.001, "inline"),
        ("", 6, 0.0, "background"),
        ("gzip", 10, 0.002, "background"),
    ],
)
def test_sigkill_leaves_a_file_with_every_flushed_record(
    tmp_path: Path, compression: str, flushes: int, delay: float, writer: str
) -> None:
    path = tmp_path / "run.h5"
    reported = _train_and_kill(path, compression, flushes, delay * random.random(), writer)
    # A background writer may still be on the two gathers (of 2 iterations) before the
    # last reported one: flush() hands a gather over once the one before it is taken.
    flushed = reported if writer == "inline" else reported - 4
    # Plain h5py opens it as it was left: in a process of its own, as plain h5py would never
    # return from a damaged piece (HDF5's SWMR retries, which vartrace.open bounds).
    plain = (
        f"import h5py\nwith h5py.File({str(path)!r}, 'r', swmr=True) as f: print(len(f['vars']))"
    )
    opened = subprocess.run([sys.executable, "-c", plain], capture_output=True, timeout=120)
    assert opened.returncode == 0 and int(opened.stdout) >= 3, opened.stderr
    count = _check_records(path, flushed)

    with H5PYSaverCallback(path, append=True) as saver:  # resume: the dead writer is detected
        trace = Trace()
        for iteration in range(count + 1, count + 3):
            trace.append(_expected_x(iteration), iteration, 0, 10_000 + iteration)
        saver("forward.x", trace)
    assert _check_records(path, flushed) == count + 2
    with h5py.File(path, "r") as handle:  # closed cleanly: no SWMR flag needed any more
        assert handle["vars/forward.x/values"].shape[0] >= count + 2


def test_recover_clears_the_flags_so_plain_h5py_opens_a_killed_writers_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.h5"
    flushed = _train_and_kill(path, "", 4, 0.0)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")
    assert recover(path) is True
    assert recover(path) is False
    with h5py.File(path, "r") as handle:
        assert handle["vars/forward.x/values"].shape[0] >= flushed
    _check_records(path, flushed)


def test_a_live_writer_is_not_recovered_and_blocks_append(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with _live_trainer(path):
        with pytest.raises(OSError, match="still runs"):
            recover(path)
        with pytest.raises(OSError, match="still runs"):
            H5PYSaverCallback(path, append=True)("forward.x", Trace())
        with open_run(path) as run:  # a reader follows the running job
            assert len(run["forward.x"]) >= 2


def test_overwrite_refuses_the_file_of_a_live_writer_and_replaces_a_killed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.h5"
    with _live_trainer(path) as (process, flushed):
        with pytest.raises(OSError, match=f"the writer process {process.pid} still runs") as live:
            H5PYSaverCallback(path, overwrite=True).on_start(RunContext())
        # advice the saver's user can follow: H5PYSaverCallback has no force option
        assert "wait for it to end or stop it, or write to another path" in str(live.value)
        assert "force=True" not in str(live.value)
        for _ in range(2):  # the live run goes on writing the same file
            flushed = _flushed(process)
    _check_records(path, flushed)
    with monkeypatch.context() as elsewhere:  # a writer on another host: cannot be told
        elsewhere.setattr(writer_module, "writer_alive", lambda host, pid: None)
        for mode in ("overwrite", "append"):
            with pytest.raises(OSError, match="cannot be told") as unknown:
                H5PYSaverCallback(path, **{mode: True}).on_start(RunContext())
            message = str(unknown.value)
            assert "pass force=True" not in message, message
            assert "vartrace.storage.recover(path, force=True)" in message, message
    saver = H5PYSaverCallback(path, overwrite=True, metadata=False)  # its writer is gone
    saver("forward.x", Trace([torch.zeros(1)], [1], [0], [1]))
    saver.close()
    with open_run(path) as run:
        assert run.names == ["forward.x"] and len(run["forward.x"]) == 1


@pytest.mark.warnings_as_errors
def test_ctrl_c_during_foreground_flushes_always_reaches_the_loop(tmp_path: Path) -> None:
    """A seeded, shorter run of tools/sigint_stress.py (the README quotes 200 runs)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "sigint_stress.py"), "--runs", "12", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.stdout.startswith("{"), (done.returncode, done.stderr[-4000:])  # it ran through
    report = json.loads(done.stdout)
    assert report["interrupted"] == 12, report
    assert report["swallowed"] == report["failed"] == report["bad_files"] == 0, report
    assert report["landed"]["saver"] > 0, report  # some landed inside the saver's writes
    assert done.returncode == 0, done.stderr


def test_a_ctrl_c_sent_late_is_not_taken_for_a_swallowed_one() -> None:
    """tools/sigint_stress.py with its parent 3 s late to each signal (a loaded machine): the
    child waits at a gather for the parent instead of running to its last step, so every run
    is interrupted (without the wait: 3 of 3 runs counted as swallowed)."""
    script = str(REPO / "tools" / "sigint_stress.py")
    done = subprocess.run(
        [sys.executable, script, "--runs", "2", "--seed", "3", "--lag", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.stdout.startswith("{"), (done.returncode, done.stderr[-4000:])
    report = json.loads(done.stdout)
    assert report["interrupted"] == 2, report
    assert report["swallowed"] == report["failed"] == report["bad_files"] == 0, report


# Each step records a Note, which the saver pickles inside its write.  At step AT the pickling
# drops a temporary object whose finalizer (like the weakref callbacks of h5py's objects that
# run inside a write) raises SIGINT, only when the saver's _append is on the stack (the tracer
# copies the Note at capture too).  Python runs the handler right there: a KeyboardInterrupt
# raised inside a finalizer is ignored ("Exception ignored in ... KeyboardInterrupt") and
# training goes on, which is what happened before interrupts were held during writes.  With
# WHERE == "reduce" SIGINT is raised by the pickling code itself, mid-write: the interrupted
# gather's records must end in the file exactly once.
_CTRL_C_IN_WRITE = """
import json
import os
import signal
import sys
import torch
from torch import nn
import vartrace
from vartrace import H5PYSaverCallback, ModelTracer

AT, WHERE = 4, sys.argv[2]
# the saver and the writing into its open file
WRITER = tuple(os.path.join("vartrace", "storage", name) for name in ("writer.py", "appender.py"))
signal.signal(signal.SIGINT, signal.default_int_handler)  # also under a parent ignoring it
landed = []


def ctrl_c():
    stack, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(WRITER):
            stack.append(frame.f_code.co_name)
        frame = frame.f_back
    if "_append" in stack and not landed:
        landed.append(stack)
        signal.raise_signal(signal.SIGINT)


class Finalized:
    def __del__(self):
        ctrl_c()


class Note:
    def __init__(self, step):
        self.step = step

    def __reduce__(self):
        if self.step == AT:
            if WHERE == "finalizer":
                Finalized()  # dropped at once: its finalizer runs here, inside the write
            else:
                ctrl_c()
        return (Note, (self.step,))


class Net(nn.Module):
    def forward(self, x, note):
        return x * 2, note


model = Net()
saver = H5PYSaverCallback(sys.argv[1], metadata=False, background=False)
outcome, reached = "finished", 0
try:
    with saver, ModelTracer(model, ["forward"], post_gather_callbacks=[saver]):
        for step in range(1, 13):
            reached = step
            model(torch.full((3,), float(step)), Note(step))
except KeyboardInterrupt:
    outcome = "interrupted"
restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
with vartrace.open(sys.argv[1], allow_pickle=True) as run:  # the notes unpickle here only
    site = run["forward.1"]
    notes = [site.record(index).step for index in range(len(site))]
report = {"outcome": outcome, "reached": reached, "landed": landed, "restored": restored}
print(json.dumps({**report, "notes": notes}))
"""


@pytest.mark.parametrize("where", ["finalizer", "reduce"])
def test_ctrl_c_inside_the_foreground_write_reaches_the_loop_every_time(
    tmp_path: Path, where: str
) -> None:
    """Deterministic: SIGINT is raised from code the saver runs inside its write, at step 4."""
    path = tmp_path / "run.h5"
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_IN_WRITE)
    done = subprocess.run(
        [sys.executable, str(script), str(path), where],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    # It landed inside H5PYSaverCallback.__call__ -> _append, once.
    assert len(report["landed"]) == 1 and {"_append", "__call__"} <= set(report["landed"][0])
    assert report["outcome"] == "interrupted", (report, done.stderr)  # was "finished", 12 steps
    assert "Exception ignored" not in done.stderr, done.stderr
    assert report["reached"] == 4 and report["restored"], report
    assert report["notes"] == [1, 2, 3, 4]  # the note being written when Ctrl-C came is there
    with open_run(path) as run:
        x, note = run["forward.0"], run["forward.1"]
        assert x.iterations.tolist() == note.iterations.tolist() == [1, 2, 3, 4]
        for index in range(4):
            assert torch.equal(x.record(index), torch.full((3,), 2.0 * (index + 1)))
    with h5py.File(path, "r") as handle:  # closed cleanly
        assert handle["vars"]


@pytest.mark.parametrize("target", ["/", "vars", "vars/x", "vars/x/tags", "vars/x/values"])
def test_a_damaged_header_in_a_killed_writers_file_is_an_error_in_time(
    tmp_path: Path, target: str
) -> None:
    """A killed writer's file is read in SWMR mode, where HDF5 retries a piece whose
    checksum fails, sleeping 1 ns, 2 ns, 4 ns, ... up to 2**100 ns: vartrace bounds the
    retries, so a damaged object header ends in an error naming the object."""
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("x", Trace([torch.ones(3, 2)] * 3, [1, 2, 3], [0] * 3, [0, 1, 2]))
    with h5py.File(path, "r") as handle:
        header = h5py.h5o.get_info(handle[target].id).addr
    data = bytearray(path.read_bytes())
    data[header + 12] ^= 0xFF  # inside the header: its checksum fails
    assert leave_open_for_writing(data)
    path.write_bytes(bytes(data))
    command = [sys.executable, "-m", "vartrace", "ls", str(path)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading the file hangs")
    assert result.returncode == 2
    named = str(path) if target == "/" else f"/{target} cannot be read"
    assert named in result.stderr and "damaged" in result.stderr, result.stderr


def test_without_hdf5s_library_a_swmr_open_warns_that_it_is_unbounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where h5py's HDF5 library cannot be found (no /proc, an unusual build), the file
    still opens, with HDF5's own retries, and the reader says a damaged piece would hang."""
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path) as saver:
        saver("x", Trace([1.0, 2.0], [1, 2], [0, 0], [0, 1]))
    data = bytearray(path.read_bytes())
    assert leave_open_for_writing(data)
    path.write_bytes(bytes(data))
    monkeypatch.setattr(_swmr, "_set_read_attempts", lambda: None)
    with pytest.warns(RuntimeWarning, match="cannot bound HDF5's metadata retries"):
        run = open_run(path)
    with run:
        assert run["x"].values[()].tolist() == [1.0, 2.0]


def test_a_site_made_after_a_reader_opened_a_live_file_appears_on_reopen(tmp_path: Path) -> None:
    """A running writer makes the site "late" at step 7, after this reader opened the file:
    HDF5 finds it past the end of the file as the reader saw it, so the reader leaves it out
    (not "a damaged file") and a reopened run has it."""
    path = tmp_path / "run.h5"
    with _live_trainer(path) as (process, _):
        run = open_run(path)  # its sites are listed at first use
        while _flushed(process) < 12:
            pass
        with run:
            assert run.live and {"forward.x", "lin.forward", "note"} <= set(run.names)
            assert len(run["forward.x"]) >= 2
        with open_run(path) as again:
            assert "late" in again.names and again["late"].record(0) == 7
