"""Aliases in run files: a site name stored as a link to another site's records.

Written with the real saver (`H5PYSaverCallback.alias`), read back with `vartrace.open`,
the command line run as a real subprocess, a killed writer killed with SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from tests._killed import kill_when_ready
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.layout import NAME_END, SITE_INDEX, TARGET
from vartrace.trace import RunContext, Trace

CALLED = "layers.0.attn.forward>eager_attention_forward.attn_weights"
ALIAS = "layers.0.attn.forward.attn_weights"


def _trace(values: list[float], iterations: list[int], orders: list[int]) -> Trace:
    return Trace([torch.full((2, 3), v) for v in values], iterations, [0] * len(values), orders)


@pytest.mark.parametrize("background", [False, True])
def test_an_alias_reads_its_targets_records_under_its_own_name(
    tmp_path: Path, background: bool
) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False, background=background) as saver:
        saver("forward.x", _trace([0.0], [1], [0]))
        saver.alias(ALIAS, CALLED)  # before its target's records, as the tracer calls it
        saver(CALLED, _trace([1.0, 2.0], [1, 2], [1, 3]))
        saver("loss", _trace([3.0], [1], [2]))
        saver.flush()
    with vartrace.open(path) as run:
        assert run.names == ["forward.x", ALIAS, CALLED, "loss"]  # tied: by name
        assert run.aliases == {ALIAS: CALLED}
        assert ALIAS in run and len(run) == 4
        site = run[ALIAS]
        assert site.name == ALIAS and site.order.tolist() == [1, 3]
        assert torch.equal(site.get(2), torch.full((2, 3), 2.0))
        frame = run.to_frame("max")
        assert frame.loc[frame["site"] == ALIAS, "max"].tolist() == [1.0, 2.0]
        assert len(frame) == 6


def test_an_alias_given_records_of_its_own_becomes_an_ordinary_site(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver(CALLED, _trace([1.0], [1], [0]))
        saver.alias(ALIAS, CALLED)
        saver.flush()
        saver(ALIAS, _trace([5.0], [2], [1]))  # no longer the same tensor
        saver.flush()
    with vartrace.open(path) as run:
        assert run.aliases == {} and run.names == [CALLED, ALIAS]
        assert run[ALIAS].iterations.tolist() == [2]
        assert run[CALLED].iterations.tolist() == [1]


def test_an_alias_given_another_target_reads_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("a", _trace([1.0], [1], [0]))
        saver.alias("x", "a")
        saver.flush()
        saver("b", _trace([2.0], [2], [1]))
        saver.alias("x", "b")
    with vartrace.open(path) as run:
        assert run.aliases == {"x": "b"} and run.names == ["a", "b", "x"]


def test_an_append_keeps_the_aliases_and_can_turn_one_ordinary(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("t", _trace([1.0], [1], [0]))
        saver.alias("kept", "t")
        saver.alias("changed", "t")
    with H5PYSaverCallback(path, metadata=False, append=True) as saver:
        saver("t", _trace([2.0], [2], [1]))
        saver("changed", _trace([9.0], [2], [2]))
    with vartrace.open(path) as run:
        assert run.aliases == {"kept": "t"}
        assert run["kept"].iterations.tolist() == [1, 2]
        assert run["changed"].iterations.tolist() == [2]


def test_the_shards_of_a_run_read_the_union_of_their_aliases(tmp_path: Path) -> None:
    for rank in range(2):
        saver = H5PYSaverCallback(tmp_path / "run.h5", metadata=False)
        saver.on_start(RunContext(rank=rank, world_size=2, sharded=True))
        with saver:
            saver("t", Trace([torch.ones(2) * rank], [1], [rank], [0]))
            saver.alias(f"only{rank}", "t")
    with vartrace.open(tmp_path / "run.rank*.h5") as run:
        assert run.aliases == {"only0": "t", "only1": "t"}
        assert run["only1"].ranks.tolist() == [0, 1]


def test_an_alias_of_a_site_with_records_or_of_no_site_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("a", _trace([1.0], [1], [0]))
        saver("b", _trace([2.0], [1], [1]))
        saver.flush()
        with pytest.warns(RuntimeWarning, match="site 'b' holds records of its own"):
            saver.alias("b", "a")
        saver.alias("c", "never")
        with pytest.warns(UserWarning, match=r"no alias for 'c' .* 'never' received no record"):
            saver.close()
    with vartrace.open(path) as run:
        assert run.aliases == {} and run.names == ["a", "b"]


def test_files_without_aliases_hold_no_alias_rows(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("a", _trace([1.0], [1], [0]))
    with h5py.File(path, "r") as handle:
        rows = handle[SITE_INDEX][()]
        assert rows[rows[:, NAME_END] > 0, TARGET].tolist() == [-1]  # one site, no alias
        assert sorted(handle) == ["committed", "site_index", "site_names", "vars"]
        assert list(handle["vars"]) == ["a"]


_KILLED = """
import sys, time
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace

saver = H5PYSaverCallback(sys.argv[1], metadata=False)
saver("t", Trace([torch.ones(2)], [1], [0], [0]))
saver.alias("committed", "t")
saver.flush()
saver.alias("to_new", "new")
saver("new", Trace([torch.ones(2)], [2], [0], [1]))
saver.alias("unflushed", "t")
print("unflushed", flush=True)
time.sleep(600)
"""


def test_a_killed_writer_keeps_only_its_committed_aliases(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    kill_when_ready(_KILLED, path)
    with vartrace.open(path) as run:
        assert run.names == ["committed", "t"] and run.aliases == {"committed": "t"}
        assert np.asarray(run["committed"].values).tolist() == [[1.0, 1.0]]


def test_vartrace_ls_lists_a_run_with_aliases(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver(CALLED, _trace([1.0], [1], [0]))
        saver.alias(ALIAS, CALLED)
    result = subprocess.run(
        [sys.executable, "-m", "vartrace", "ls", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert ALIAS in result.stdout and CALLED in result.stdout


def test_a_site_made_an_alias_of_its_own_alias_is_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("a", _trace([1.0], [1], [0]))
        saver.alias("c", "a")
        saver.flush()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saver.alias("a", "c")  # `a` reads as `c` reads already: nothing to say
            saver.alias("a", "a")
    assert [str(warning.message) for warning in caught] == []
    with vartrace.open(path) as run:
        assert run.aliases == {"c": "a"} and run["a"].iterations.tolist() == [1]
