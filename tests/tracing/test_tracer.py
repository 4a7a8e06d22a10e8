"""ModelTracer on real small models: sites, timings, iterations, change detection, restore."""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vartrace
from tests._models import Attention, Block, TinyTransformer, WithBatchNorm, tokens
from vartrace import DROP, ModelTracer, Trace


def _train(model: nn.Module, steps: int, start_seed: int = 0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        out = model(tokens(start_seed + step))
        out.logits.pow(2).mean().backward()
        optimizer.step()


def _scores(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, _ = attn.qkv(x).view(b, t, 3, attn.heads, d // attn.heads).permute(2, 0, 3, 1, 4)
    return (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)


@pytest.mark.warnings_as_errors
def test_records_locals_with_exact_values_and_tags() -> None:
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    paths = ["layers.*.attn.forward.x", "layers.*.attn.forward.scores"]
    with ModelTracer(model, paths, mode="eval") as tracer, torch.no_grad():
        for step in range(3):
            model(tokens(step))
    for layer in (0, 1):
        xs = tracer.results[f"layers.{layer}.attn.forward.x"]
        scores = tracer.results[f"layers.{layer}.attn.forward.scores"]
        assert xs.iterations == scores.iterations == [1, 2, 3]
        assert scores.ranks == [0, 0, 0]
        attn = model.layers[layer].attn
        for x, recorded in zip(xs.values, scores.values, strict=True):
            assert torch.equal(recorded, _scores(attn, x))


def test_capture_order_is_execution_order() -> None:
    model = TinyTransformer()
    paths = ["forward.tokens", "layers.*", "head", "forward.logits"]
    with ModelTracer(model, paths) as tracer:
        _train(model, 2)
    records = sorted(
        (order, name) for name, trace in tracer.results.items() for order in trace.order
    )
    first = [name for _, name in records[:5]]
    assert first == [
        "forward.tokens",
        "layers.0.forward",
        "layers.1.forward",
        "head.forward",
        "forward.logits",
    ]
    orders = [order for order, _ in records]
    assert orders == sorted(set(orders)), "capture order numbers are unique and increasing"


def test_short_forms_and_leaf_splitting() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["layers.0", "forward", "head.forward"]) as tracer:
        out = model(tokens(0))
    names = set(tracer.results)
    assert {"layers.0.forward", "head.forward"} <= names
    assert {"forward.logits", "forward.extras.mean", "forward.extras.pair.first"} <= names
    assert "forward.extras.pair.second" in names
    assert torch.equal(tracer.results["forward.logits"].values[0], out.logits)
    assert tracer.results["forward.extras.pair.second"].values == [2]


def test_nested_keys_self_attributes_and_parameters() -> None:
    model = TinyTransformer()
    paths = [
        "forward.extras.pair.first",
        "layers.0.forward.self.step_count@return",
        "layers.0.forward.self.norm.weight",
        "layers.1.attn._scores.scale",
    ]
    with ModelTracer(model, paths, change_detection=False) as tracer:
        _train(model, 2)
    assert tracer.results["layers.0.forward.self.step_count"].values == [1, 2]
    weights = tracer.results["layers.0.forward.self.norm.weight"].values
    assert len(weights) == 2 and not weights[0].requires_grad
    assert tracer.results["layers.1.attn._scores.scale"].values == [0.5, 0.5]


def test_self_is_never_matched_by_wildcards() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["layers.0.forward.*"]) as tracer:
        model(tokens(0))
    assert set(tracer.results) == {"layers.0.forward.x", "layers.0.forward.h"}


def test_entry_return_and_every_timings() -> None:
    model = TinyTransformer()
    paths = ["forward.x", "forward.tokens", "forward.scale@return", "layers.0.forward.x@every"]
    with ModelTracer(model, paths) as tracer:
        model(tokens(0), scale=2.0)
    assert tracer.results["forward.scale"].values == [2.0]
    # forward.x is a local: read at return, it is the last value x took.
    assert torch.equal(
        tracer.results["forward.x"].values[0], tracer.results["forward.x"].values[-1]
    )
    # Block.forward never rebinds x: its one value is the argument, keyed by the def line.
    _, def_line = inspect.getsourcelines(Block.forward)
    every = [name for name in tracer.results if name.startswith("layers.0.forward.x@every")]
    assert every == [f"layers.0.forward.x@every:L{def_line}"]
    assert len(tracer.results[every[0]].values) == 1


def test_every_records_each_rebinding() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["forward.x@every"], change_detection=False) as tracer:
        model(tokens(0))
    lines, first = inspect.getsourcelines(TinyTransformer.forward)

    def key(statement: str) -> str:
        (found,) = [first + n for n, text in enumerate(lines) if text.strip() == statement]
        return f"forward.x@every:L{found}"

    # embed*scale, after layers 0 and 1, after shared(shared(x)): in that order.
    records = sorted(
        (order, name) for name, trace in tracer.results.items() for order in trace.order
    )
    assert [name for _, name in records] == [
        key("x = self.embed(tokens) * scale"),
        key("x = layer(x)"),
        key("x = layer(x)"),
        key("x = self.shared(self.shared(x))"),
    ]


