"""Statistics mode (``vartrace.stats``): the numbers, the stand-in device, the file, the readers.

The reference statistics are computed here on the host with numpy, in float64,
from the exact upcast of each input, with boolean-mask indexing: a definition
written independently of the reducer (which may use neither).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import vartrace
from tests import simgpu
from tests._models import TinyTransformer, tokens
from vartrace.statistics.records import Statistics, is_statistics

FLOAT_DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
INT_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool]
BINS = (-6, 6)
QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)
SAMPLE = 16


@pytest.fixture(autouse=True)
def _clean_log() -> Iterator[None]:
    simgpu.synchronize()
    simgpu.LOG.clear()
    yield
    simgpu.synchronize()
    simgpu.LOG.clear()


def reference(x: np.ndarray) -> dict[str, Any]:
    """Every statistic of a float64 array, by the book (numpy, masks, float64)."""
    x = x.reshape(-1)
    finite = x[np.isfinite(x)]
    has = finite.size > 0
    out: dict[str, Any] = {
        "count": x.size,
        "mean": finite.mean() if has else math.nan,
        "std": finite.std() if has else math.nan,
        "min": finite.min() if has else math.nan,
        "max": finite.max() if has else math.nan,
        "absmax": np.abs(finite).max() if has else math.nan,
        "norm": math.sqrt(float(np.sum(finite * finite))),
        "nan": int(np.isnan(x).sum()),
        "posinf": int((x == np.inf).sum()),
        "neginf": int((x == -np.inf).sum()),
        "zeros": int((x == 0).sum()),
    }
    nonzero = finite[finite != 0]
    exponents = np.clip(np.floor(np.log2(np.abs(nonzero))), *BINS).astype(int)
    for e in range(BINS[0], BINS[1] + 1):
        sign = "<=" if e == BINS[0] else ">=" if e == BINS[1] else "="
        out[f"log2|x|{sign}{e}"] = int((exponents == e).sum())
    sample = x[:: max(1, -(-x.size // SAMPLE))]
    sample = sample[np.isfinite(sample)]
    for q in QUANTILES:
        out[f"q{q:g}"] = float(np.quantile(sample, q)) if sample.size else math.nan
    return out


def assert_matches(got: Statistics, want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for name, expected in want.items():
        value = got[name]
        if isinstance(expected, int):
            assert value == expected and isinstance(value, int), name
        elif name in ("min", "max", "absmax"):
            assert value == expected or (math.isnan(value) and math.isnan(expected)), name
        elif name == "std":
            # numpy's two-pass std keeps the rounding of its mean (an ulp of the values at
            # most: three equal values can give one ulp); the kernel's corrected two-pass
            # takes it out (equal values give 0), so they may differ by a few ulps of absmax
            largest = abs(want.get("absmax", math.nan))
            slack = 4 * np.finfo(np.float64).eps * largest if math.isfinite(largest) else 0.0
            assert value == pytest.approx(expected, rel=1e-12, abs=max(slack, 1e-300), nan_ok=True)
        else:
            assert value == pytest.approx(expected, rel=1e-12, abs=1e-300, nan_ok=True), name


SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0])
FINITE = st.floats(-1e4, 1e4, allow_nan=False) | st.floats(-1e-3, 1e-3, allow_nan=False)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOAT_DTYPES + INT_DTYPES))
    size = draw(st.integers(0, 40).filter(lambda n: n != 1))  # one element stays whole
    if dtype.is_floating_point:
        values = draw(st.lists(SPECIAL | FINITE, min_size=size, max_size=size))
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    low, high = (0, 255) if dtype == torch.uint8 else (-(2**31), 2**31 - 1)
    values = draw(st.lists(st.integers(low, high), min_size=size, max_size=size))
    return torch.tensor(values, dtype=dtype)


REDUCER = vartrace.stats(histogram=BINS, quantiles=QUANTILES, sample=SAMPLE)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors(), st.booleans())
def test_statistics_equal_a_float64_numpy_reference(tensor: torch.Tensor, on_device: bool) -> None:
    want = reference(tensor.to(torch.float64).numpy())
    value = simgpu.to_device(tensor) if on_device else tensor
    simgpu.LOG.clear()
    record = REDUCER("site", value, 1)
    assert simgpu.LOG.syncs() == []
    assert record.dtype == torch.float64 and record.device == value.device
    host = simgpu.peek(record) if on_device else record
    assert is_statistics(host)
    assert_matches(Statistics.of(host), want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors())
def test_summary_alone_equals_the_reference_on_the_host(tensor: torch.Tensor) -> None:
    """No histogram or quantiles: the host's fast path (it may work in its own copy)."""
    before = tensor.clone()
    want = reference(tensor.to(torch.float64).numpy())
    got = Statistics.of(vartrace.stats()("site", tensor, 1))
    assert_matches(got, {name: want[name] for name in got})
    assert torch.equal(tensor, before) or tensor.isnan().any()  # the record is left as it was


