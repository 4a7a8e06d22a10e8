"""vartrace.compare on in-memory results, tracers and real HDF5 files."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from vartrace.analysis.comparison import Comparison, Divergence, compare
from vartrace.analysis.sources import results_frame
from vartrace.trace import Trace

SITES = ("embed", "layers.0.out", "layers.1.out", "loss")


def make_results(
    iterations: int = 3,
    *,
    perturb: dict[tuple[str, int], float] | None = None,
    seed: int = 0,
) -> dict[str, Trace]:
    """Records of four sites per iteration, in execution order ``SITES``."""
    generator = torch.Generator().manual_seed(seed)
    results: dict[str, Trace] = {name: Trace() for name in SITES}
    order = 0
    for iteration in range(1, iterations + 1):
        for name in SITES:
            shape = () if name == "loss" else (4, 6)
            value = torch.randn(shape, generator=generator)
            if perturb and (name, iteration) in perturb:
                value = value + perturb[(name, iteration)]
            results[name].append(value, iteration, 0, order)
            order += 1
    return results


def test_equal_runs_are_ok() -> None:
    report = compare(make_results(), make_results())
    assert isinstance(report, Comparison)
    assert report.ok
    assert report.first_divergence is None
    assert report.only_in_a == [] and report.only_in_b == []
    assert [s.site for s in report.sites] == list(SITES)
    assert all(s.records == 3 and s.status == "ok" and s.max_abs_diff == 0 for s in report.sites)
    assert all(s.min_cosine == pytest.approx(1.0) for s in report.sites)
    assert "first divergence: none" in str(report)


def test_first_divergence_follows_execution_order_not_names() -> None:
    # "layers.1.out" diverges at iteration 2, "embed" (alphabetically first) only at 3.
    b = make_results(perturb={("layers.1.out", 2): 1e-3, ("embed", 3): 1.0, ("loss", 2): 1.0})
    report = compare(make_results(), b)
    assert not report.ok
    assert report.first_divergence == Divergence("layers.1.out", 2, 0)
    site, iteration, rank = report.first_divergence
    assert (site, iteration, rank) == ("layers.1.out", 2, 0)
    summary = {s.site: s for s in report.sites}
    assert summary["layers.1.out"].differing == 1
    assert summary["layers.1.out"].max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert summary["layers.0.out"].status == "ok"
    text = str(report)
    assert "first divergence: layers.1.out at iteration 2, rank 0" in text
    assert "DIFFERS" in text


def test_tolerances() -> None:
    b = make_results(perturb={("layers.0.out", 1): 1e-4})
    assert not compare(make_results(), b).ok
    assert compare(make_results(), b, atol=1e-3).ok
    assert not compare(make_results(), b, atol=1e-5, rtol=0).ok
    scaled = make_results()
    for trace in scaled.values():
        trace.values = [v * (1 + 1e-4) for v in trace.values]
    assert not compare(make_results(), scaled).ok
    assert compare(make_results(), scaled, rtol=1e-3).ok
    with pytest.raises(ValueError, match="tolerances"):
        compare(make_results(), scaled, atol=-1)


def test_statistics_match_numpy() -> None:
    rng = np.random.default_rng(3)
    a_values = [rng.standard_normal((3, 50)).astype(np.float32) for _ in range(4)]
    b_values = [v + rng.standard_normal(v.shape).astype(np.float32) * 0.1 for v in a_values]
    a = {"x": Trace(a_values, [1, 2, 3, 4], [0] * 4, [0, 1, 2, 3])}
    b = {"x": Trace(b_values, [1, 2, 3, 4], [0] * 4, [0, 1, 2, 3])}
    frame = compare(a, b).to_frame()
    assert list(frame["iteration"]) == [1, 2, 3, 4]
    for row, x, y in zip(frame.itertuples(), a_values, b_values, strict=True):
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        diff = np.abs(x64 - y64)
        assert row.max_abs_diff == pytest.approx(diff.max(), rel=1e-6)
        assert row.max_rel_diff == pytest.approx((diff / np.abs(y64)).max(), rel=1e-6)
        cos = np.dot(x64.ravel(), y64.ravel()) / np.linalg.norm(x64) / np.linalg.norm(y64)
        assert row.cosine == pytest.approx(cos, rel=1e-9)
        assert row.mean_a == pytest.approx(x64.mean(), rel=1e-9)
        assert row.std_b == pytest.approx(y64.std(), rel=1e-9)
        assert row.var_a == pytest.approx(x64.var(), rel=1e-9)
        assert row.mean_diff == pytest.approx(x64.mean() - y64.mean(), rel=1e-9, abs=1e-12)
        assert row.var_diff == pytest.approx(x64.var() - y64.var(), rel=1e-9, abs=1e-12)
        assert row.allclose == bool(np.allclose(x, y, atol=1e-8, rtol=1e-5))
        assert row.status == "differs"


def test_large_records_use_the_same_statistics() -> None:
    """Records big enough to be reduced one per step give the numpy answers too."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 300, 300)).astype(np.float32)
    y = x.copy()
    y[1, 7, 9] += 0.5
    a = {"big": Trace([x[0], x[1]], [1, 2], [0, 0], [0, 1])}
    b = {"big": Trace([y[0], y[1]], [1, 2], [0, 0], [0, 1])}
    report = compare(a, b)
    frame = report.to_frame()
    assert list(frame["allclose"]) == [True, False]
    assert frame["max_abs_diff"][1] == pytest.approx(0.5, rel=1e-6)
    assert frame["mean_b"][1] == pytest.approx(y[1].astype(np.float64).mean(), rel=1e-9)
    assert report.first_divergence == Divergence("big", 2, 0)