def test_method_called_several_times_gives_one_record_per_call() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["shared.forward.input"]) as tracer:
        _train(model, 3)
    trace = tracer.results["shared.forward.input"]
    assert trace.iterations == [1, 1, 2, 2, 3, 3]
    assert trace.order == sorted(trace.order)


def test_overlapping_patterns_record_each_leaf_once_per_call() -> None:
    model = TinyTransformer()
    patterns = ["layers.0.attn.forward.scores", "layers.*.attn.forward.*", "**.scores"]
    with ModelTracer(model, patterns, change_detection=False) as tracer:
        _train(model, 2)
    assert tracer.results["layers.0.attn.forward.scores"].iterations == [1, 2]
    assert tracer.results["layers.1.attn.forward.attn"].iterations == [1, 2]


def test_records_are_detached_independent_copies() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.ones(2, 3, requires_grad=True)
    with ModelTracer(model, ["0.forward.input", "0"]) as tracer:
        out = model(x)
    with torch.no_grad():
        x.add_(100)
    recorded_in = tracer.results["0.forward.input"].values[0]
    recorded_out = tracer.results["0.forward"].values[0]
    assert torch.equal(recorded_in, torch.ones(2, 3))
    assert recorded_out.grad_fn is None and not recorded_out.requires_grad
    assert recorded_out.data_ptr() != out.data_ptr()


def test_change_detection_sees_batchnorm_stats_and_skips_frozen_weights() -> None:
    model = WithBatchNorm()
    paths = ["bn.forward.self.running_mean", "frozen.forward.self.weight"]
    with ModelTracer(model, paths) as tracer:
        for step in range(5):
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step)))
    assert tracer.results["bn.forward.self.running_mean"].iterations == [1, 2, 3, 4, 5]
    assert tracer.results["frozen.forward.self.weight"].iterations == [1]


def test_change_detection_sees_writes_through_data() -> None:
    model = WithBatchNorm()
    with ModelTracer(model, ["frozen.forward.self.weight"]) as tracer:
        for step in range(4):
            if step == 2:
                model.frozen.weight.data[0, 0] = 42.0  # does not bump the version counter
            model(torch.randn(8, 4))
    trace = tracer.results["frozen.forward.self.weight"]
    assert trace.iterations == [1, 3]
    assert trace.values[1][0, 0] == 42.0


def test_change_detection_off_records_every_iteration() -> None:
    model = WithBatchNorm()
    with ModelTracer(model, ["frozen.forward.self.weight"], change_detection=False) as tracer:
        for _ in range(3):
            model(torch.randn(8, 4))
    assert tracer.results["frozen.forward.self.weight"].iterations == [1, 2, 3]


