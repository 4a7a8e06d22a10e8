"""The root index (/site_index, /site_names): a run lists its sites without opening them.

Files are written by the real saver and read by ``vartrace.open``; older files (without
the index) are made by deleting it with h5py, and a killed writer is a real subprocess
killed with SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from tests._killed import kill_when_ready
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.layout import LAST_TAGS, NAME_END, SITE_INDEX, SITE_NAMES
from vartrace.storage.reader import RunFileError
from vartrace.trace import Trace


def _write(path: Path, sites: dict[str, list[int]], **options: object) -> None:
    """Write one float record per capture order in ``sites`` ({name: orders}), iteration
    = order + 1, in one gather."""
    with H5PYSaverCallback(path, metadata=False, **options) as saver:  # type: ignore[arg-type]
        for name, orders in sites.items():
            values = [torch.full((2,), float(order)) for order in orders]
            saver(name, Trace(values, [o + 1 for o in orders], [0] * len(orders), orders))


def _drop_index(path: Path) -> None:
    """Make ``path`` a file as vartrace wrote it before the root index."""
    with h5py.File(path, "r+") as handle:
        del handle[SITE_INDEX], handle[SITE_NAMES]


def test_listing_reads_the_index_and_opens_no_site(tmp_path: Path) -> None:
    """Names come in execution order from the index alone: a site whose group lost its
    slot attribute still lists, and using it names the damage."""
    path = tmp_path / "run.h5"
    _write(path, {"z.late": [5], "a.first": [0, 3], "m.middle": [2]})
    with h5py.File(path, "r+") as handle:
        del handle["vars/a.first"].attrs["slot"]
    with vartrace.open(path) as run:
        assert run.names == ["a.first", "m.middle", "z.late"] and len(run) == 3
        assert run["z.late"].iterations.tolist() == [6]
        with pytest.raises(RunFileError, match=r"/vars/a\.first has the slot attribute None"):
            run["a.first"]


def test_a_file_without_the_index_reads_and_an_append_gives_it_one(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"b": [1], "a": [0, 2], "weird/name%": [3]})
    _drop_index(path)
    with vartrace.open(path) as run:
        assert run.names == ["a", "b", "weird/name%"]
        assert run["a"].get(3).tolist() == [2.0, 2.0]
    with pytest.warns(UserWarning, match="already holds iterations up to 4"):
        _write(path, {"c": [0], "a": [1]}, append=True)  # moved past the file's tags
    with h5py.File(path, "r") as handle:
        assert SITE_INDEX in handle and SITE_NAMES in handle
    with vartrace.open(path) as run:
        assert run.names == ["a", "b", "weird/name%", "c"]
        assert run["a"].order.tolist() == [0, 2, 5] and run["c"].order.tolist() == [4]
        assert run["weird/name%"].get(4).tolist() == [3.0, 3.0]


def test_an_append_keeps_the_index_right(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"b": [0], "a": [1]})
    with pytest.warns(UserWarning, match="already holds iterations up to 2"):
        _write(path, {"c": [0], "b": [1], "d": [2]}, append=True)
    with vartrace.open(path) as run:
        assert run.names == ["b", "a", "c", "d"]
        assert run["b"].order.tolist() == [0, 3] and run["c"].order.tolist() == [2]
    walked = tmp_path / "walked.h5"
    walked.write_bytes(path.read_bytes())
    _drop_index(walked)
    with vartrace.open(path) as run, vartrace.open(walked) as old:
        assert run.names == old.names
        assert all((run[n].order == old[n].order).all() for n in run.names)


def test_index_rows_of_uncounted_slots_are_ignored(tmp_path: Path) -> None:
    """A row a killed writer wrote for a slot it never counted names nothing."""
    path = tmp_path / "run.h5"
    _write(path, {"a": [0]})
    with h5py.File(path, "r+") as handle:
        names = handle[SITE_NAMES]
        names[100:105] = np.frombuffer(b"ghost", np.uint8)
        handle[SITE_INDEX][7] = (100, 105, 0, -1)
    with vartrace.open(path) as run:
        assert run.names == ["a"]


def test_counted_slots_the_index_does_not_name_are_found_by_walking(tmp_path: Path) -> None:
    """A site an older vartrace appended (counted, not in the index) still lists."""
    path = tmp_path / "run.h5"
    _write(path, {"a": [0], "b": [1]})
    with h5py.File(path, "r+") as handle:
        handle[SITE_INDEX][int(handle["vars/b"].attrs["slot"]), NAME_END] = 0
    with vartrace.open(path) as run:
        assert run.names == ["a", "b"]


def test_an_impossible_index_row_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"a": [0]})
    with h5py.File(path, "r+") as handle:
        handle[SITE_INDEX][0, NAME_END] = 1 << 40
    with vartrace.open(path) as run, pytest.raises(RunFileError, match="/site_index holds"):
        _ = run.names


_KILLED = """
import sys, time
import torch
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace

