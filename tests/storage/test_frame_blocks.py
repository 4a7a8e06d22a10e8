"""`Run.to_frame` reads each file's records in blocks, once for all the statistics asked,
and gives what each record alone gives.

The reference is the record-by-record path: a callable statistic receives each record's
value as `Site.get` gives it, reduced alone by `statistic_of`.  Runs are written with the
real saver, two shards of one run, and read back with `vartrace.open`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vartrace
from vartrace.markers import Unstored
from vartrace.statistics.named import statistic_of
from vartrace.storage.writer import H5PYSaverCallback
from vartrace.trace import RunContext, Trace

pytest.importorskip("pandas")

NAMES = ["mean", "std", "var", "min", "max", "absmax", "norm", "nan", "posinf", "zeros"]
FIELDS = ["count", "q0.5"]  # a field of statistics records; NaN for values
STD = 6.883963713291409  # a std whose square by Python's pow is not std * std


def _values(rank: int, iteration: int) -> dict[str, list[Any]]:
    """Per site, the records one rank gives at one iteration."""
    generator = torch.Generator().manual_seed(100 * rank + iteration)
    ragged = torch.randn((iteration + 1, 3 + rank), generator=generator)
    ragged[0, 0] = math.nan if iteration % 2 else math.inf
    whole = torch.randn((4, 5), generator=generator)
    stats = vartrace.stats(histogram=True, quantiles=(0.5,))
    odd = stats("stats", whole, iteration)
    odd[3] = STD  # its std
    return {
        "ragged": [ragged, ragged[:1] * 2],
        "bf16": [torch.randn((3, 7), generator=generator).bfloat16()],
        "stats": [stats("stats", whole, iteration), stats("stats", -whole, iteration), odd],
        "mixed": [
            whole.double(),
            Unstored("generator: cannot pickle 'generator' object"),
            None,
            iteration * 3,
            "text",
            torch.zeros(0),
        ],
    }


def _write(folder: Path) -> None:
    for rank in (0, 1):
        saver = H5PYSaverCallback(folder / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
        saver.alias("alias.of.ragged", "ragged")
        order = 0
        for iteration in (1, 2, 3):
            for name, values in _values(rank, iteration).items():
                count = len(values)
                orders = list(range(order, order + count))
                saver(name, Trace(values, [iteration] * count, [rank] * count, orders))
                order += count
            saver.flush()
        saver.close()


def _same(got: list[Any], want: list[Any]) -> bool:
    return all(
        a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
        for a, b in zip(got, want, strict=True)
    )


def test_to_frame_of_many_statistics_is_each_record_reduced_alone(tmp_path: Path) -> None:
    _write(tmp_path)
    with vartrace.open(tmp_path) as run:
        assert run.aliases == {"alias.of.ragged": "ragged"}
        frame = run.to_frame([*NAMES, *FIELDS])
        assert set(frame["site"]) == {"alias.of.ragged", "bf16", "mixed", "ragged", "stats"}
        assert len(frame) == sum(len(run[name]) for name in run.names)
        for stat in [*NAMES, *FIELDS]:
            alone = run.to_frame(lambda value, stat=stat: statistic_of(value, stat))
            for column in ("site", "iteration", "rank", "order", "shape", "dtype"):
                assert frame[column].tolist() == alone[column].tolist(), (stat, column)
            assert frame[stat].dtype == np.float64
            assert _same(frame[stat].tolist(), [float(v) for v in alone["stat"]]), stat
        stats = frame[frame["site"] == "stats"]
        assert (stats["count"] == 20).all() and stats["q0.5"].notna().all()
        assert stats["var"].tolist() == [std**2 for std in stats["std"].tolist()]
        assert STD**2 != STD * STD and STD**2 in stats["var"].tolist()
        assert frame.loc[frame["site"] == "bf16", "dtype"].unique().tolist() == ["bfloat16"]
        mixed = frame[frame["site"] == "mixed"]
        dtypes = ["float64", "unstored", "none", "int", "str", "float32"]
        assert mixed["dtype"].tolist()[:6] == dtypes
        assert mixed["mean"].isna().tolist()[:6] == [False, True, True, False, True, True]


def test_one_statistic_or_several_give_the_same_columns(tmp_path: Path) -> None:
    _write(tmp_path)
    with vartrace.open(tmp_path) as run:
        together = run.to_frame(NAMES)
        for stat in NAMES:
            alone = run.to_frame(stat)
            assert alone.drop(columns=stat).equals(together.drop(columns=NAMES)), stat
            assert _same(alone[stat].tolist(), together[stat].tolist()), stat


def test_the_frame_benchmark_prints_its_figure() -> None:
    """`tools/bench_frame.py` writes its shards and times to_frame of seven statistics (a
    smoke test of the benchmark: its figures are the README's)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_frame.py"
    done = subprocess.run(
        [sys.executable, str(tool), "--shards", "2", "--mib", "1", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "to_frame of 7 statistics, 2 shards" in done.stdout, done.stdout