def test_change_detection_is_bit_exact() -> None:
    from vartrace.tensors import same

    assert same(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not same(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert same(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))
    assert not same(0.0, -0.0)
    assert same(float("nan"), float("nan"))


def test_change_detection_compares_what_tensors_stand_for() -> None:
    from vartrace.tensors import same

    z = torch.tensor([1 + 2j, 3 - 4j])
    assert same(z.conj(), z.conj().resolve_conj())  # a lazy conjugation is its value
    assert not same(z.conj(), z)
    assert same(torch.ones(2, 3).t(), torch.ones(3, 2))  # a strided view, compared by value
    assert not same(torch.arange(6.0).view(2, 3).t(), torch.arange(6.0).view(3, 2))
    assert same(torch.empty(0, 3), torch.empty(0, 3))
    first = torch.zeros(1000)
    second = first.clone()
    second[-1] = 1e-30  # only the last byte-range differs
    assert not same(first, second)
    assert same(torch.ones(2, device="meta"), torch.zeros(2, device="meta"))


def test_modes_count_iterations_separately() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["head"], mode="train", change_detection=False) as train_tracer:
        model.train()
        model(tokens(0))
        model.eval()
        model(tokens(1))
        model.train()
        model(tokens(2))
    assert train_tracer.results["head.forward"].iterations == [1, 2]

    with ModelTracer(model, ["head"], mode="eval", change_detection=False) as eval_tracer:
        model.eval()
        model(tokens(0))
        model.train()
        model(tokens(1))
    assert eval_tracer.results["head.forward"].iterations == [1]

    with ModelTracer(model, ["head"], mode="any", change_detection=False) as any_tracer:
        model(tokens(0))
        model.eval()
        model(tokens(1))
    assert any_tracer.results["head.forward"].iterations == [1, 2]


def test_trace_interval() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["head"], trace_interval=3) as tracer:
        _train(model, 7)
    assert tracer.results["head.forward"].iterations == [1, 4, 7]


def test_set_iteration_tags_records_for_accumulation() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["head"], change_detection=False) as tracer:
        for step in (10, 11):
            tracer.set_iteration(step)
            for micro in range(2):
                model(tokens(micro)).logits.sum().backward()
    assert tracer.results["head.forward"].iterations == [10, 10, 11, 11]


def test_pre_save_reduces_and_drops() -> None:
    model = TinyTransformer()

    def norm_or_drop(name: str, value: Any, iteration: int) -> Any:
        if iteration == 2:
            return DROP
        return value.norm().item()

    with ModelTracer(model, ["head"], pre_save_callbacks=[norm_or_drop]) as tracer:
        _train(model, 3)
    trace = tracer.results["head.forward"]
    assert trace.iterations == [1, 3]
    assert all(isinstance(v, float) for v in trace.values)


@pytest.mark.warnings_as_errors
def test_gathering_interval_chunks_and_flush() -> None:
    chunks: list[tuple[str, list[int]]] = []
    finals: list[str] = []

    class Saver:
        def __init__(self) -> None:
            self.flushes = 0
            self.started: vartrace.RunContext | None = None

        def on_start(self, context: vartrace.RunContext) -> None:
            self.started = context

        def __call__(self, name: str, trace: Trace) -> None:
            chunks.append((name, list(trace.iterations)))

        def flush(self) -> None:
            self.flushes += 1

    saver = Saver()
    model = TinyTransformer()
    with ModelTracer(
        model,
        ["head"],
        post_gather_callbacks=[saver],
        post_trace_callbacks=[lambda name, trace: finals.append(name)],
        gathering_interval=2,
    ) as tracer:
        _train(model, 5)
    assert chunks == [("head.forward", [1, 2]), ("head.forward", [3, 4]), ("head.forward", [5])]
    assert saver.flushes == 3
    assert saver.started == vartrace.RunContext(rank=0, world_size=1, sharded=False)
    assert finals == ["head.forward"]
    assert tracer.results["head.forward"].iterations == [1, 2, 3, 4, 5]


