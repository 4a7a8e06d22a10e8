"""compare's shorter paths give the numbers of the general one.

Records whose bits are equal on both sides skip the arithmetic on differences;
these tests pin what such records report (against float64 references) and
that a record pair which is equal in value but not in bits (-0.0 against 0.0),
or a differing record beside identical ones, still takes the general path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vartrace.analysis.comparison import compare
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import Trace


def _trace(records: list[np.ndarray]) -> Trace:
    """One site's records, one an iteration from 1 on."""
    trace = Trace()
    for iteration, record in enumerate(records, start=1):
        trace.append(torch.from_numpy(record.copy()), iteration, 0, iteration)
    return trace


def _finite_reference(x: np.ndarray) -> tuple[float, float, float]:
    """mean, var and std in float64 of the finite values of `x`."""
    finite = x[np.isfinite(x)].astype(np.float64)
    return finite.mean(), finite.var(), finite.std()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("size", [24, 5000])  # below and above the einsum cut-over
def test_identical_records_report_their_own_statistics(dtype: type, size: int) -> None:
    rng = np.random.default_rng(1)
    records = [(rng.standard_normal(size) * 3 + 1).astype(dtype) for _ in range(3)]
    records[1][[2, 7, 11]] = [np.nan, np.inf, -np.inf]
    frame = compare({"x": _trace(records)}, {"x": _trace(records)}).to_frame()
    assert frame["allclose"].all() and (frame["status"] == "ok").all()
    assert (frame["max_abs_diff"] == 0).all() and (frame["max_rel_diff"] == 0).all()
    assert (frame["cosine"] == 1).all()
    for row, record in zip(frame.itertuples(), records, strict=True):
        mean, var, std = _finite_reference(record)
        assert row.mean_a == row.mean_b == pytest.approx(mean, rel=1e-9, abs=1e-12)
        assert row.var_a == row.var_b == pytest.approx(var, rel=1e-9)
        assert row.std_a == row.std_b == pytest.approx(std, rel=1e-9)
        assert row.mean_diff == row.var_diff == row.std_diff == 0


def test_equal_values_with_other_bits_and_a_differing_record_among_identical_ones() -> None:
    rng = np.random.default_rng(2)
    records = [rng.standard_normal(600).astype(np.float32) for _ in range(4)]
    records[0][:5] = 0.0
    other = [r.copy() for r in records]
    other[0][:5] = -0.0  # equal values, other bits
    other[2][10] += 0.5  # differs, between identical records
    frame = compare({"x": _trace(records)}, {"x": _trace(other)}, atol=0, rtol=0).to_frame()
    assert frame["allclose"].tolist() == [True, True, False, True]
    assert frame["max_abs_diff"].tolist() == [0.0, 0.0, pytest.approx(0.5, rel=1e-6), 0.0]
    x64, y64 = records[2].astype(np.float64), other[2].astype(np.float64)
    cosine = x64 @ y64 / np.linalg.norm(x64) / np.linalg.norm(y64)
    assert frame["cosine"][2] == pytest.approx(cosine, rel=1e-12)
    assert frame["mean_b"][2] == pytest.approx(y64.mean(), rel=1e-12)
    assert frame["var_a"][0] == frame["var_b"][0] == pytest.approx(records[0].var(), rel=1e-6)


def test_identical_runs_in_files_read_in_place(tmp_path) -> None:
    """Records of files viewed through a memory map: identical runs, then one late change."""
    rng = np.random.default_rng(3)
    blocks = rng.standard_normal((6, 8, 512)).astype(np.float32)
    changed = blocks.copy()
    changed[5, 3, 100] += 1e-3
    for name, values in (("a.h5", blocks), ("b.h5", blocks), ("c.h5", changed)):
        saver = H5PYSaverCallback(tmp_path / name)
        saver(
            "layers.0.out",
            Trace(
                torch.from_numpy(values.copy()),
                torch.arange(1, 7),
                torch.zeros(6, dtype=torch.long),
                torch.arange(6),
            ),
        )
        saver.close()
    same = compare(tmp_path / "a.h5", tmp_path / "b.h5", atol=0, rtol=0)
    assert same.ok and same.sites[0].max_abs_diff == 0
    frame = same.to_frame()
    reference = blocks.reshape(6, -1).astype(np.float64)
    np.testing.assert_allclose(frame["mean_a"], reference.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(frame["var_b"], reference.var(axis=1), rtol=1e-12)
    late = compare(tmp_path / "a.h5", tmp_path / "c.h5", atol=0, rtol=0)
    assert late.first_divergence.iteration == 6
    assert late.to_frame()["allclose"].tolist() == [True] * 5 + [False]


def _save(path, values: np.ndarray, first: int = 1, **options) -> None:
    saver = H5PYSaverCallback(path, **options)
    count = len(values)
    saver(
        "layers.0.out",
        Trace(
            torch.from_numpy(values.copy()),
            torch.arange(first, first + count),
            torch.zeros(count, dtype=torch.long),
            torch.arange(first, first + count),
        ),
    )
    saver.close()


def test_chunks_of_new_and_continued_files_start_at_cache_line_offsets(tmp_path) -> None:
    """A memory map of a run then gives numpy aligned arrays, which it reduces in place."""
    import h5py

    from vartrace.analysis.sources.chunk_maps import FileMaps

    rng = np.random.default_rng(4)
    path = tmp_path / "run.h5"
    _save(path, rng.standard_normal((5, 3, 1000)).astype(np.float32))  # 12 KB records
    _save(path, rng.standard_normal((7, 3, 1000)).astype(np.float32), first=6, append=True)
    with h5py.File(path, "r") as f:
        values = f["vars/layers.0.out/values"]
        chunks = range(values.id.get_num_chunks())
        offsets = [values.id.get_chunk_info(index).byte_offset for index in chunks]
        assert len(offsets) >= 2 and all(offset % 64 == 0 for offset in offsets), offsets
        views = FileMaps().chunk_map(values).groups(np.arange(12))
        assert views and all(view.flags.aligned for _, view in views)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_records_give_the_numbers_of_aligned_ones(dtype: type) -> None:
    """Files written before chunks were aligned: their records lie at odd offsets."""
    from vartrace.analysis.comparison.kernels import numeric_stats

    rng = np.random.default_rng(5)
    a = rng.standard_normal((9, 3000)).astype(dtype)
    b = a.copy()
    b[4:, ::7] += 1e-3  # identical rows, then differing ones
    b[6, 3] = np.nan
    unaligned = []
    for x in (a, b):
        raw = bytearray(x.nbytes + 1)
        view = np.frombuffer(raw, dtype, x.size, offset=1).reshape(x.shape)
        view[...] = x
        assert not view.flags.aligned
        unaligned.append(view)
    expected = numeric_stats(a, b, 1e-6, 1e-5)
    got = numeric_stats(*unaligned, 1e-6, 1e-5)
    for name, column in expected.items():
        np.testing.assert_array_equal(got[name], column, err_msg=name)