def test_huge_records_are_reduced_in_column_slices() -> None:
    """Records longer than a column slice (2**20 elements) give the numpy answers too."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 1100, 1000)).astype(np.float32)
    y = x.copy()
    y[1, 1090, 5] += 0.25  # in the second, narrower slice
    y[2, 1099, 999] = np.nan
    a = {"huge": Trace(list(x), [1, 2, 3], [0, 0, 0], [0, 1, 2])}
    b = {"huge": Trace(list(y), [1, 2, 3], [0, 0, 0], [0, 1, 2])}
    frame = compare(a, b).to_frame()
    assert list(frame["allclose"]) == [True, False, False]
    assert frame["max_abs_diff"][1] == pytest.approx(0.25, rel=1e-6)
    assert math.isnan(frame["max_abs_diff"][2])
    x64, y64 = x[1].astype(np.float64), y[1].astype(np.float64)
    assert frame["mean_b"][1] == pytest.approx(y64.mean(), rel=1e-12)
    assert frame["var_a"][1] == pytest.approx(x64.var(), rel=1e-12)
    cos = np.dot(x64.ravel(), y64.ravel()) / np.linalg.norm(x64) / np.linalg.norm(y64)
    assert frame["cosine"][1] == pytest.approx(cos, rel=1e-12)
    assert frame["cosine"][0] == 1.0 and frame["std_a"][0] == pytest.approx(x[0].std(), rel=1e-6)


def test_occurrences_within_an_iteration_are_matched_in_order() -> None:
    values = [torch.full((2,), float(i)) for i in range(4)]
    # Two calls per iteration (a shared layer); b's second call of iteration 2 differs.
    a = {"shared": Trace(list(values), [1, 1, 2, 2], [0] * 4, [0, 1, 2, 3])}
    b_values = [*values[:3], values[3] + 1]
    b = {"shared": Trace(b_values, [1, 1, 2, 2], [0] * 4, [0, 1, 2, 3])}
    frame = compare(a, b).to_frame()
    assert list(frame["occurrence"]) == [0, 1, 0, 1]
    assert list(frame["allclose"]) == [True, True, True, False]


def test_records_are_matched_by_rank() -> None:
    a = {"x": Trace([torch.zeros(2), torch.ones(2)], [1, 1], [0, 1], [0, 0])}
    b = {"x": Trace([torch.ones(2), torch.zeros(2) + 5], [1, 1], [1, 0], [0, 0])}
    report = compare(a, b)
    assert report.first_divergence == Divergence("x", 1, 0)
    frame = report.to_frame()
    assert dict(zip(frame["rank"], frame["allclose"], strict=True)) == {0: False, 1: True}


def test_shape_mismatch() -> None:
    a = make_results()
    b = make_results()
    b["layers.0.out"].values[1] = torch.zeros(4, 7)
    report = compare(a, b)
    assert not report.ok
    assert report.first_divergence == Divergence("layers.0.out", 2, 0)
    frame = report.to_frame()
    row = frame[(frame["site"] == "layers.0.out") & (frame["iteration"] == 2)].iloc[0]
    assert row["status"] == "shape mismatch"
    assert not row["shape_match"] and not row["allclose"]
    assert row["shape_a"] == (4, 6) and row["shape_b"] == (4, 7)
    assert math.isnan(row["max_abs_diff"])
    assert "SHAPE MISMATCH" in str(report)


def test_sites_on_one_side_are_listed_not_errors() -> None:
    a = make_results()
    b = make_results()
    a["only.a"] = Trace([torch.ones(1)], [1], [0], [99])
    b["only.b"] = Trace([torch.ones(1)], [1], [0], [99])
    del b["embed"]
    report = compare(a, b)
    assert report.ok
    assert report.only_in_a == ["embed", "only.a"]
    assert report.only_in_b == ["only.b"]
    assert {s.site for s in report.sites} == {"layers.0.out", "layers.1.out", "loss"}
    text = str(report)
    assert "only in a (2): embed, only.a" in text
    assert "only in b (1): only.b" in text


def test_records_on_one_side_only_differ() -> None:
    a = make_results(iterations=3)
    b = make_results(iterations=2)
    report = compare(a, b)
    assert not report.ok
    assert report.first_divergence == Divergence("embed", 3, 0)
    frame = report.to_frame()
    missing = frame[frame["status"] == "only in a"]
    assert sorted(missing["site"]) == sorted(SITES)
    assert set(missing["iteration"]) == {3}
    assert set(missing["order_b"]) == {-1}
    report = compare(b, a)
    assert set(report.to_frame().query("status == 'only in b'")["iteration"]) == {3}


def test_names_filter() -> None:
    b = make_results(perturb={("embed", 1): 1.0})
    report = compare(make_results(), b, names=["layers.*"])
    assert [s.site for s in report.sites] == ["layers.0.out", "layers.1.out"]
    assert report.ok
    report = compare(make_results(), b, names="embed")
    assert [s.site for s in report.sites] == ["embed"] and not report.ok
    with pytest.raises(ValueError, match=r"no site matches 'nothing\.\*'"):
        compare(make_results(), b, names=["nothing.*"])


def test_nan_inf_and_value_kinds() -> None:
    nan, inf = math.nan, math.inf
    a = {
        "nan_same": Trace([torch.tensor([1.0, nan, inf])], [1], [0], [0]),
        "nan_one": Trace([torch.tensor([1.0, nan])], [1], [0], [1]),
        "bf16": Trace([torch.tensor([1.0, 2.0], dtype=torch.bfloat16)], [1], [0], [2]),
        "ints": Trace([torch.tensor([2**60, 3])], [1], [0], [3]),
        "flag": Trace([True], [1], [0], [4]),
        "text": Trace(["abc", None], [1, 2], [0, 0], [5, 6]),
        "cplx": Trace([torch.tensor([1 + 1j, 2 - 1j])], [1], [0], [7]),
    }
    b = {
        "nan_same": Trace([torch.tensor([1.0, nan, inf])], [1], [0], [0]),
        "nan_one": Trace([torch.tensor([1.0, 2.0])], [1], [0], [1]),
        "bf16": Trace([torch.tensor([1.0, 2.0], dtype=torch.bfloat16)], [1], [0], [2]),
        "ints": Trace([torch.tensor([2**60 + 1, 3])], [1], [0], [3]),
        "flag": Trace([True], [1], [0], [4]),
        "text": Trace(["abd", None], [1, 2], [0, 0], [5, 6]),
        "cplx": Trace([torch.tensor([1 + 1j, 2 - 1j])], [1], [0], [7]),
    }
    frame = compare(a, b).to_frame().set_index(["site", "iteration"])
    assert frame.loc[("nan_same", 1), "allclose"]
    assert frame.loc[("nan_same", 1), "max_abs_diff"] == 0
    assert not frame.loc[("nan_one", 1), "allclose"]
    assert math.isnan(frame.loc[("nan_one", 1), "max_abs_diff"])
    assert frame.loc[("bf16", 1), "allclose"] and frame.loc[("bf16", 1), "dtype_a"] == "bfloat16"
    assert not frame.loc[("ints", 1), "allclose"]  # differs beyond float64 precision
    assert frame.loc[("flag", 1), "allclose"]
    assert not frame.loc[("text", 1), "allclose"]
    assert frame.loc[("text", 2), "allclose"]
    assert frame.loc[("cplx", 1), "allclose"]
    assert frame.loc[("cplx", 1), "cosine"] == pytest.approx(1.0)


def test_stacked_and_padded_values() -> None:
    values = torch.zeros(3, 4, 5)
    values[0, :2, :3] = torch.arange(6.0).reshape(2, 3)
    padded = Trace(
        values,
        torch.tensor([1, 2, 3]),
        torch.zeros(3, dtype=torch.long),
        torch.tensor([0, 1, 2]),
        shapes=[(2, 3), (4, 5), (1, 1)],
    )
    listed = Trace(
        [values[0, :2, :3], values[1], values[2, :1, :1]], [1, 2, 3], [0, 0, 0], [0, 1, 2]
    )
    report = compare({"x": padded}, {"x": listed})
    assert report.ok
    assert list(report.to_frame()["shape_a"]) == [(2, 3), (4, 5), (1, 1)]


def test_tracers_and_float64_reference() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference.load_state_dict(model.state_dict())
    from vartrace.tracing.tracer import ModelTracer

    x = torch.randn(5, 4)
    with ModelTracer(model, ["*", "forward"]) as fp32:
        model(x)
    with ModelTracer(reference, ["*", "forward"]) as fp64:
        reference(x.double())
    assert not compare(fp64, fp32, atol=0, rtol=0).ok
    report = compare(fp64, fp32, atol=1e-6, rtol=1e-5)
    assert report.ok, str(report)
    frame = report.to_frame()
    assert set(frame["dtype_a"]) == {"float64"} and set(frame["dtype_b"]) == {"float32"}
    assert (frame["max_abs_diff"] > 0).any()


def test_csv_and_frame_contents(tmp_path) -> None:
    b = make_results(perturb={("layers.1.out", 2): 0.25})
    report = compare(make_results(), b)
    path = report.to_csv(tmp_path / "diff.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    frame = report.to_frame()
    assert len(rows) == len(frame) == len(report) == 12
    assert list(rows[0]) == list(frame.columns)
    assert {"cosine", "mean_diff", "std_diff", "var_diff", "max_rel_diff"} <= set(rows[0])
    bad = [r for r in rows if r["status"] != "ok"]
    assert [(r["site"], r["iteration"]) for r in bad] == [("layers.1.out", "2")]
    assert float(bad[0]["max_abs_diff"]) == pytest.approx(0.25, rel=1e-6)
    assert float(bad[0]["mean_diff"]) == pytest.approx(-0.25, rel=1e-5)
    assert bad[0]["shape_a"] == "(4, 6)" and bad[0]["allclose"] == "False"
    loss = next(r for r in rows if r["site"] == "loss")
    assert loss["shape_a"] == "()"


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="expected a path, an open run"):
        compare(42, make_results())


def test_results_frame() -> None:
    results = make_results()
    results["note"] = Trace(["hello"], [1], [0], [100])
    frame = results_frame(results, stat="std")
    assert list(frame.columns) == ["site", "iteration", "rank", "order", "shape", "dtype", "std"]
    assert len(frame) == 13
    first = frame.iloc[0]
    expected = results["embed"].values[0].double().std(unbiased=False).item()
    assert first["site"] == "embed" and first["shape"] == (4, 6) and first["dtype"] == "float32"
    assert first["std"] == pytest.approx(expected)
    note = frame[frame["site"] == "note"].iloc[0]
    assert note["dtype"] == "str" and note["shape"] == () and math.isnan(note["std"])
    with pytest.raises(ValueError, match="unknown statistic"):
        results_frame(results, stat="median-ish")


# --------------------------------------------------------------------------- files


def write_run(path, results: dict[str, Trace], *, chunk: int = 2) -> None:
    """Write in-memory results to ``path`` through the real saver, ``chunk`` records per gather."""
    from vartrace.storage.writer import H5PYSaverCallback

    with H5PYSaverCallback(path, metadata=False) as saver:
        for name, trace in results.items():
            for start in range(0, len(trace), chunk):
                part = slice(start, start + chunk)
                piece = Trace(
                    list(trace.values[part]),
                    list(trace.iterations[part]),
                    list(trace.ranks[part]),
                    list(trace.order[part]),
                )
                saver(name, piece)
            saver.flush()


def test_files_equal_and_perturbed(tmp_path) -> None:
    write_run(tmp_path / "a.h5", make_results())
    write_run(tmp_path / "same.h5", make_results())
    write_run(tmp_path / "b.h5", make_results(perturb={("layers.0.out", 3): 1e-3}))
    report = compare(tmp_path / "a.h5", str(tmp_path / "same.h5"))
    assert report.ok and [s.site for s in report.sites] == list(SITES)
    report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.first_divergence == Divergence("layers.0.out", 3, 0)
    assert str(tmp_path / "a.h5") in str(report).splitlines()[0]
    # a file against in-memory results, and an open run
    import vartrace.storage.reader as reader

    with reader.open_run(tmp_path / "b.h5") as run:
        report = compare(make_results(), run)
        assert report.first_divergence == Divergence("layers.0.out", 3, 0)
        assert run["loss"].values is not None  # the caller's run stays open


def test_file_value_kinds(tmp_path) -> None:
    """bfloat16, ragged, None, str, a record of another dtype, integers: through a file."""
    rows = [1, 2, 3, 4]
    results = {
        "bf16": Trace([torch.randn(3, dtype=torch.bfloat16) for _ in rows], rows, [0] * 4, rows),
        "ragged": Trace([torch.ones(i, 2) * i for i in rows], rows, [0] * 4, rows),
        "mixed": Trace(
            [torch.ones(2), None, "text", torch.ones(2, dtype=torch.float64)], rows, [0] * 4, rows
        ),
        "ints": Trace([torch.arange(5) * i for i in rows], rows, [0] * 4, rows),
        "scalars": Trace([0.5, 1.5, 2, True], rows, [0] * 4, rows),
    }
    write_run(tmp_path / "a.h5", results)
    report = compare(tmp_path / "a.h5", results)
    assert report.ok, str(report)
    frame = report.to_frame().set_index(["site", "iteration"])
    assert frame.loc[("bf16", 1), "dtype_a"] == "bfloat16"
    assert frame.loc[("ragged", 3), "shape_a"] == (3, 2)
    assert frame.loc[("mixed", 4), "dtype_a"] == "float64"
    assert frame.loc[("mixed", 2), "dtype_a"] == "none"
    changed = dict(results)
    changed["bf16"] = Trace(
        [v + 1 if i == 2 else v for i, v in enumerate(results["bf16"].values)], rows, [0] * 4, rows
    )
    changed["mixed"] = Trace(
        [torch.ones(2), None, "other", torch.ones(2, dtype=torch.float64)], rows, [0] * 4, rows
    )
    changed["ragged"] = Trace([torch.ones(i, 2) * i for i in (1, 2, 3, 5)], rows, [0] * 4, rows)
    report = compare(tmp_path / "a.h5", changed)
    frame = report.to_frame().set_index(["site", "iteration"])
    assert not frame.loc[("bf16", 3), "allclose"] and frame.loc[("bf16", 2), "allclose"]
    assert frame.loc[("mixed", 3), "status"] == "differs"
    assert frame.loc[("ragged", 4), "status"] == "shape mismatch"
    assert report.first_divergence == Divergence("bf16", 3, 0)


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x

    __hash__ = None  # type: ignore[assignment]


def test_pickled_records_are_not_unpickled(tmp_path) -> None:
    results = {"obj": Trace([Opaque(1), Opaque(2)], [1, 2], [0, 0], [0, 1])}
    write_run(tmp_path / "a.h5", results)
    write_run(tmp_path / "b.h5", results)
    report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.ok
    assert set(report.to_frame()["status"]) == {"not compared"}
    assert report.sites[0].status == "not compared"
    assert "NOT COMPARED" in str(report)


def test_sharded_run_by_glob(tmp_path) -> None:
    from vartrace.storage.writer import H5PYSaverCallback
    from vartrace.trace import RunContext

    merged = {"w": Trace()}
    for rank in (0, 1):
        saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
        values = [torch.full((2,), 10.0 * rank + i) for i in range(3)]
        saver("w", Trace(list(values), [1, 2, 3], [rank] * 3, [0, 1, 2]))
        saver.close()
        for i, v in enumerate(values):
            merged["w"].append(v, i + 1, rank, i)
    report = compare(tmp_path / "run.rank*.h5", merged)
    assert report.ok and report.sites[0].records == 6
    merged["w"].values[4] = merged["w"].values[4] + 1  # rank 1, iteration 2
    assert compare(tmp_path / "run.rank*.h5", merged).first_divergence == Divergence("w", 2, 1)


def test_results_frame_matches_run_to_frame(tmp_path) -> None:
    results = make_results()
    results["note"] = Trace(["hello", None], [1, 2], [0, 0], [100, 101])
    write_run(tmp_path / "a.h5", results)
    import vartrace.storage.reader as reader

    with reader.open_run(tmp_path / "a.h5") as run:
        for stat in ("mean", "std", "absmax", "norm"):
            from_file = run.to_frame(stat=stat).sort_values(["site", "order"], ignore_index=True)
            in_memory = results_frame(results, stat=stat)
            in_memory = in_memory.sort_values(["site", "order"], ignore_index=True)
            assert list(from_file.columns) == list(in_memory.columns)
            for column in ("site", "iteration", "rank", "order", "shape", "dtype"):
                assert list(from_file[column]) == list(in_memory[column]), column
            np.testing.assert_allclose(from_file[stat], in_memory[stat], rtol=1e-12)


def test_record_stats_from_a_file(tmp_path) -> None:
    from vartrace.analysis.sources import open_source, record_stats

    results = make_results()
    write_run(tmp_path / "a.h5", results)
    with open_source(tmp_path / "a.h5") as source:
        stats = record_stats(source.site("layers.1.out"), ("std", "max"))
    stds = stats["std"]
    expected = [v.double().std(unbiased=False).item() for v in results["layers.1.out"].values]
    np.testing.assert_allclose(stds, expected, rtol=1e-12)
    maxima = [v.max().item() for v in results["layers.1.out"].values]
    np.testing.assert_array_equal(stats["max"], maxima)


def test_zero_copy_views_and_hdf5_reads_agree(tmp_path) -> None:
    """Records viewed in place through a memory map give exactly what HDF5 reads give."""
    from vartrace.analysis.sources import BufferPool, open_source
    from vartrace.storage.writer import H5PYSaverCallback

    generator = torch.Generator().manual_seed(5)
    # 256 KiB records: two per chunk, four chunks per gather
    records = [torch.randn(256, 256, generator=generator) for _ in range(24)]
    ragged = [torch.randn(1 + i % 3, 8, generator=generator) for i in range(24)]
    for name, options in (("plain.h5", {}), ("gzip.h5", {"compression": "gzip"})):
        with H5PYSaverCallback(tmp_path / name, metadata=False, **options) as saver:
            for start in range(0, 24, 8):  # three gathers: chunks from several writes
                its = list(range(start + 1, start + 9))
                saver("x", Trace(records[start : start + 8], its, [0] * 8, its))
                saver("ragged", Trace(ragged[start : start + 8], its, [0] * 8, its))
                saver.flush()
    rows = np.arange(24)
    with open_source(tmp_path / "plain.h5") as plain, open_source(tmp_path / "gzip.h5") as gz:
        views = plain.site("x").views(rows, (256, 256))
        assert views is not None and sum(len(v) for _, v in views) == 24
        assert not views[0][1].flags.writeable  # a view of the file, not a copy
        assert gz.site("x").views(rows, (256, 256)) is None  # compressed: read through HDF5
        assert plain.site("ragged").views(rows[:1], (1, 8)) is None  # padded records
        stacked = np.concatenate([v for _, v in views])
        np.testing.assert_array_equal(stacked, torch.stack(records).numpy())
        read = plain.site("x").read(rows[3:20], (256, 256), BufferPool())
        np.testing.assert_array_equal(read, stacked[3:20])
        # odd row sets: gaps and a single record
        picked = np.array([0, 1, 2, 9, 17, 23])
        pieces = plain.site("x").views(picked, (256, 256))
        positions = [p for p, _ in pieces]
        assert positions[0] == 0 and positions == sorted(positions) and 3 in positions
        got = np.concatenate([v for _, v in pieces])
        np.testing.assert_array_equal(got, stacked[picked])
    memory = {"x": Trace(records, list(range(1, 25)), [0] * 24, list(range(1, 25)))}
    memory["ragged"] = Trace(ragged, list(range(1, 25)), [0] * 24, list(range(1, 25)))
    from_views = compare(tmp_path / "plain.h5", memory).to_frame()
    from_reads = compare(tmp_path / "gzip.h5", memory).to_frame()
    assert from_views["allclose"].all() and from_reads["allclose"].all()
    columns = ["mean_a", "std_a", "var_a", "cosine", "max_abs_diff"]
    np.testing.assert_array_equal(from_views[columns].to_numpy(), from_reads[columns].to_numpy())
    changed = dict(memory)
    tags = list(range(1, 25))
    changed["x"] = Trace([r + (i == 13) for i, r in enumerate(records)], tags, [0] * 24, tags)
    report = compare(tmp_path / "plain.h5", changed)
    assert report.first_divergence == Divergence("x", 14, 0)


def test_buffer_pool_reuses_memory() -> None:
    from vartrace.analysis.sources import BufferPool

    pool = BufferPool()
    first = pool.take((4, 8), np.dtype(np.float32))
    first[...] = 1.0
    pool.give(first)
    second = pool.take((2, 8), np.dtype(np.float64))  # same 128 bytes, another dtype
    assert second.shape == (2, 8) and second.dtype == np.float64
    assert np.shares_memory(second, first)
    third = pool.take((4, 8), np.dtype(np.float32))  # nothing free: fresh memory
    assert not np.shares_memory(third, second)
    pool.give(np.zeros(3))  # not from the pool: ignored
    pool.give(third)
    assert np.shares_memory(pool.take((4, 8), np.dtype(np.float32)), third)


def test_blocks_reduced_on_threads_fill_their_own_rows(monkeypatch) -> None:
    """Many small blocks per site, finishing in any order, give the one-thread report."""
    from vartrace.analysis.comparison import engine as compare_module

    monkeypatch.setattr(compare_module, "_READ_BYTES", 4 * 6 * 8 * 2)  # two records a block
    perturb = {(name, it): 1e-3 * it for name in SITES[1:3] for it in (2, 5, 7)}
    a, b = make_results(8), make_results(8, perturb=perturb)
    threaded = compare(a, b, progress=True).to_frame()
    monkeypatch.setattr(compare_module.os, "cpu_count", lambda: 1)
    single = compare(a, b).to_frame()
    assert len(threaded) == 8 * len(SITES)
    np.testing.assert_array_equal(
        threaded.drop(columns="status").to_numpy(dtype=object),
        single.drop(columns="status").to_numpy(dtype=object),
    )
    assert (threaded["status"] == single["status"]).all()
    differing = threaded[~threaded["allclose"].astype(bool)]
    assert sorted(zip(differing["site"], differing["iteration"], strict=True)) == sorted(perturb)


def test_vartrace_compare_stays_the_function_after_submodule_imports() -> None:
    import vartrace

    # importing the subpackage must not shadow the function
    import vartrace.analysis.comparison.report

    assert callable(vartrace.compare)
    assert vartrace.compare is compare and vartrace.Comparison is Comparison


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(x)
        return hidden.relu().sum()


def _record_run(path, dtype: torch.dtype) -> None:
    """The same model and inputs, traced in ``dtype``, saved to ``path``."""
    from vartrace.storage.writer import H5PYSaverCallback
    from vartrace.tracing.tracer import ModelTracer

    torch.manual_seed(0)
    model = _Block().to(dtype)
    inputs = [torch.randn(4, 8).to(dtype) for _ in range(2)]
    with (
        H5PYSaverCallback(path, metadata=False) as saver,
        ModelTracer(model, ["forward.hidden", "forward"], post_gather_callbacks=[saver]),
    ):
        for x in inputs:
            model(x)


def test_a_dtype_mismatch_is_said_in_the_table_and_the_frame(tmp_path) -> None:
    """An fp32 run against a bf16 one: each site says "float32 vs bfloat16" in the
    summary, the printed table and the footer, and ``dtype_match`` is False per row."""
    _record_run(tmp_path / "fp32.h5", torch.float32)
    _record_run(tmp_path / "bf16.h5", torch.bfloat16)
    _record_run(tmp_path / "again.h5", torch.float32)
    report = compare(tmp_path / "fp32.h5", tmp_path / "bf16.h5", atol=0.1, rtol=0.1)
    assert [(s.site, s.dtypes, s.dtype_match) for s in report.sites] == [
        ("forward.hidden", "float32 vs bfloat16", False),
        ("forward", "float32 vs bfloat16", False),
    ]
    text = str(report)
    header, _, *rows = text.splitlines()[1:4]
    assert "dtype" in header.split()
    assert all("float32 vs bfloat16" in row for row in rows), text
    assert "2 sites compared, 0 differ, 4 record pairs, 2 with different dtypes" in text
    frame = report.to_frame()
    assert frame["dtype_match"].tolist() == [False] * 4
    assert set(zip(frame["dtype_a"], frame["dtype_b"], strict=True)) == {("float32", "bfloat16")}

    same = compare(tmp_path / "fp32.h5", tmp_path / "again.h5")
    assert [(s.dtypes, s.dtype_match) for s in same.sites] == [("float32", True)] * 2
    assert "with different dtypes" not in str(same)
    assert same.to_frame()["dtype_match"].tolist() == [True] * 4


def test_the_benchmark_prints_its_ratios_and_finds_the_perturbed_sites(tmp_path) -> None:
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_compare.py"
    argv = ["--sites", "5", "--iterations", "4", "--record-kib", "16", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, str(tool), *argv, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "ratio compare / read:" in done.stdout
    # every fifth site is perturbed from the middle iteration on: site 0, iteration 3
    assert "first_divergence=Divergence(site='layers.0.block.forward.hidden', iteration=3" in (
        done.stdout
    )
    assert "differing sites=1" in done.stdout