@pytest.mark.warnings_as_errors
@pytest.mark.parametrize("steps", [4, 5])
def test_a_sink_with_flush_later_is_handed_each_gather_and_flushed_once_at_the_stop(
    steps: int,
) -> None:
    """Every gather but the last goes to `flush_later` (a writer thread's hand-over, not a
    wait); the stop's last gather calls `flush`, also when it gathers nothing (4 steps)."""
    calls: list[str] = []

    class Sink:
        background = None  # writes on a thread of its own what a tracer hands it
        waited: list[int] = []

        def __call__(self, name: str, trace: Trace) -> None:
            calls.append(f"records {list(trace.iterations)}")
            trace.clear()

        def make_room(self, nbytes: int) -> None:
            self.waited.append(nbytes)

        def flush_later(self) -> None:
            calls.append("flush_later")

        def flush(self) -> None:
            calls.append("flush")

    sink = Sink()
    model = TinyTransformer()
    with ModelTracer(model, ["head"], post_gather_callbacks=[sink], gathering_interval=2):
        _train(model, steps)
    later = ["records [1, 2]", "flush_later", "records [3, 4]", "flush_later"]
    assert calls == later + (["records [5]", "flush"] if steps == 5 else ["flush"])
    assert len(sink.waited) == steps  # each record made room first


def test_callback_that_empties_chunk_keeps_nothing_in_memory() -> None:
    model = TinyTransformer()
    with ModelTracer(model, ["head"], post_gather_callbacks=[lambda n, t: t.clear()]) as tracer:
        _train(model, 3)
    assert len(tracer.results) == 0


def test_length_invariant_violation_names_the_callback() -> None:
    def bad_callback(name: str, trace: Trace) -> None:
        trace.values.append(0)

    model = TinyTransformer()
    tracer = ModelTracer(model, ["head"], pre_gather_callbacks=[bad_callback])
    with pytest.raises(ValueError, match=r"after callback .*bad_callback"), tracer:
        _train(model, 1)
    assert "forward" not in vars(model), "the model is restored even when a callback fails"


@pytest.mark.warnings_as_errors
def test_stacking_callbacks_and_reducer() -> None:
    model = TinyTransformer()
    with ModelTracer(
        model,
        ["layers.0.attn.forward.scores", "forward.tokens"],
        post_gather_callbacks=[vartrace.stack_padded_tensors],
        gathering_interval=2,
    ) as tracer:
        for step, length in enumerate([5, 3, 4]):
            model(tokens(step, length=length))
    scores = tracer.results["layers.0.attn.forward.scores"]
    assert isinstance(scores.values, torch.Tensor)
    assert scores.values.shape == (3, 2, 2, 5, 5)
    assert scores.shapes == [(2, 2, 5, 5), (2, 2, 3, 3), (2, 2, 4, 4)]
    assert torch.equal(scores.iterations, torch.tensor([1, 2, 3]))
    assert torch.equal(scores.values[1, :, :, 3:, :], torch.zeros(2, 2, 2, 5))

    reducer = vartrace.reduce_chunk(lambda values: torch.stack(values).mean(dim=(0, 1)))
    with ModelTracer(
        model, ["head"], pre_gather_callbacks=[reducer], gathering_interval=4
    ) as reduced:
        _train(model, 8)
    trace = reduced.results["head.forward"]
    assert trace.iterations == [4, 8]
    assert trace.values[0].shape == (5, 16)


@pytest.mark.warnings_as_errors
def test_stack_tensors_leaves_ragged_records_unstacked_with_a_warning() -> None:
    trace = Trace([torch.zeros(2), torch.zeros(3)], [1, 2], [0, 0], [1, 2])
    with pytest.warns(RuntimeWarning, match="different shapes.*stack_padded_tensors pads them"):
        vartrace.stack_tensors("site", trace)
    assert isinstance(trace.values, list) and len(trace.values) == 2
    vartrace.stack_tensors("site", Trace([1.0, 2.0], [1, 2], [0, 0], [1, 2]))


