"""Asynchronous staging on the stand-in accelerator (``tests/simgpu.py``): no sync in the step.

The stand-in logs every operation that would make the host wait for the device
on CUDA, with its thread, and lands ``non_blocking`` copies late (their
destination poisoned until then, their source read when they land).  Each test
runs a model on it with ``staging="async"`` and checks that the training thread
and autograd's device thread never wait, and that the records are bit for bit
those of the synchronous path (``staging="sync"``, which does sync: the tests
check that too, so that a log that saw nothing cannot pass them).
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import vartrace
from tests import simgpu
from tests._models import TinyTransformer, tokens
from vartrace import H5PYSaverCallback, ModelTracer, Unstored
from vartrace.trace import Trace

SCENARIOS: dict[str, list[str]] = {
    # embed.weight is frozen: staged every step, kept once.
    "values": ["layers.*", "layers.*.attn._scores", "embed.weight", "head.weight", "forward"],
    "grad": ["layers.*.attn._scores@grad", "layers.*@grad", "head.weight@grad"],
    "every": ["forward.x@every"],  # x is rebound once per layer
    "record": ["head"],  # and the loss, by vartrace.tracing.manual
}


def _train(model: nn.Module, steps: int, on_device: bool = True) -> Iterator[int]:
    """Train ``model`` for ``steps`` steps (recording the loss by hand), yielding after each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    for step in range(1, steps + 1):
        batch = tokens(step)
        with simgpu.LOG.paused():
            batch = simgpu.to_device(batch) if on_device else batch
        logits = model(batch).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch.roll(-1, 1).flatten())
        vartrace.record("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        yield step


def _model(on_device: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer()
    model.embed.requires_grad_(False)
    return simgpu.to_device_module(model) if on_device else model


def _records(tracer: ModelTracer) -> dict[str, list[tuple[Any, int, int]]]:
    results = tracer.results
    return {
        name: list(
            zip(results[name].values, results[name].iterations, results[name].order, strict=True)
        )
        for name in results
    }


def _bits(value: Any) -> Any:
    """A tensor's exact bytes (-0.0 differs from 0.0, NaN payloads count); other values as is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _host(value: Any) -> Any:
    return value.cpu() if _is_tensor(value) else value


def _assert_same_records(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    assert sorted(got) == sorted(want)
    for name, records in want.items():
        assert len(got[name]) == len(records), name
        for (value, iteration, order), (expected, iteration_w, order_w) in zip(
            got[name], records, strict=True
        ):
            assert (iteration, order) == (iteration_w, order_w), name
            if isinstance(expected, torch.Tensor):
                assert value.device.type == "cpu" and value.dtype == expected.dtype, name
                assert value.shape == expected.shape, name
                assert _bits(value) == _bits(expected), name
            else:
                assert value == expected, name


def _sync_records(paths: list[str], steps: int, **options: Any) -> dict[str, list[Any]]:
    """Records of the synchronous path on the stand-in, which must have synced to get them."""
    simgpu.LOG.clear()
    with ModelTracer(_model(), paths, staging="sync", **options) as tracer:
        for _ in _train(tracer.model, steps):
            pass
    assert simgpu.LOG.syncs(), "the synchronous path logged no sync: the log sees nothing"
    return _records(tracer)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_sync_in_the_step_and_records_equal_the_synchronous_path(scenario: str) -> None:
    paths = SCENARIOS[scenario]
    want = _sync_records(paths, steps=3)
    simgpu.LOG.clear()
    with simgpu.copy_delay(0.002, seed=3), ModelTracer(_model(), paths) as tracer:
        assert tracer.staging == "async"  # "auto" on a model on an accelerator
        for _ in _train(tracer.model, steps=3):
            pass
    assert simgpu.LOG.syncs() == []
    _assert_same_records(_records(tracer), want)
    stats = tracer.staging_stats
    assert stats is not None and stats.staged > 0 and stats.pinned is False  # no pinning here
    assert stats.kept + stats.unchanged == stats.admitted


def test_unchanged_values_are_compared_on_the_host_copies() -> None:
    """The frozen embedding is staged every step, and only its first value is kept."""
    with ModelTracer(_model(), ["embed.weight"]) as tracer:
        for _ in _train(tracer.model, steps=4):
            pass
    assert tracer.results["embed.weight"].iterations == [1]
    assert tracer.staging_stats.unchanged == 3


@pytest.mark.parametrize("background", [False, True])
def test_savers_write_off_the_training_thread(tmp_path: Path, background: bool) -> None:
    paths = SCENARIOS["values"] + SCENARIOS["grad"]
    want = _sync_records(paths, steps=3)
    simgpu.LOG.clear()
    writers: set[str] = set()
    saver = H5PYSaverCallback(tmp_path / "run.h5", background=background, metadata=False)

    def note_thread(name: str, trace: Trace) -> None:
        writers.add(threading.current_thread().name)

    with (
        simgpu.copy_delay(0.002, seed=4),
        ModelTracer(_model(), paths, post_gather_callbacks=[note_thread, saver]) as tracer,
    ):
        for _ in _train(tracer.model, steps=3):
            pass
    saver.close()
    assert simgpu.LOG.syncs() == []
    assert writers and all(name.startswith("vartrace-staging") for name in writers)
    with vartrace.open(tmp_path / "run.h5") as run:
        assert sorted(run.names) == sorted(want)
        for name, records in want.items():
            site = run[name]
            assert list(site.iterations) == [iteration for _, iteration, _ in records]
            stored = [site.record(row) for row in range(len(records))]
            assert [_bits(v) for v in stored] == [_bits(v) for v, _, _ in records], name


def test_records_on_the_device_stay_there_without_a_sync() -> None:
    paths = ["layers.*", "embed.weight"]
    want = _sync_records(paths, steps=3)
    simgpu.LOG.clear()
    # "simgpu" is the current simgpu device, as "cuda" is the current CUDA device: an
    # index left out would make every record differ from its device and be copied again.
    with ModelTracer(_model(), paths, device="simgpu") as tracer:
        assert tracer.device == simgpu.DEVICE
        for _ in _train(tracer.model, steps=3):
            pass
    assert simgpu.LOG.syncs() == []
    got = _records(tracer)
    on_device = [v.device == simgpu.DEVICE for r in got.values() for v, _, _ in r if _is_tensor(v)]
    assert on_device and all(on_device)
    with simgpu.LOG.paused():
        host = {n: [(_host(v), i, o) for v, i, o in records] for n, records in got.items()}
    _assert_same_records(host, want)


def test_a_cpu_model_keeps_the_synchronous_path() -> None:
    with ModelTracer(_model(on_device=False), ["layers.*"]) as tracer:
        for _ in _train(tracer.model, steps=2, on_device=False):
            pass
    assert tracer.staging == "sync" and tracer.staging_stats is None
    assert tracer.results["layers.0.forward"].iterations == [1, 2]


# -- bit-exactness under random completion delays ---------------------------------------------


class _Emitter(nn.Module):
    """Returns each value it is given; the caller writes the returned tensor in place at once."""

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        out = value.clone()
        return out


def _float_bits(draw: Callable[..., Any], dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype`` from raw bit patterns (NaN payloads, -0.0, infinities)."""
    width = torch.finfo(dtype).bits
    signed = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    top = 1 << (width - 1)
    patterns = st.sampled_from([0, top]) | st.integers(0, 2 * top - 1)  # 0.0, -0.0, any
    raw = draw(st.lists(patterns, min_size=n, max_size=n))
    return torch.tensor([b - 2 * top if b >= top else b for b in raw], dtype=signed).view(dtype)


_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int8,
    torch.bool,
]


@st.composite
def _values(draw: Callable[..., Any]) -> list[torch.Tensor]:
    count = draw(st.integers(1, 6))
    values = []
    for _ in range(count):
        dtype = draw(st.sampled_from(_DTYPES))
        n = draw(st.integers(0, 5))
        if dtype.is_floating_point:
            value = _float_bits(draw, dtype, n)
        elif dtype == torch.bool:
            value = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        else:
            info = torch.iinfo(dtype)
            ints = st.integers(info.min, info.max)
            value = torch.tensor(draw(st.lists(ints, min_size=n, max_size=n)), dtype=dtype)
        if draw(st.booleans()) and values:
            value = values[-1].clone()  # a repeat: change detection drops it
        values.append(value)
    return values


def _emit_all(values: list[torch.Tensor], staging: str, delay: float, seed: int) -> Any:
    model = _Emitter()
    with (
        simgpu.copy_delay(delay, seed=seed),
        ModelTracer(model, ["forward", "forward.value"], staging=staging) as tracer,
    ):
        for value in values:
            with simgpu.LOG.paused():
                value = simgpu.to_device(value) if staging == "async" else value
            out = model(value)
            # Written in place right after capture: the record must not see it.
            out.bitwise_not_() if out.dtype == torch.bool else out.zero_()
    return _records(tracer)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_values(), seed=st.integers(0, 2**16), delay=st.sampled_from([0.0, 0.001, 0.004]))
