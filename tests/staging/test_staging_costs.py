"""What a record costs the step and the staging thread, counted on the stand-in device.

On a real GPU the asynchronous path was correct but slow, for reasons a timing on a
CPU cannot show: an event, a lock and a wake-up per record on the training thread,
host copies and fresh allocations on the staging thread, OpenMP teams spinning there.
These tests count those costs on ``tests/simgpu.py`` -- aten ops per thread (with a
``TorchDispatchMode``, which is thread-local), events recorded per thread, hand-offs
and wake-ups, host bytes copied, allocations, OS threads, host memory held -- so that
CI sees a regression the GPU would show.
"""

from __future__ import annotations

import gc
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vartrace
from tests import simgpu
from vartrace import H5PYSaverCallback, ModelTracer
from vartrace._support import memory
from vartrace.staging import stager as staging
from vartrace.trace import Trace

ROWS, COLUMNS = 256, 1024  # a float32 record of 1 MiB
BLOCKS = 4

# Host ops the staging thread may run: the device-to-host copy, views, and ops that touch
# no data (``lift_fresh`` wraps a slot's numpy view, ``detach`` makes an alias).
HOST_OPS_ALLOWED = {
    "copy_",
    "view",
    "_reshape_alias",
    "as_strided",
    "alias",
    "_unsafe_view",
    "detach",
    "lift_fresh",
}
_ALLOCATING = {"empty", "empty_strided", "empty_like", "new_empty", "clone", "_to_copy", "zeros"}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(COLUMNS))  # 4 KiB, trained
        self.frozen = nn.Parameter(torch.randn(ROWS, COLUMNS), requires_grad=False)  # 1 MiB

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + 1.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return simgpu.to_device_module(_Net())


def _inputs(steps: int) -> list[torch.Tensor]:
    with simgpu.LOG.paused():
        return [simgpu.to_device(torch.randn(ROWS, COLUMNS)) for _ in range(steps)]


def _is_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.is_cpu