saver = H5PYSaverCallback(sys.argv[1], metadata=False)
saver("b", Trace([torch.ones(2)], [1], [0], [0]))
saver("a", Trace([torch.ones(2)], [1], [0], [1]))
saver.flush()
for site in range(300):  # enough new sites for HDF5 to write some of them out unflushed
    saver(f"new.{site}", Trace([torch.ones(2)], [2], [0], [2 + site]))
saver("a", Trace([torch.zeros(2)], [2], [0], [400]))
print("unflushed", flush=True)
time.sleep(600)
"""


def test_a_killed_writer_lists_its_committed_sites_and_an_append_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    kill_when_ready(_KILLED, path)
    with vartrace.open(path) as run:
        assert run.names == ["b", "a"] and len(run["a"]) == 1
    with H5PYSaverCallback(path, append=True, metadata=False) as saver:
        saver("new.1", Trace([torch.ones(2)], [2], [0], [2]))
        saver("c", Trace([torch.ones(2)], [2], [0], [3]))
    with vartrace.open(path) as run:
        assert run.names == ["b", "a", "new.1", "c"]
        assert run["new.1"].order.tolist() == [2] and len(run["a"]) == 1


# -- the file's largest tags: an append reads them from the root ----------------------------


def _appended_iterations(path: Path) -> list[int]:
    """Append records tagged iterations 1 and 2 again (a restarted tracer) to site ``a``; the
    iterations the file then holds for it."""
    with (
        pytest.warns(UserWarning, match="already holds iterations up to"),
        H5PYSaverCallback(path, append=True, metadata=False) as saver,
    ):
        saver("a", Trace([torch.zeros(2), torch.ones(2)], [1, 2], [0, 0], [0, 1]))
    with vartrace.open(path) as run:
        return run["a"].iterations.tolist()


def test_the_root_keeps_the_largest_tags_with_the_count_they_go_with(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path, {"a": [0, 2], "b": [1, 5]})
    with h5py.File(path, "r") as handle:
        assert handle.attrs[LAST_TAGS].tolist() == [6, 5, 4]  # iteration 6, order 5, 4 records
    assert _appended_iterations(path) == [1, 3, 7, 8]
    with h5py.File(path, "r") as handle:
        assert handle.attrs[LAST_TAGS].tolist() == [8, 7, 6]


@pytest.mark.parametrize("state", ["absent", "stale"])
def test_largest_tags_absent_or_behind_the_counts_are_read_from_the_sites(
    tmp_path: Path, state: str
) -> None:
    # An older vartrace writes no last_tags, and may have appended to a file that has them:
    # their count is then not /committed's, and trusting them would number records again.
    path = tmp_path / "run.h5"
    _write(path, {"a": [0, 2], "b": [1, 5]})
    with h5py.File(path, "r+") as handle:
        if state == "absent":
            del handle.attrs[LAST_TAGS]
        else:
            handle.attrs[LAST_TAGS] = np.array([2, 1, 3], np.int64)
    assert _appended_iterations(path) == [1, 3, 7, 8]