def test_staged_records_are_bit_identical_to_synchronous_copies(
    values: list[torch.Tensor], seed: int, delay: float
) -> None:
    want = _emit_all(values, "sync", 0.0, 0)
    got = _emit_all(values, "async", delay, seed)
    _assert_same_records(got, want)


# -- bounded memory in flight -----------------------------------------------------------------


class _Wide(nn.Module):
    """Records ``count`` values by hand per call, each the input plus its number."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def forward(self, step: torch.Tensor) -> torch.Tensor:
        for i in range(self.count):
            vartrace.record(f"value{i}", step + i)
        return step


def _slow(seconds: float) -> Callable[[str, Trace], None]:
    def post_gather(name: str, trace: Trace) -> None:
        time.sleep(seconds)

    return post_gather


def _run_wide(steps: int, bound: int, on_full: str, *callbacks: Any) -> ModelTracer:
    model = _Wide(count=8)
    inflight: list[int] = []
    with (
        simgpu.copy_delay(0.001, seed=5),
        ModelTracer(
            model,
            ["forward"],
            post_gather_callbacks=[_slow(0.01), *callbacks],
            max_inflight_bytes=bound,
            on_full=on_full,
            staging="async",
        ) as tracer,
    ):
        for step in range(steps):
            with simgpu.LOG.paused():
                value = simgpu.to_device(torch.full((256,), float(step)))
            model(value)
            inflight.append(tracer._stager.inflight)
    assert max(inflight) <= bound
    assert tracer.staging_stats.max_inflight_bytes <= bound
    return tracer


def test_a_slow_writer_makes_the_step_wait_within_the_bound_and_warns_once() -> None:
    simgpu.LOG.clear()
    with pytest.warns(RuntimeWarning, match="waited") as caught:
        tracer = _run_wide(steps=6, bound=4 * 1024, on_full="wait")  # 4 records of 1 KiB
    assert sum("waited" in str(w.message) for w in caught) == 1
    assert "max_inflight_bytes=4096" in str(caught[0].message)
    stats = tracer.staging_stats
    assert stats.waits > 1 and stats.wait_seconds > 0 and stats.dropped == 0
    assert [len(tracer.results[f"value{i}"]) for i in range(8)] == [6] * 8
    assert simgpu.LOG.syncs() == []


def test_dropped_records_are_counted_and_leave_markers(tmp_path: Path) -> None:
    saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
    tracer = _run_wide(6, 4 * 1024, "drop", saver)
    saver.close()
    stats = tracer.staging_stats
    assert stats.dropped > 0 and stats.waits == 0
    assert sum(stats.dropped_by_site.values()) == stats.dropped
    with vartrace.open(tmp_path / "run.h5") as run:
        markers = 0
        for i in range(8):
            site = run[f"value{i}"]
            assert list(site.iterations) == sorted(site.iterations)
            for iteration in site.iterations:
                value = site.get(int(iteration))
                if isinstance(value, Unstored):
                    assert value.startswith("dropped:")
                    markers += 1
                else:
                    assert torch.equal(value, torch.full((256,), float(iteration - 1)) + i)
    # Consecutive drops of one site leave one marker: the value stays unknown until the next.
    assert 0 < markers <= stats.dropped


# -- @every, graph capture, failures ----------------------------------------------------------


class _Stepper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.clone()
        acc.add_(1)  # in place, bumps the version: seen
        acc.data.mul_(3)  # through .data, bumps nothing: not seen on an accelerator
        acc = acc * 2  # rebound: seen
        return acc


def _acc_key(statement: str) -> str:
    """The `@every` key of `acc` as bound by `statement`, a line of `_Stepper.forward`."""
    lines, first = inspect.getsourcelines(_Stepper.forward)
    (found,) = [first + n for n, text in enumerate(lines) if text.strip().startswith(statement)]
    return f"forward.acc@every:L{found}"


def _acc_records(tracer: ModelTracer) -> list[tuple[str, list[float]]]:
    """(key, value) of each record of `acc`, in capture order across its lines' sites."""
    records = sorted(
        (int(order), name, value.tolist())
        for name, trace in tracer.results.items()
        for order, value in zip(trace.order, trace.values, strict=True)
    )
    return [(name, value) for _, name, value in records]