class _Ops(TorchDispatchMode):
    """The aten ops dispatched on the thread that entered it; host ops (every tensor a plain
    CPU tensor) apart, with the bytes they copied and the tensors they allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()
        self.host_bytes_copied = 0
        self.host_allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if tensors and all(_is_host(t) for t in tensors):
            self.host_ops[name] += 1
            if name in ("copy_", "clone", "_to_copy"):
                self.host_bytes_copied += out.nbytes
            if name in _ALLOCATING:
                self.host_allocations += 1
        return out

    def clear(self) -> None:
        self.ops.clear()
        self.host_ops.clear()
        self.host_bytes_copied = self.host_allocations = 0


@pytest.fixture
def staging_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Ops]]:
    """The ops of every staging thread started inside the test (a mode entered on it)."""
    counters: list[_Ops] = []
    run = staging.Stager._run

    def counted(self: staging.Stager) -> None:
        counter = _Ops()
        counters.append(counter)
        with counter:
            run(self)

    monkeypatch.setattr(staging.Stager, "_run", counted)
    yield counters


def _train(tracer: ModelTracer, inputs: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for x in inputs:
            tracer.model(x)


def test_a_record_costs_the_capturing_thread_a_clone_and_no_event_or_hand_off() -> None:
    steps = 6
    inputs = _inputs(steps)
    model = _model()
    with _Ops() as untraced, torch.no_grad():
        for x in inputs:
            model(x)
    simgpu.EVENTS_RECORDED.clear()
    with ModelTracer(model, ["blocks.*"], staging="async") as tracer:
        with _Ops() as traced:
            _train(tracer, inputs)
        events_in_steps = simgpu.EVENTS_RECORDED["MainThread"]
    records = steps * BLOCKS
    added = traced.ops - untraced.ops
    assert sum(added.values()) / records <= 2, added  # detach + clone
    assert set(added) <= {"detach", "clone"}, added
    stats = tracer.staging_stats
    assert stats.staged == records and stats.kept == records
    # One event and one hand-off per step (the batch and its gather together), not per record.
    assert events_in_steps <= steps, events_in_steps
    assert stats.handoffs <= steps + 1 and stats.flushes <= steps + 1, stats
    assert stats.wakeups <= 5 * stats.handoffs, stats
    assert simgpu.LOG.syncs() == []


def test_a_statistics_record_costs_the_capturing_thread_one_op() -> None:
    """The fused summary writes the record (header included); staging takes it as it is."""
    steps = 4
    *inputs, warm_up = _inputs(steps + 1)
    model = _model()
    with _Ops() as untraced, torch.no_grad():
        for x in inputs:
            model(x)
    with ModelTracer(model, ["blocks.*"], staging="async", statistics=True) as tracer:
        with torch.no_grad():
            tracer.model(warm_up)  # the op registered
        with _Ops() as traced:
            _train(tracer, inputs)
    added = traced.ops - untraced.ops
    records = steps * BLOCKS
    assert added == Counter({"summary": records}), added
    assert len(tracer.results["blocks.0.forward"].values) == steps + 1
    assert simgpu.LOG.syncs() == []


def test_the_staging_thread_copies_nothing_on_the_host_and_allocates_nothing_after_warm_up(
    tmp_path: Path, staging_ops: list[_Ops]
) -> None:
    steps = 8
    inputs = _inputs(steps)
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    with ModelTracer(_model(), ["blocks.*"], post_gather_callbacks=[saver]) as tracer:
        _train(tracer, inputs[:2])
        tracer._stager.drain()  # the warm-up (the ring's first segment) is behind
        (counter,) = staging_ops
        counter.clear()
        _train(tracer, inputs[2:])
        tracer._stager.drain()
        ops, host_ops = Counter(counter.ops), Counter(counter.host_ops)
        copied, allocations = counter.host_bytes_copied, counter.host_allocations
    saver.close()
    records = (steps - 2) * BLOCKS
    # Device to host: one copy per record, and one of the step's changed-flags.
    assert ops["copy_"] - host_ops["copy_"] == records + (steps - 2)
    assert set(host_ops) <= HOST_OPS_ALLOWED, host_ops
    assert copied == 0 and allocations == 0, (copied, allocations)
    with vartrace.open(tmp_path / "run.h5") as run:
        assert list(run["blocks.3.forward"].iterations) == list(range(1, steps + 1))
    # Every slot went back to the ring once the saver had written its record.
    assert tracer._stager.ring.used == 0
    assert tracer.staging_stats.overflows == 0


def test_an_unchanged_record_is_compared_on_the_device_not_on_the_host(
    monkeypatch: pytest.MonkeyPatch, staging_ops: list[_Ops]
) -> None:
    compared_on_host = []
    # Every host comparison of the chunk: of any two records, and of two dense copies' bytes.
    memory.build_memcmp()  # (as a tracer does first)
    unchanged, memcmp = vartrace.staging.dense._unchanged, memory.memcmp

    def counting_unchanged(a: Any, b: Any) -> bool:
        compared_on_host.append(1)
        return unchanged(a, b)

    def counting_memcmp(a: int, b: int, size: int) -> int:
        compared_on_host.append(1)
        assert memcmp is not None
        return memcmp(a, b, size)

    monkeypatch.setattr(vartrace.staging.dense, "_unchanged", counting_unchanged)
    monkeypatch.setattr(memory, "memcmp", counting_memcmp)
    steps = 5
    with ModelTracer(_model(), ["blocks.*.frozen"], staging="async") as tracer:
        _train(tracer, _inputs(steps))
    stats = tracer.staging_stats
    assert stats.unchanged == (steps - 1) * BLOCKS and stats.kept == BLOCKS
    assert compared_on_host == []
    (counter,) = staging_ops
    assert counter.host_ops["empty"] == 1  # the ring's one segment
    assert set(counter.host_ops) - {"empty"} <= HOST_OPS_ALLOWED, counter.host_ops
    assert counter.host_bytes_copied == 0
    assert tracer.results["blocks.0.frozen"].iterations == [1]
    with simgpu.LOG.paused():
        want = tracer.model.blocks[0].frozen.cpu()
    assert torch.equal(tracer.results["blocks.0.frozen"].values[0], want)


def test_a_changed_record_after_unchanged_ones_is_kept() -> None:
    model = _model()
    inputs = _inputs(4)
    with ModelTracer(model, ["blocks.0.frozen"], staging="async") as tracer:
        _train(tracer, inputs[:2])
        with torch.no_grad(), simgpu.LOG.paused():
            model.blocks[0].frozen.data[0, 0] += 1  # through .data: no version bump
        _train(tracer, inputs[2:])
    assert tracer.results["blocks.0.frozen"].iterations == [1, 3]
    first, third = tracer.results["blocks.0.frozen"].values
    assert not torch.equal(first, third) and torch.equal(first[1:], third[1:])


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _stream_workers() -> int:
    return sum(t.name.startswith("simgpu-stream") for t in threading.enumerate())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_tracing_adds_at_most_two_os_threads() -> None:
    inputs = _inputs(4)
    model = _model()
    with torch.no_grad():
        model(inputs[0])  # torch's own threads (OpenMP) start before the count
    before = _native_threads() - _stream_workers()
    with ModelTracer(model, ["blocks.*"], staging="async") as tracer:
        _train(tracer, inputs)
        tracer._stager.drain()
        during = _native_threads() - _stream_workers()
    assert during - before <= 2, (before, during)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/self/statm")
def test_a_slow_saver_keeps_host_memory_within_the_bound(tmp_path: Path) -> None:
    """100 steps of 1 MiB records, a saver slower than the steps: the step waits for room,
    and the host memory the tracer holds stays within its bound."""
    bound = 8 << 20
    inputs = _inputs(4)

    def slow(name: str, trace: Trace) -> None:
        threading.Event().wait(0.002)

    def run(path: Path, steps: int) -> tuple[ModelTracer, int]:
        """`steps` traced steps into `path`; the tracer and the resident bytes at the end."""
        saver = H5PYSaverCallback(path, metadata=False)
        with (
            pytest.warns(RuntimeWarning, match="waited"),
            ModelTracer(
                _model(),
                ["blocks.*"],
                post_gather_callbacks=[slow, saver],
                max_inflight_bytes=bound,
                max_host_bytes=2 * bound,
            ) as tracer,
        ):
            for step in range(steps):
                _train(tracer, [inputs[step % 4]])
            rss = _resident_bytes()
        saver.close()
        return tracer, rss

    # A first run makes what any first use makes (HDF5's and the writer thread's heaps),
    # whichever test ran before in this process.
    run(tmp_path / "warm.h5", 20)
    rss_before = _resident_bytes()
    tracer, rss_during = run(tmp_path / "run.h5", 100)
    stats = tracer.staging_stats
    ring = tracer._stager.ring
    assert stats.max_inflight_bytes <= bound
    assert stats.host_bytes_peak <= ring.capacity == tracer.max_host_bytes
    assert stats.overflows == 0
    # Resident memory grew by at most the ring, what lives on the stand-in device, whose
    # memory is the host's: the model's copies (4 blocks' outputs and frozen weights) and
    # the stager's copies of the records in flight (max_inflight_bytes, reached when the
    # step waits, as here), and 10%.
    device = 8 * (ROWS * COLUMNS * 4) + bound
    assert rss_during - rss_before <= 1.1 * (ring.capacity + device)
    with vartrace.open(tmp_path / "run.h5") as run:
        assert len(run["blocks.0.forward"].iterations) == 100


@pytest.mark.parametrize("staging", ["async", "sync"])
def test_a_saver_learns_what_it_may_hold_beside_the_records_in_host_memory(
    staging: str,
) -> None:
    """With asynchronous staging a saver's records share the stager's host memory
    (`max_host_bytes`) with the records in flight: `RunContext.held_bytes` tells a saver
    writing on a thread of its own what is left for it; copies on the capturing thread
    leave the bound to the saver."""
    contexts: list[vartrace.RunContext] = []

    class Sink:
        def __call__(self, name: str, trace: Trace) -> None:
            trace.clear()

        def on_start(self, context: vartrace.RunContext) -> None:
            contexts.append(context)

    options = {"max_inflight_bytes": 8 << 20, "max_host_bytes": 24 << 20, "staging": staging}
    with ModelTracer(_model(), ["blocks.*"], post_gather_callbacks=[Sink()], **options) as tracer:
        _train(tracer, _inputs(2))
    assert [context.held_bytes for context in contexts] == [
        16 << 20 if staging == "async" else None
    ]


def test_the_records_of_a_gathering_interval_wait_for_their_gather_in_the_ring(
    tmp_path: Path,
) -> None:
    """A gather every 8 steps of 4 records of 1 MiB holds 32 MiB in the slots, four times
    `max_inflight_bytes`: the ring is bounded by `max_host_bytes`, so no record overflows
    into memory of its own (pageable on a GPU: a copy at a quarter of the pinned rate,
    which the staging thread waits for, into pages faulted in one by one)."""
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    inflight = 8 << 20
    with ModelTracer(
        _model(),
        ["blocks.*"],
        post_gather_callbacks=[saver],
        gathering_interval=8,
        max_inflight_bytes=inflight,
        max_host_bytes=64 << 20,
    ) as tracer:
        _train(tracer, _inputs(16))
        tracer._stager.drain()
        stats = tracer.staging_stats
        assert stats.host_bytes_peak >= 8 * BLOCKS * ROWS * COLUMNS * 4 > 2 * inflight
        assert stats.overflows == 0
        assert tracer._stager.ring.capacity == 64 << 20
    saver.close()
    with vartrace.open(tmp_path / "run.h5") as run:
        assert list(run["blocks.3.forward"].iterations) == list(range(1, 17))


def test_records_kept_in_the_results_stay_in_their_slots() -> None:
    """With no saver, the records of each gather stay in the ring's slots: copying them
    out (into memory faulted in page by page) cost about 0.9 s a gather of 2.4 GB on an
    H200.  The slots go back to the ring with the results."""
    steps = 4
    with ModelTracer(_model(), ["blocks.*"], gathering_interval=2) as tracer:
        _train(tracer, _inputs(steps))
    ring = tracer._stager.ring
    kept = [v for trace in tracer.results.values() for v in trace.values]
    assert len(kept) == steps * BLOCKS
    assert ring.used == sum(v.nbytes for v in kept) == steps * BLOCKS * ROWS * COLUMNS * 4
    assert tracer.staging_stats.overflows == 0
    del kept, tracer
    gc.collect()
    assert ring.used == 0


def test_a_ring_too_small_for_a_gathering_interval_warns_once_with_the_ways_out(
    tmp_path: Path,
) -> None:
    """A gather every 8 steps of 4 MiB does not fit a ring of 8 MiB: the records past it
    get memory of their own (on a GPU: pageable, copied while the staging thread waits),
    and the first one says so, once; every record still reaches the file."""
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    with (
        pytest.warns(RuntimeWarning) as caught,
        ModelTracer(
            _model(),
            ["blocks.*"],
            post_gather_callbacks=[saver],
            gathering_interval=8,
            max_inflight_bytes=4 << 20,
            max_host_bytes=8 << 20,
        ) as tracer,
    ):
        _train(tracer, _inputs(16))
    saver.close()
    full = [w for w in caught if "ring of host memory for records is full" in str(w.message)]
    assert len(full) == 1 and "raise max_host_bytes" in str(full[0].message)
    assert tracer.staging_stats.overflows > 1
    with vartrace.open(tmp_path / "run.h5") as run:
        assert list(run["blocks.3.forward"].iterations) == list(range(1, 17))