def test_equal_values_have_no_spread() -> None:
    """Three equal values whose float64 mean rounds away from them: numpy's two-pass std
    says 1.08e-19; the corrected two-pass gives the true 0."""
    x = torch.full((3,), 0.0007002, dtype=torch.float64)
    assert x.numpy().std() > 0  # the rounding this test is about
    assert Statistics.of(vartrace.stats()("site", x, 1))["std"] == 0.0


def test_other_values_pass_unchanged_and_sites_select() -> None:
    reducer = vartrace.stats(sites=["*@grad"])
    x = torch.ones(3)
    assert reducer("layers.0.forward", x, 1) is x
    assert is_statistics(reducer("layers.0.forward@grad", x, 1))
    every = vartrace.stats()
    assert every("n", 3, 1) == 3 and every("s", "text", 1) == "text"
    assert is_statistics(every("a", np.arange(4.0), 1))
    assert not is_statistics(torch.full((12,), math.nan, dtype=torch.float64))


@pytest.mark.parametrize("histogram", [False, True])
def test_a_scalar_is_kept_as_its_value(histogram: bool) -> None:
    reducer = vartrace.stats(histogram=histogram)
    for scalar in (
        torch.tensor(2.5),
        torch.tensor([7], dtype=torch.int64),
        torch.ones(1, 1, dtype=torch.bfloat16),
        simgpu.to_device(torch.tensor(0.5)),
        np.float32(3.0) * np.ones(()),
        np.ones((1,)),
    ):
        assert reducer("loss", scalar, 1) is scalar
    assert is_statistics(reducer("x", torch.ones(2), 1))
    assert is_statistics(reducer("x", np.ones(2), 1))


def test_a_recorded_loss_is_stored_whole_in_statistics_mode(tmp_path: Any) -> None:
    model = TinyTransformer()
    losses = []
    with (
        vartrace.H5PYSaverCallback(tmp_path / "run.h5") as saver,
        vartrace.ModelTracer(
            model, ["layers.0.forward"], statistics=True, post_gather_callbacks=[saver]
        ),
    ):
        for step in range(3):
            loss = model(tokens(step)).logits.pow(2).mean()
            vartrace.record("loss", loss)
            losses.append(loss.item())
    with vartrace.open(tmp_path / "run.h5") as run:
        assert run["layers.0.forward"].dtype == "statistics"
        site = run["loss"]
        assert site.dtype == "float32" and site.reduced_from is None
        assert [float(site.get(i)) for i in (1, 2, 3)] == pytest.approx(losses, rel=1e-6)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="histogram"):
        vartrace.stats(histogram=(3, -3))
    with pytest.raises(ValueError, match="quantiles"):
        vartrace.stats(quantiles=(1.5,))
    with pytest.raises(ValueError, match="sample"):
        vartrace.stats(sample=0)


def test_values_made_in_an_autocast_region_reduce_exactly_inside_it() -> None:
    """bf16 activations of an autocast region, reduced while it is still on (a pre-save call)."""
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        record = REDUCER("site", y, 1)
    assert y.dtype == torch.bfloat16
    assert_matches(Statistics.of(record), reference(y.double().detach().numpy()))


# -- the stand-in device: no sync on the training or autograd threads ---------------------------