def test_every_sees_rebinding_and_version_bumps_but_not_data_writes_on_a_device() -> None:
    cloned, added, through_data, rebound = map(
        _acc_key, ["acc = x.clone()", "acc.add_(1)", "acc.data.mul_(3)", "acc = acc * 2"]
    )
    model = _Stepper()
    with ModelTracer(model, ["forward.acc@every"], mode="any", staging="async") as tracer:
        model(simgpu.to_device(torch.zeros(2)))
    assert simgpu.LOG.syncs() == []
    # 0 (cloned), 1 (add_), 6 (rebound): the .data write's 3 was never a candidate alone.
    assert _acc_records(tracer) == [
        (cloned, [0.0, 0.0]),
        (added, [1.0, 1.0]),
        (rebound, [6.0, 6.0]),
    ]
    with ModelTracer(model, ["forward.acc@every"], mode="any") as tracer:
        model(torch.zeros(2))
    assert _acc_records(tracer) == [  # CPU: compared, the .data write's 3 keyed by its line
        (cloned, [0.0, 0.0]),
        (added, [1.0, 1.0]),
        (through_data, [3.0, 3.0]),
        (rebound, [6.0, 6.0]),
    ]


def test_records_during_a_graph_capture_are_skipped_with_one_warning() -> None:
    model = _model()
    with ModelTracer(model, ["layers.*"], staging="async") as tracer:
        batch = simgpu.to_device(tokens(0))
        # Inside, every sync and every copy between host and device raises.
        with pytest.warns(RuntimeWarning, match="captures a graph") as caught, simgpu.capturing():
            model(batch)
            model(batch)
        model(batch)
    assert sum("captures a graph" in str(w.message) for w in caught) == 1
    assert tracer.staging_stats.skipped_capturing == 4  # 2 calls x 2 blocks
    assert tracer.results["layers.0.forward"].iterations == [3]