@pytest.mark.filterwarnings("ignore:vartrace. 1 running tracer")  # two on purpose
@pytest.mark.warnings_as_errors
def test_manual_record() -> None:
    vartrace.record("nothing.active", torch.ones(1))  # a no-op without tracers
    model = TinyTransformer()
    with ModelTracer(model, ["head"]) as first, ModelTracer(model, ["head"]) as second:
        for step in range(2):
            model(tokens(step))
            vartrace.record("loss", {"value": torch.tensor(float(step)), "step": step})
    for tracer in (first, second):
        assert tracer.results["loss.value"].iterations == [1, 2]
        assert tracer.results["loss.step"].values == [0, 1]
        assert len(tracer.results["head.forward"].values) == 2


@pytest.mark.warnings_as_errors
def test_restores_model_and_propagates_exceptions() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if x.sum() > 100:
                raise FloatingPointError("too big")
            return y

    model = Failing()
    before = dict(vars(model))
    trace_fn = sys.gettrace()
    tracer = ModelTracer(model, ["forward.y", "lin"])
    with pytest.raises(FloatingPointError, match="too big"), tracer:
        model(torch.ones(1, 2))
        model(torch.full((1, 2), 1000.0))
    assert vars(model) == before and vars(model.lin).keys() == vars(nn.Linear(2, 2)).keys()
    assert sys.gettrace() is trace_fn
    assert tracer.results["forward.y"].iterations == [1], "records before the error are kept"


@pytest.mark.filterwarnings("ignore:vartrace. 1 running tracer")  # two on purpose
def test_two_tracers_stop_in_any_order() -> None:
    model = TinyTransformer()
    a = ModelTracer(model, ["head", "layers.0.attn.forward.scores"]).start()
    b = ModelTracer(model, ["head"]).start()
    model(tokens(0))
    a.stop()
    model(tokens(1))
    b.stop()
    model(tokens(2))
    assert len(a.results["head.forward"]) == 1
    assert len(b.results["head.forward"]) == 2
    assert "forward" not in vars(model) and "forward" not in vars(model.head)


def test_wrappers_are_unwrapped() -> None:
    model = TinyTransformer()
    wrapped = nn.DataParallel(model)
    with ModelTracer(wrapped, ["head"]) as tracer:
        wrapped(tokens(0))
    assert list(tracer.results) == ["head.forward"]