def _train(model: torch.nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        with simgpu.LOG.paused():
            batch = simgpu.to_device(tokens(step))
        logits = model(batch).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_statistics_of_every_block_output_and_grad_without_a_sync(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = simgpu.to_device_module(TinyTransformer())
    paths = ["layers.*", "layers.*@grad", "head", "head@grad", "**.weight@grad", "**.bias@grad"]
    path = tmp_path / "stats.h5"
    simgpu.LOG.clear()
    with (
        vartrace.H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(
            model,
            paths,
            pre_save_callbacks=[vartrace.stats(histogram=True)],
            post_gather_callbacks=[saver],
        ) as tracer,
    ):
        assert tracer.staging == "async"
        _train(model, steps=3)
    assert simgpu.LOG.syncs() == []
    with vartrace.open(path) as run:
        grads = [name for name in run.names if name.endswith("@grad")]
        assert "layers.1.forward@grad" in grads and "head.forward@grad" in grads
        assert {f"{name}@grad" for name, _ in model.named_parameters()} <= set(grads)
        for name in run.names:
            site = run[name]
            assert site.dtype == "statistics", name
            assert len(site) == 3 and site.values["count"].min() > 0, name
            assert np.isfinite(site.values["absmax"]).all(), name


# -- a statistics run read back: to_frame, show, plot, compare; mixed with whole records --------

STAT_PATHS = ["layers.*", "layers.*@grad", "head", "head.weight"]


def _cpu_run(path: Any, seed: int = 0, reducer: Any = None, steps: int = 4) -> None:
    torch.manual_seed(seed)
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [] if reducer is None else [reducer]
    with (
        vartrace.H5PYSaverCallback(path) as saver,
        vartrace.ModelTracer(
            model, STAT_PATHS, pre_save_callbacks=callbacks, post_gather_callbacks=[saver]
        ),
    ):
        for step in range(1, steps + 1):
            batch = tokens(step)
            logits = model(batch).logits
            F.cross_entropy(logits.flatten(0, 1), batch.roll(-1, 1).flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Any:
    folder = tmp_path_factory.mktemp("stats")
    mixed = vartrace.stats(quantiles=(0.5,), sites=["layers.*"])
    _cpu_run(folder / "stats.h5", reducer=mixed)
    _cpu_run(folder / "other.h5", seed=1, reducer=mixed)
    _cpu_run(folder / "whole.h5")
    return folder


def test_a_mixed_run_reads_back_statistics_and_whole_records(runs: Any) -> None:
    with vartrace.open(runs / "stats.h5") as stats, vartrace.open(runs / "whole.h5") as whole:
        assert stats.names == whole.names
        site = stats["layers.1.forward"]
        assert site.dtype == "statistics" and list(site.kinds) == ["statistics"] * 4
        assert site.values.dtype.names[:3] == ("count", "mean", "std")
        recorded = whole["layers.1.forward"].get(3).double().numpy()
        got = site.get(3)
        assert isinstance(got, vartrace.Statistics) and got["count"] == recorded.size
        assert got["mean"] == pytest.approx(recorded.mean(), rel=1e-12)
        assert got["absmax"] == np.abs(recorded).max()
        assert site.values["absmax"][2] == got["absmax"]
        assert got.quantiles[0.5] == pytest.approx(np.median(recorded.reshape(-1)[::1]))
        assert stats["head.weight"].dtype == "float32"  # not reduced: sites=["layers.*"]
        frame = stats.to_frame(["absmax", "nan", "q0.5"])
    assert list(frame.columns[-3:]) == ["absmax", "nan", "q0.5"]
    reduced = frame[frame["site"] == "layers.1.forward"]
    assert list(reduced["dtype"]) == ["statistics"] * 4
    assert reduced["absmax"].tolist() == site_column(runs / "stats.h5", "layers.1.forward")
    assert (frame["nan"] == 0).all() and frame["absmax"].notna().all()
    whole_rows = frame[frame["site"] == "head.forward"]
    assert whole_rows["q0.5"].isna().all()  # a field only statistics records have


def site_column(path: Any, name: str, field: str = "absmax") -> list[float]:
    with vartrace.open(path) as run:
        return run[name].values[field].tolist()


def test_show_prints_statistics_records(runs: Any, capsys: Any) -> None:
    from vartrace.cli import main

    assert main(["show", str(runs / "stats.h5"), "layers.0.forward"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "layers.0.forward: 4 records, dtype statistics of float32, shape (2, 5, 8)"
    assert table[1].startswith("(statistics over finite values")
    header = table[2].split()
    assert header[:4] == ["iteration", "rank", "shape", "count"]
    assert {"absmax", "nan", "posinf", "neginf", "q0.5"} <= set(header)
    assert table[4].split()[2:5] == ["(2,", "5,", "8)"] and len(table) == 8  # not "statistics"
    assert main(["show", str(runs / "stats.h5"), "layers.0.forward", "-i", "2"]) == 0
    shown = capsys.readouterr().out
    assert "statistics record (over finite values; 12 fields)" in shown
    assert "absmax" in shown and "q0.5" in shown


def test_plot_stat_of_statistics_sites(runs: Any, capsys: Any) -> None:
    from vartrace.analysis.plot import plot_stat
    from vartrace.cli import main

    fig = plot_stat(runs / "stats.h5", ["layers.*.forward", "head.forward"], "absmax,nan,q0.5")
    absmax, nan, median = fig.axes[:3]
    lines = absmax.get_lines()
    assert len(lines) == 3  # two statistics sites and one whole one, on the same axes
    assert lines[0].get_ydata().tolist() == site_column(runs / "stats.h5", "layers.0.forward")
    assert all(np.isfinite(line.get_ydata()).all() for line in lines)
    assert nan.get_lines()[0].get_ydata().tolist() == [0.0] * 4
    assert np.isnan(median.get_lines()[2].get_ydata()).all()  # head: no stored quantile
    out = runs / "absmax.png"
    argv = ["plot", str(runs / "stats.h5"), "layers.*.forward", "--stat", "absmax,nan"]
    assert main([*argv, "-o", str(out)]) == 0
    assert "absmax,nan over iterations, 2 line(s)" in capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG")


def test_compare_statistics_as_statistics(runs: Any) -> None:
    same = vartrace.compare(runs / "stats.h5", runs / "stats.h5")
    assert same.ok
    other = vartrace.compare(runs / "stats.h5", runs / "other.h5")
    assert not other.ok and other.first_divergence is not None
    frame = other.to_frame().set_index(["site", "iteration"])
    row = frame.loc[("layers.0.forward", 2)]
    assert row["status"] == "differs" and row["dtype_a"] == "statistics of float32"
    assert row["mean_a"] == site_column(runs / "stats.h5", "layers.0.forward", "mean")[1]
    assert row["max_abs_diff"] > 0 and math.isnan(row["cosine"])
    # a statistics run against a run of whole records (same seed): reduced, then equal
    against_whole = vartrace.compare(runs / "stats.h5", runs / "whole.h5")
    assert against_whole.ok, against_whole
    tight = vartrace.compare(runs / "stats.h5", runs / "other.h5", atol=1e9, rtol=0)
    assert tight.ok  # every field within the tolerance: statistics compared with atol/rtol


# -- the recipe: statistics of every module output and every @grad of a 12-layer model ---------


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Deep(torch.nn.Module):
    def __init__(self, layers: int = 12, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([_Block(d) for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_recipe_every_module_output_and_grad_of_a_12_layer_model(tmp_path: Any) -> None:
    import gc
    import tracemalloc

    from vartrace.analysis.plot import plot_stat

    torch.manual_seed(0)
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "recipe.h5"
    steps, interval, held = 16, 4, []
    tracemalloc.start()
    try:
        with (
            vartrace.H5PYSaverCallback(path) as saver,
            vartrace.ModelTracer(
                model,
                ["**.forward", "**.forward@grad"],
                pre_save_callbacks=[vartrace.stats()],
                post_gather_callbacks=[saver],
                gathering_interval=interval,
            ) as tracer,
        ):
            for step in range(1, steps + 1):
                batch = torch.randint(0, 16, (2, 8))
                F.cross_entropy(model(batch).flatten(0, 1), batch.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step in (8, steps):
                    saver.flush()  # the gathers written (on the saver's writer thread)
                    gc.collect()  # cyclic garbage awaiting collection varies by +-100 KiB
                    held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # Memory stays flat: 8 more steps of ~100 records each would hold ~100 KiB if kept.
    assert held[1] - held[0] < 48 << 10, held
    assert all(len(trace) == 0 for trace in tracer.results.values())  # the saver took them
    with vartrace.open(path) as run:
        outputs = [n for n in run.names if not n.endswith("@grad")]
        grads = [n for n in run.names if n.endswith("@grad")]
        blocks = [n for n in outputs if n.startswith("blocks.")]
        assert len(blocks) == 12 * 4 and {"embed.forward", "head.forward"} <= set(outputs)
        assert "blocks.11.down.forward@grad" in grads and "blocks.0.forward@grad" in grads
        assert {run[n].dtype for n in run.names} == {"statistics"}
        records = sum(len(run[n]) for n in run.names)
        row = run["blocks.0.forward"].values.dtype.itemsize + 3 * 8 + 1  # + iteration, rank...
        assert records == steps * len(run.names)
    per_step = records * row / steps
    assert per_step < 12 << 10  # what a step adds to the file, chunk slack aside: ~11 KiB
    layers = ["blocks.?.forward", "blocks.??.forward"]  # fnmatch: * would cross the dots
    fig = plot_stat(path, layers, "absmax", tmp_path / "absmax.png")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 12 and all(np.isfinite(line.get_ydata()).all() for line in lines)
    from matplotlib import colormaps

    depth = [colormaps["turbo"](x) for x in np.linspace(0.0, 1.0, 12)]
    assert [line.get_color() for line in lines] == depth  # coloured by depth, first to last


def test_in_memory_results_frame_reads_statistics_records() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    with vartrace.ModelTracer(
        model, ["layers.*", "head"], pre_save_callbacks=[vartrace.stats(sites=["layers.*"])]
    ) as tracer:
        model(tokens(1))
    frame = tracer.results.to_frame("absmax").set_index("site")
    assert frame.loc["layers.0.forward", "dtype"] == "statistics"
    record = tracer.results["layers.0.forward"].values[0]
    assert frame.loc["layers.0.forward", "absmax"] == Statistics.of(record)["absmax"]
    head = tracer.results["head.forward"].values[0]
    assert frame.loc["head.forward", "absmax"] == head.abs().max().item()


class _Echo(torch.nn.Module):
    """Records `y`, the value it is called with as it is."""

    def forward(self, x: Any) -> Any:
        y = x
        return y


def _records(pre_save: list[Any], values: list[Any], **options: Any) -> tuple[list[Any], list[int]]:
    """The records of `forward.y` and their iterations, one call of `_Echo` a value."""
    model = _Echo()
    with vartrace.ModelTracer(model, ["forward.y"], pre_save_callbacks=pre_save, **options) as t:
        for value in values:
            model(value)
    trace = t.results["forward.y"]
    return list(trace.values), list(trace.iterations)


def _row_bits(record: Any) -> Any:
    return record.numpy().tobytes() if is_statistics(record) else record


@pytest.mark.parametrize("change_detection", [True, False])
def test_statistics_rows_of_plain_cpu_tensors_take_their_own_path_with_the_same_records(
    change_detection: bool,
) -> None:
    """`statistics=True` on the CPU: a plain dense tensor's row comes from the kernel, which
    compares it with the site's last one; the records and what change detection leaves out
    are those of the general path (a second pre-save callback that changes nothing)."""
    a, b = torch.randn(64, 16), torch.randn(600, 3)
    b[150, 1] = math.inf  # a masked chunk after plain ones
    values = [a, a.clone(), b, b.t(), b.t().contiguous(), torch.tensor(2.0), a, a[:, :8], a]
    fast = _records([vartrace.stats()], values, change_detection=change_detection)
    general = _records(
        [vartrace.stats(), lambda site, value, iteration: value],
        values,
        change_detection=change_detection,
    )
    assert [_row_bits(r) for r in fast[0]] == [_row_bits(r) for r in general[0]]
    assert fast[1] == general[1]
    if change_detection:  # a's copy left out
        assert fast[1] == [1, 3, 4, 5, 6, 7, 8, 9]
    else:
        assert fast[1] == list(range(1, 10))


def test_the_statistics_kernel_compares_its_row_with_the_last_one() -> None:
    """`dense_summary` writes the row and says whether it equals `last`, bit for bit."""
    from vartrace.statistics.compiled import available, dense_summary

    if not available():
        pytest.skip("no C compiler or Python.h here: numpy computes statistics")
    x = torch.randn(100)
    first, second = np.empty(12), np.empty(12)
    assert dense_summary(x, 1.5, 1 << 17, first, None) is False
    assert dense_summary(x, 1.5, 1 << 17, second, first) is True
    assert dense_summary(x * 2, 1.5, 1 << 17, second, first) is False
    assert dense_summary(x[::2], 1.5, 1 << 17, second, None) is None  # not dense