def _train_into_a_failing_callback(
    steps: int, callback: Callable[[str, Trace], None], after_the_steps: Callable[[], None]
) -> tuple[list[int], list[str], pytest.ExceptionInfo[vartrace.CallbackError]]:
    """Train ``steps`` steps with ``callback`` (which always raises KeyError) after each
    gather; the steps that ended, every warning (each one counted, also a repeated text) and
    the one `CallbackError` raised, in a step or at the tracer's stop."""
    ended = []
    with (
        warnings.catch_warnings(record=True) as noted,
        pytest.raises(vartrace.CallbackError, match=callback.__name__) as caught,
        ModelTracer(_model(), ["layers.*"], post_gather_callbacks=[callback]) as tracer,
    ):
        warnings.simplefilter("always")
        for step in _train(tracer.model, steps=steps):
            ended.append(step)
        after_the_steps()
    assert isinstance(caught.value.__cause__, KeyError)
    return ended, [f"{w.category.__name__}: {w.message}" for w in noted], caught


def _assert_each_failure_said_once(
    steps: int, ended: list[int], calls: list[str], noted: list[str], error: Exception
) -> None:
    """Every gather admitted before the failure reached the training thread failed too,
    and each failure is said once: raised (the first), a note on the step's exception (the
    final flush's, when a step raised) or a warning from the staging thread (the others)."""
    assert len(calls) == len(ended) + 1  # a gather each step that ended, and the final one
    final = [text for text in noted if "the tracer's final flush failed" in text]
    also = [text for text in noted if "the staging thread also failed with CallbackError" in text]
    assert len(final) + len(also) == len(noted) == len(calls) - 1, noted
    raised_in_a_step = len(ended) < steps
    assert len(final) == len(getattr(error, "__notes__", [])) == int(raised_in_a_step), noted