def test_bad_patterns_fail_before_the_first_step() -> None:
    model = TinyTransformer()
    with pytest.raises(ValueError, match=r"'layers\.\*\.attn\.forward\.scroes'.*scores"):
        ModelTracer(model, ["layers.*.attn.forward.scroes"])
    with pytest.raises(ValueError, match=r"'nope\.forward'.*closest"):
        ModelTracer(model, ["nope.forward"])
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.forward\.scores@entry'.*local"):
        ModelTracer(model, ["layers.0.attn.forward.scores@entry"])
    with pytest.raises(ValueError, match="segment 2 is empty"):
        ModelTracer(model, ["layers..attn"])
    with pytest.raises(ValueError, match="unknown timing"):
        ModelTracer(model, ["head@later"])
    assert "forward" not in vars(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelTracer(model, ["head", "missing.site"], strict=False)
    assert any("'missing.site'" in str(w.message) for w in caught)


def test_bad_arguments() -> None:
    model = TinyTransformer()
    with pytest.raises(ValueError, match="gathering_interval"):
        ModelTracer(model, ["head"], gathering_interval=0)
    with pytest.raises(ValueError, match="mode"):
        ModelTracer(model, ["head"], mode="training")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ModelTracer(object(), ["head"])  # type: ignore[arg-type]
    tracer = ModelTracer(model, ["head"])
    with tracer, pytest.raises(RuntimeError, match="already started"):
        tracer.start()


def test_list_sites_and_sites_of_type() -> None:
    model = TinyTransformer()
    sites = vartrace.list_sites(model, "layers.0.attn.**")
    assert "layers.0.attn" in sites
    assert "layers.0.attn.forward.scores" in sites
    assert "layers.0.attn._scores.scale" in sites
    assert all(not s.endswith(".self") for s in sites)
    assert vartrace.sites_of_type(model, nn.LayerNorm) == ["layers.0.norm", "layers.1.norm"]
    assert vartrace.sites_of_type(nn.DataParallel(model), Attention) == [
        "layers.0.attn",
        "layers.1.attn",
    ]


def test_compiled_model_runs_traced_methods_eagerly_and_warns() -> None:
    model = TinyTransformer()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(UserWarning, match=r"compiled.*layers\.0\.attn\.forward"):
        tracer = ModelTracer(compiled, ["layers.*.attn.forward.scores"]).start()
    try:
        for step in range(2):
            compiled(tokens(step))
    finally:
        tracer.stop()
    assert tracer.results["layers.0.attn.forward.scores"].iterations == [1, 2]
    assert tracer.results["layers.1.attn.forward.scores"].iterations == [1, 2]


@pytest.mark.parametrize("option", ["change_detection", "gather", "strict"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_flag_that_is_not_a_bool_is_refused(option: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"{option} must be True or False, not {value!r}"):
        ModelTracer(nn.Linear(2, 2), ["forward"], **{option: value})


def test_the_meta_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device='meta' would keep only shapes"):
        ModelTracer(nn.Linear(2, 2), ["forward"], device="meta")


class _Wide(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2  # 8 MiB a call


@pytest.mark.parametrize("staging", ["sync", "async"])
def test_results_held_in_memory_warn_at_half_the_bound_and_stop_at_it(staging: str) -> None:
    model = _Wide()
    with (
        warnings.catch_warnings(record=True) as caught,
        ModelTracer(
            model, ["forward"], mode="any", staging=staging, max_host_bytes=64 << 20
        ) as tracer,
    ):
        warnings.simplefilter("always")
        for step in range(12):
            model(torch.full((2048, 1024), float(step)))
    messages = [str(w.message) for w in caught if "held in memory" in str(w.message)]
    assert len(messages) == 2, messages
    assert "reached 40 MiB" in messages[0] and "will be dropped" in messages[0]
    assert "H5PYSaverCallback" in messages[0] and "vartrace.stats()" in messages[0]
    assert "are dropped" in messages[1]
    trace = tracer.results["forward"]
    assert trace.iterations == list(range(1, 13))
    kept = [v for v in trace.values if isinstance(v, torch.Tensor)]
    assert len(kept) == 8  # 64 MiB
    markers = trace.values[8:]
    assert all(isinstance(m, vartrace.Unstored) and "max_host_bytes=64 MiB" in m for m in markers)


def test_the_default_host_bound_is_a_tenth_of_the_memory_at_most_8_gib() -> None:
    tracer = ModelTracer(nn.Linear(2, 2), ["forward"])
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert tracer.max_host_bytes == min(8 << 30, memory // 10)


@pytest.mark.parametrize("statistics", [True, vartrace.stats(histogram=True)])
def test_statistics_mode_in_one_word(statistics: Any) -> None:
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    with ModelTracer(model, ["forward"], mode="any", statistics=statistics) as tracer:
        model(x)
    (record,) = tracer.results["forward"].values
    summary = vartrace.Statistics.of(record)
    with torch.no_grad():
        want = model(x).double()
    assert summary["count"] == 15 and summary["max"] == want.max().item()
    assert ("log2|x|=0" in summary) == (statistics is not True)


def test_statistics_must_be_a_bool_or_a_reducer() -> None:
    with pytest.raises(TypeError, match="statistics must be True, False or a reducer"):
        ModelTracer(nn.Linear(2, 2), ["forward"], statistics="yes")


class _EvalOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.metrics(x)
        return self.lin(x)

    def metrics(self, x: torch.Tensor) -> torch.Tensor:
        score = self.lin(x).abs()
        return score


def test_a_method_not_called_in_the_first_iteration_is_said_then_and_again_at_exit() -> None:
    model = _EvalOnly()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ModelTracer(model, ["metrics.score", "lin"]):
            model(torch.ones(2, 3))
            early = [str(w.message) for w in caught]
            model(torch.ones(2, 3))
    assert early == [
        "vartrace: pattern 'metrics.score' recorded nothing in iteration 1: its method was "
        "not called (<root>.metrics); it may run only in eval or in later iterations, and "
        "vartrace says so again at exit if it never does"
    ]
    late = [str(w.message) for w in caught[1:]]
    assert len(late) == 1 and "its method was never called (<root>.metrics)" in late[0]


def test_reading_the_results_of_a_tracer_never_started_warns() -> None:
    model = nn.Linear(2, 2)
    tracer = ModelTracer(model, ["forward"])
    model(torch.ones(2))
    with pytest.warns(UserWarning, match="was never started, so it recorded nothing"):
        assert len(tracer.results) == 0
    with pytest.warns(UserWarning, match="never started while the model ran 1 time"):
        del tracer
        gc.collect()


def test_a_tracer_collected_unstarted_while_the_model_ran_warns() -> None:
    """Issue 35 item 3: `ModelTracer(...)` without `with` or `start()` says so when it goes."""
    model = nn.Linear(2, 2)
    tracer = ModelTracer(model, ["forward"])
    for _ in range(3):
        model(torch.ones(2))
    with pytest.warns(UserWarning, match=r"never started while the model ran 3 time\(s\)"):
        del tracer
        gc.collect()
    assert not model._forward_pre_hooks  # the counting hook went with it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        idle = ModelTracer(model, ["forward"])  # the model never ran: nothing to say
        del idle
        gc.collect()
        warm = ModelTracer(model, ["forward"])
        model(torch.ones(2))  # a warm-up call before the start is no mistake
        with warm:
            model(torch.ones(2))
        del warm
        gc.collect()
    assert not model._forward_pre_hooks


def test_a_tracer_never_started_in_a_script_warns_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "forgot.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom vartrace import ModelTracer\n"
        "model = nn.Linear(2, 2)\ntracer = ModelTracer(model, ['forward'])\n"
        "for _ in range(5):\n    model(torch.ones(2))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert "never started while the model ran 5 time(s): nothing was recorded" in done.stderr


class _Traceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin(x)
        return torch.relu(hidden) * 2


def test_a_local_of_fx_generated_code_says_why_it_is_none_and_every_records_it() -> None:
    graph = torch.fx.symbolic_trace(_Traceable())
    x = torch.randn(2, 4)
    with (
        pytest.warns(UserWarning, match=r"torch.fx's generated code frees each value") as caught,
        ModelTracer(graph, ["forward.relu"], mode="any"),
    ):
        graph(x)
    assert "'forward.relu@every'" in str(caught[0].message)
    with ModelTracer(graph, ["forward.relu@every"], mode="any") as tracer:
        graph(x)
    generated = graph.code.splitlines()
    (computed,) = [n for n, text in enumerate(generated, 1) if "relu = torch.relu(" in text]
    (freed,) = [n for n, text in enumerate(generated, 1) if text.endswith("relu = None")]
    assert set(tracer.results) == {f"forward.relu@every:L{n}" for n in (computed, freed)}
    (relu,) = tracer.results[f"forward.relu@every:L{computed}"].values
    with torch.no_grad():
        assert torch.equal(relu, torch.relu(graph.lin(x)))
    assert tracer.results[f"forward.relu@every:L{freed}"].values == [None]  # `relu = None`


def _attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(q @ k.transpose(-1, -2), -1)
    return weights @ k


class _Attends(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _attend(x, x)
        return out


def test_a_function_called_at_any_depth_is_named_with_a_double_star() -> None:
    model = nn.Sequential(_Attends(), _Attends())
    with ModelTracer(model, ["**>_attend.weights"], mode="any") as tracer:
        model(torch.randn(2, 3, 4))
    assert sorted(tracer.results) == ["0.forward>_attend.weights", "1.forward>_attend.weights"]


def test_async_staging_without_an_accelerator_says_what_it_does() -> None:
    model = nn.Linear(2, 2)
    with (
        pytest.warns(UserWarning, match="no record of iteration 1 was an accelerator tensor"),
        ModelTracer(model, ["forward"], staging="async", mode="any"),
    ):
        model(torch.ones(2))
