"""`vartrace.open` of a directory, several directories or globs, or a list of any of these:
the shards of one run, a missing rank reported, never an error for the others."""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest

import vartrace
from tests._manifest_runs import assert_same_run, write_shard
from vartrace.cli import main

WORLD = 4


@pytest.fixture
def nodes(tmp_path: Path) -> list[Path]:
    """Ranks 0 and 1 in `node0/`, rank 3 in `node1/` (rank 2's node never wrote), `node2/`
    empty, and every shard again in `all/`."""
    folders = [tmp_path / f"node{k}" for k in range(3)]
    for folder in (*folders, tmp_path / "all"):
        folder.mkdir()
    for rank, folder in ((0, folders[0]), (1, folders[0]), (3, folders[1])):
        write_shard(folder, rank, WORLD, flushes=2)
        write_shard(tmp_path / "all", rank, WORLD, flushes=2)
    return folders


def _open(spec: object) -> vartrace.Run:
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) 2 of a 4-rank run are missing") as got:
        run = vartrace.open(spec)  # type: ignore[arg-type]
    assert len([w for w in got if "missing" in str(w.message)]) == 1
    return run


def test_directories_globs_and_lists_open_as_one_run(nodes: list[Path], tmp_path: Path) -> None:
    node0, node1, empty = nodes
    expected = [node0 / "run.rank0.h5", node0 / "run.rank1.h5", node1 / "run.rank3.h5"]
    specs: list[object] = [
        [node0, node1],
        [str(node0), str(node1), empty],  # an empty directory among others: nothing of it
        [node0 / "run.rank*.h5", node1],
        [str(tmp_path / "node*" / "run.rank*.h5")],
        str(tmp_path / "node[01]" / "*.h5"),
        [node0 / "run.rank0.h5", node0 / "run.rank1.h5", str(node1 / "*.h5"), node0],  # twice
    ]
    with _open(tmp_path / "all") as whole:
        for spec in specs:
            with _open(spec) as run:
                assert run.paths == expected, spec
                assert run.missing_ranks == [2]
                assert_same_run(run, whole)


def test_a_list_naming_no_file_is_an_error_naming_it(nodes: list[Path], tmp_path: Path) -> None:
    empty = nodes[2]
    with pytest.raises(FileNotFoundError) as raised:
        vartrace.open([empty, tmp_path / "none*.h5"])
    assert raised.value.errno == errno.ENOENT and str(empty) in str(raised.value)
    with pytest.raises(FileNotFoundError, match="no file matches the pattern"):
        vartrace.open(tmp_path / "none*.h5")
    with pytest.raises(FileNotFoundError):  # a named file that is not there stays an error
        vartrace.open([nodes[0] / "run.rank0.h5", nodes[1] / "run.rank2.h5"])


def test_the_cli_opens_a_directory(nodes: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["ls", str(nodes[0])]) == 0
    out, err = capsys.readouterr()
    assert "blocks.0.forward.x" in out and "rank(s) 2, 3 of a 4-rank run are missing" in err


def test_many_missing_ranks_are_named_as_ranges(tmp_path: Path) -> None:
    """One shard of a six-rank run opened alone: the warning names ranks 1-5 as one range, so
    a shard of a thousand-rank run does not print 999 numbers."""
    shard = write_shard(tmp_path, 0, 6, flushes=1)
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) 1-5 of a 6-rank run are missing"):
        run = vartrace.open(shard)
    with run:
        assert run.missing_ranks == [1, 2, 3, 4, 5]