def test_a_failing_post_gather_callback_reaches_the_training_thread() -> None:
    calls = []

    def broken(name: str, trace: Trace) -> None:
        calls.append(name)
        raise KeyError("disk on fire")

    ended, noted, caught = _train_into_a_failing_callback(3, broken, lambda: None)
    # Raised once: in the second step, or later where a loaded machine kept the staging
    # thread from the first gather that long (at the stop, past the last step).  The gathers
    # admitted before it reached the training thread fail too: the last one, at exit, is a
    # note on the step's exception, not a second one, and those before it are warnings.
    _assert_each_failure_said_once(3, ended, calls, noted, caught.value)


def test_a_callback_failure_the_steps_outran_is_raised_at_the_stop() -> None:
    """The staging thread runs the first gather's failing callback only after the last step
    (a saver stuck on a slow disk): the failure is raised at the stop, each later gather's
    failure is a warning, none is lost."""
    calls = []
    steps_over = threading.Event()

    def stuck(name: str, trace: Trace) -> None:
        calls.append(name)
        assert steps_over.wait(60), "the steps did not end"
        raise KeyError("disk on fire")

    ended, noted, caught = _train_into_a_failing_callback(3, stuck, steps_over.set)
    assert ended == [1, 2, 3]
    _assert_each_failure_said_once(3, ended, calls, noted, caught.value)


@pytest.mark.parametrize("staging", ["sync", "async"])
def test_a_callback_that_fails_once_is_raised_once_and_the_later_records_are_kept(
    staging: str,
) -> None:
    """A saver on a disk that was full for a moment: its error reaches the loop, which goes
    on, and so does the tracer."""
    failures = []

    def flaky(name: str, trace: Trace) -> None:
        if len(failures) < 1 and trace.iterations[0] == 2:
            failures.append(name)
            raise OSError("no space left on device")

    on_device = staging == "async"
    model = _model(on_device)
    raised = []
    tracer = ModelTracer(model, ["layers.1"], post_gather_callbacks=[flaky], staging=staging)
    try:
        with tracer:
            for step in range(1, 7):
                try:
                    batch = tokens(step)
                    with simgpu.LOG.paused():
                        batch = simgpu.to_device(batch) if on_device else batch
                    model(batch)
                except vartrace.CallbackError as error:
                    raised.append(error)
    except vartrace.CallbackError as error:  # staged: it may surface only at exit
        raised.append(error)
    assert len(raised) == 1 and isinstance(raised[0].__cause__, OSError)
    assert tracer.results["layers.1.forward"].iterations == [1, 3, 4, 5, 6]


def test_results_wait_for_the_records_gathered_so_far() -> None:
    with ModelTracer(_model(), ["layers.*"]) as tracer:
        for step in _train(tracer.model, steps=3):
            assert tracer.results["layers.1.forward"].iterations[-1] == step


def test_under_warnings_as_errors_the_step_never_raises() -> None:
    with (
        warnings.catch_warnings(),
        pytest.raises(RuntimeWarning, match="the step waited for records in flight") as caught,
    ):
        warnings.simplefilter("error")
        _run_wide(steps=3, bound=4 * 1024, on_full="wait")
    # Kept out of the steps, the warning is raised once the tracer is done.
    functions = [entry.name for entry in caught.traceback]
    assert "__exit__" in functions and "admit" not in functions, functions


