"""The device memory that change detection holds, bounded (`Stager(max_device_bytes=...)`).

Change detection keeps each compared site's previous record on the device, to compare the
next one with there.  Within `max_device_bytes` of those, first come, first served; a site
past it is compared on the host instead, its host copy with its previous host copy.  On
the stand-in device (``tests/simgpu.py``, no device memory to measure) the staging
counters say which side compared, and the records delivered must be the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import simgpu
from tests.staging.test_staging import (
    _assert_same_records,
    _emit_all,
    _Emitter,
    _float_bits,
    _values,
)
from tests.staging.test_staging_costs import HOST_OPS_ALLOWED, _Ops
from vartrace import ModelTracer
from vartrace.staging import Stager
from vartrace.staging import stager as staging

KIB = 1024
Delivered = list[tuple[str, int, bytes]]
#: The warning of the first site compared on the host: one test checks it, the others
#: (budgets of 0 and a few bytes) expect it.
_PAST_BUDGET = "compared on the host instead"
pytestmark = pytest.mark.filterwarnings(f"ignore:.*{_PAST_BUDGET}:UserWarning")


def _bits(value: torch.Tensor) -> bytes:
    """A host tensor's exact bytes (read in assertions only)."""
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _stage(
    values: list[tuple[str, torch.Tensor]], *, delay: float = 0.0, seed: int = 0, **options: Any
) -> tuple[Delivered, Stager]:
    """Admit each `(site, value)` as a device tensor of iteration 1, 2, ...; what was
    delivered (site, iteration, bytes), in order, and the closed stager."""
    delivered: Delivered = []

    def deliver(site: str, record: Any, iteration: int, host: Any) -> None:
        assert host is None  # the stager compared it
        with simgpu.LOG.paused():
            record = record.cpu()
        delivered.append((site, iteration, _bits(record)))

    with simgpu.copy_delay(delay, seed=seed):
        stager = Stager(deliver, **options)
        for iteration, (site, value) in enumerate(values, start=1):
            stager.admit(site, simgpu.to_device(value), iteration)
        stager.close()
    return delivered, stager


def _expected(values: list[tuple[str, torch.Tensor]]) -> Delivered:
    """The records change detection keeps: each site's first, and any whose dtype, shape
    or bits differ from the site's previous record."""
    last: dict[str, torch.Tensor] = {}
    kept: Delivered = []
    for iteration, (site, value) in enumerate(values, start=1):
        prev = last.get(site)
        last[site] = value
        if (
            prev is None
            or prev.dtype != value.dtype
            or prev.shape != value.shape
            or _bits(prev) != _bits(value)
        ):
            kept.append((site, iteration, _bits(value)))
    return kept


def _steps(sites: dict[str, torch.Tensor], steps: int) -> list[tuple[str, torch.Tensor]]:
    """`steps` steps recording every site, each value changed at even steps only."""
    return [(site, value + (step // 2)) for step in range(steps) for site, value in sites.items()]


def test_under_the_budget_every_site_is_compared_on_the_device() -> None:
    sites = {f"s{i}": torch.zeros(256) for i in range(3)}  # 1 KiB each
    values = _steps(sites, steps=4)
    simgpu.LOG.clear()
    delivered, stager = _stage(values, max_device_bytes=3 * KIB)
    assert delivered == _expected(values)
    stats = stager.stats
    assert stats.host_compares == 0
    assert stats.device_compare_bytes_peak == 3 * KIB and stats.unchanged == 6
    assert stats.device_compare_bytes == 0  # let go of at close
    assert simgpu.LOG.syncs() == []


def test_a_site_larger_than_the_budget_is_compared_on_the_host() -> None:
    """Sites take the budget first come, first served: the large one and the last small
    one find it spent, and their unchanged records are left out all the same."""
    sites = {
        "small0": torch.zeros(64),  # 256 bytes: fits
        "large": torch.zeros(256),  # 1 KiB: over the budget alone
        "small1": torch.zeros(64),  # fits: 512 bytes held
        "small2": torch.zeros(64),  # would make 768
    }
    values = _steps(sites, steps=6)
    delivered, stager = _stage(values, max_device_bytes=512, delay=0.001, seed=1)
    assert delivered == _expected(values)
    stats = stager.stats
    assert stats.device_compare_bytes_peak == 512  # <= the budget
    assert stats.host_compares == 2 * 6  # every record of "large" and "small2"
    assert stats.unchanged == 4 * 3 and len(delivered) == 4 * 3
    assert [i for site, i, _ in delivered if site == "large"] == [2, 10, 18]


@pytest.mark.filterwarnings("error")
def test_the_first_site_past_the_budget_warns_once_with_the_fix() -> None:
    values = _steps({"small": torch.zeros(8), "a": torch.zeros(64), "b": torch.ones(64)}, steps=3)
    with pytest.warns(UserWarning, match=_PAST_BUDGET) as caught:
        delivered, stager = _stage(values, max_device_bytes=64)
    assert delivered == _expected(values)
    (warning,) = caught  # "a" and then "b" are past the budget: one warning
    message = str(warning.message)
    assert "site 'a' (256 bytes a record)" in message and "max_device_bytes=64" in message
    assert "ModelTracer(max_device_bytes=...)" in message
    assert stager.stats.host_compares == 2 * 3


def test_unchanged_records_compared_on_the_host_are_left_out() -> None:
    frozen = torch.randn(64, 64)
    values = [("w", frozen.clone()) for _ in range(5)]
    delivered, stager = _stage(values, max_device_bytes=0)
    assert [iteration for _, iteration, _ in delivered] == [1]
    assert stager.stats.host_compares == 5 and stager.stats.unchanged == 4
    assert stager.stats.device_compare_bytes_peak == 0


@pytest.mark.parametrize("budget", [0, 1 << 20], ids=["host", "device"])
def test_nan_payloads_and_signed_zeros_compare_bit_for_bit(budget: int) -> None:
    nan = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    values = [
        ("x", nan.clone()),
        ("x", nan.clone()),  # the same NaN: unchanged
        ("x", other_nan),  # another payload: changed
        ("x", torch.tensor([0.0])),
        ("x", torch.tensor([-0.0])),  # equal as numbers, not as bits: changed
        ("x", torch.tensor([-0.0])),
        ("x", torch.tensor([-0.0], dtype=torch.float64)),  # another dtype: changed
        ("x", torch.tensor([[-0.0]], dtype=torch.float64)),  # another shape: changed
    ]
    delivered, stager = _stage(values, max_device_bytes=budget)
    assert [iteration for _, iteration, _ in delivered] == [1, 3, 4, 5, 7, 8]
    assert (stager.stats.host_compares > 0) == (budget == 0)


def test_a_site_that_outgrows_the_budget_moves_to_the_host() -> None:
    values = [
        ("x", torch.zeros(64)),  # 256 bytes, on the device
        ("x", torch.zeros(64)),
        ("x", torch.zeros(256)),  # 1 KiB: its small clone given back, compared on the host
        ("x", torch.zeros(256)),
        ("y", torch.zeros(64)),  # the budget is free again
        ("y", torch.zeros(64)),
    ]
    delivered, stager = _stage(values, max_device_bytes=512)
    assert [iteration for _, iteration, _ in delivered] == [1, 3, 5]
    stats = stager.stats
    assert stats.host_compares == 2 and stats.unchanged == 3
    assert stats.device_compare_bytes_peak == 256


def test_a_site_on_the_host_stays_there_when_its_records_shrink() -> None:
    """Its previous record is on the host: a small record is compared there too, and the
    large one after it with the small one, not with the large one before."""
    large = torch.arange(256.0)  # 1 KiB
    values = [("x", large), ("x", torch.zeros(64)), ("x", large.clone())]
    delivered, stager = _stage(values, max_device_bytes=512)
    assert [iteration for _, iteration, _ in delivered] == [1, 2, 3]
    assert stager.stats.host_compares == 3 and stager.stats.device_compare_bytes_peak == 0


def test_records_that_stay_on_the_device_are_compared_on_the_host_past_the_budget() -> None:
    """With records delivered as device clones, a site over the budget still gets a host
    copy, for the comparison only."""
    delivered: list[tuple[str, int, torch.Tensor]] = []
    stager = Stager(
        lambda site, record, iteration, host: delivered.append((site, iteration, record)),
        device=simgpu.DEVICE,
        max_device_bytes=0,
    )
    for iteration in (1, 2, 3):
        stager.admit("x", simgpu.to_device(torch.full((8,), float(iteration // 2))), iteration)
    stager.close()
    assert [iteration for _, iteration, _ in delivered] == [1, 2]
    assert all(record.device == simgpu.DEVICE for _, _, record in delivered)
    assert stager.stats.host_compares == 3 and stager.stats.unchanged == 1


@st.composite
def _sequences(draw: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    """Records of three sites: raw float bits, integers, booleans, shapes that change,
    repeats of the site's last value."""
    values: list[tuple[str, torch.Tensor]] = []
    last: dict[str, torch.Tensor] = {}
    for _ in range(draw(st.integers(1, 12))):
        site = draw(st.sampled_from("abc"))
        if site in last and draw(st.booleans()):
            value = last[site].clone()
        else:
            dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.bool]))
            n = draw(st.integers(0, 48))
            if dtype.is_floating_point:
                value = _float_bits(draw, dtype, n)
            elif dtype == torch.bool:
                value = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
            else:
                value = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)))
                value = value.to(dtype)
        last[site] = value
        values.append((site, value))
    return values


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_sequences(), budget=st.sampled_from([0, 64, 128, 1 << 20]), seed=st.integers(0, 99))
def test_the_same_records_are_kept_whichever_side_compares(
    values: list[tuple[str, torch.Tensor]], budget: int, seed: int
) -> None:
    delivered, stager = _stage(values, max_device_bytes=budget, delay=0.001, seed=seed)
    assert delivered == _expected(values)
    stats = stager.stats
    assert stats.device_compare_bytes_peak <= budget
    assert len(delivered) + stats.unchanged == len(values)


@pytest.fixture
def all_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tracer's default budget on the stand-in is 0 bytes: all compared on the host."""
    monkeypatch.setattr(staging, "_DEVICE_BYTES_UNKNOWN", 0)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(values=_values(), seed=st.integers(0, 2**16))
def test_a_tracer_comparing_on_the_host_keeps_the_records_of_the_synchronous_path(
    all_on_host: None, values: list[torch.Tensor], seed: int
) -> None:
    want = _emit_all(values, "sync", 0.0, 0)
    got = _emit_all(values, "async", 0.002, seed)
    _assert_same_records(got, want)


def test_a_value_copied_at_admission_between_two_equal_ones_keeps_all_three(
    all_on_host: None,
) -> None:
    """A CPU value between two equal device values of a site compared on the host: the
    second device value is compared with the CPU one (by the tracer), not with the first."""
    model = _Emitter()
    same, other = torch.arange(4.0), torch.zeros(4)
    with ModelTracer(model, ["forward.value"], staging="async") as tracer:
        for value in (same, other, same, same):
            model(simgpu.to_device(value) if value is same else value)
    assert tracer.results["forward.value"].iterations == [1, 2, 3]
    stats = tracer.staging_stats
    assert stats is not None and stats.host_compares == 3


def test_comparing_on_the_host_runs_no_torch_cpu_kernel_and_copies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counters: list[_Ops] = []
    run = Stager._run

    def counted(self: Stager) -> None:
        counter = _Ops()
        counters.append(counter)
        with counter:
            run(self)

    monkeypatch.setattr(Stager, "_run", counted)
    values = _steps({"a": torch.zeros(256, 256), "b": torch.ones(1024)}, steps=6)
    delivered, stager = _stage(values, max_device_bytes=0)
    assert delivered == _expected(values)
    assert stager.stats.host_compares == len(values)
    (counter,) = counters
    assert set(counter.host_ops) - {"empty"} <= HOST_OPS_ALLOWED, counter.host_ops
    assert counter.host_bytes_copied == 0


def test_the_default_budget_on_a_device_torch_cannot_size_is_one_gib() -> None:
    delivered, stager = _stage([("x", torch.zeros(4))])
    assert stager.max_device_bytes == 1 << 30
    assert len(delivered) == 1 and stager.stats.device_compare_bytes_peak == 16


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GiB"])
def test_a_budget_that_is_not_a_byte_count_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_device_bytes must be None or an integer >= 0"):
        Stager(lambda *args: None, max_device_bytes=bad)


def test_the_tracer_passes_its_device_budget_to_staging() -> None:
    model = _Emitter()
    values = [torch.arange(4.0), torch.arange(4.0), torch.zeros(4)]
    kept = {}
    for budget in (0, None):
        with ModelTracer(
            model, ["forward.value"], staging="async", max_device_bytes=budget
        ) as tracer:
            for value in values:
                model(simgpu.to_device(value))
        stats = tracer.staging_stats
        assert stats is not None
        assert stats.host_compares == (len(values) if budget == 0 else 0)
        kept[budget] = tracer.results["forward.value"].iterations
    assert kept[0] == kept[None] == [1, 3]
    with pytest.raises(ValueError, match="max_device_bytes must be None or an integer >= 0"):
        ModelTracer(model, ["forward.value"], max_device_bytes=-1)