def test_a_step_that_raises_keeps_its_exception_and_the_records_before_it() -> None:
    model = _model()

    def fail_at_step_2(module: nn.Module, args: Any) -> None:
        if tracer.iteration == 2:
            raise ValueError("step 2 failed")

    model.head.register_forward_pre_hook(fail_at_step_2)
    with (
        pytest.raises(ValueError, match="step 2 failed"),
        ModelTracer(model, ["layers.*"]) as tracer,
    ):
        for _ in _train(model, steps=3):
            pass
    # Step 2's blocks ran before its head raised: their records stay, as without staging.
    assert tracer.results["layers.0.forward"].iterations == [1, 2]
    assert not tracer._stager._thread.is_alive()


def test_threads_admitting_at_once_within_a_small_bound_lose_nothing() -> None:
    """Two threads run the model at once (as DataParallel's replicas do), each making its
    own iterations; a bound of one record makes them wait for each other's records."""
    model = _model()
    with simgpu.LOG.paused():
        batches = {
            name: [simgpu.to_device(tokens(10 * i + j)) for j in range(4)]
            for i, name in enumerate("ab")
        }
    with (
        simgpu.copy_delay(0.02, seed=6),
        warnings.catch_warnings(record=True),
        ModelTracer(model, ["layers.0.attn._scores"], max_inflight_bytes=400) as tracer,
    ):

        def run(name: str) -> None:
            for batch in batches[name]:
                model(batch)

        threads = [threading.Thread(target=run, args=(name,)) for name in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert simgpu.LOG.syncs() == []
    assert tracer.staging_stats.waits > 0
    trace = tracer.results["layers.0.attn._scores"]
    assert sorted(trace.iterations) == list(range(1, 9))
    assert trace.order == sorted(trace.order)
    with simgpu.LOG.paused(), torch.no_grad():
        want = sorted(
            _bits(model.layers[0].attn._scores(*_qk(model, batch)))
            for runs in batches.values()
            for batch in runs
        )
    assert sorted(_bits(value) for value in trace.values) == want


def _qk(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first block's queries and keys for ``batch``, as its attention computes them."""
    layer = model.layers[0]
    x = layer.norm(model.embed(batch))
    b, t, d = x.shape
    heads = layer.attn.heads
    q, k, _ = layer.attn.qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    return q, k


class _Expands(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        huge = x.expand(1 << 37)  # 4 bytes standing for 512 GiB
        return huge[:2].sum()


def test_a_device_value_too_large_to_copy_is_a_marker_and_one_warning() -> None:
    model = _Expands()
    with simgpu.LOG.paused():
        x = simgpu.to_device(torch.ones(1))
    with (
        pytest.warns(RuntimeWarning, match="4 bytes expanded to 512 GiB") as caught,
        ModelTracer(model, ["forward.huge"], mode="any", staging="async") as tracer,
    ):
        for _ in range(3):
            model(x)
    assert sum("expanded" in str(w.message) for w in caught) == 1
    (marker,) = tracer.results["forward.huge"].values  # the same marker each step: kept once
    assert isinstance(marker, Unstored) and "512 GiB" in marker
    assert simgpu.LOG.syncs() == []


def test_values_already_on_the_host_count_against_the_bound() -> None:
    """CPU tensors are copied at admission; until delivered they are in flight too."""
    model = _Wide(count=4)
    bound = 4 << 20
    with (
        pytest.warns(RuntimeWarning, match="waited"),
        ModelTracer(
            model,
            ["forward"],
            post_gather_callbacks=[_slow(0.005)],
            max_inflight_bytes=bound,
            staging="async",
        ) as tracer,
    ):
        for step in range(12):
            model(torch.full((256, 1024), float(step)))  # four 1 MiB records a step
    stats = tracer.staging_stats
    assert stats.staged == 0 and stats.admitted == 12 * 5
    assert stats.waits > 0 and stats.max_inflight_bytes <= bound
    assert tracer.results["value3"].iterations == list(range(1, 13))
