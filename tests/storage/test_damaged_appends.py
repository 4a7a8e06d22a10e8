"""`append=True` on a damaged or crafted root index: the appender reads the file through the
reader's own checks, so it refuses what the reader refuses with a `RunFileError` naming the
damage (never a raw `KeyError` or `IndexError`) and leaves the refused file byte for byte as
it was; a crafted `slot` cannot make an append grow the file by its size."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from vartrace.errors import RunFileError
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.layout import LAST_TAGS
from vartrace.trace import Trace


def _base(path: Path) -> None:
    """A genuine run: sites `w` and `v`, and `a`, an alias of `w`."""
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver("w", Trace([torch.arange(4.0) + i for i in range(3)], [1, 2, 3], [0] * 3, [0, 1, 2]))
        saver("v", Trace([torch.ones(2)], [3], [0], [3]))
        saver.alias("a", "w")


def _no_site_names(handle: h5py.File) -> None:
    del handle["site_names"]


def _alias_past_the_slots(handle: h5py.File) -> None:
    index = handle["site_index"]
    rows = index[()]
    alias = int(np.flatnonzero(rows[:, 3] >= 0)[0])
    rows[alias, 3] = len(handle["committed"]) + 5
    index[...] = rows


def _alias_name_not_utf8(handle: h5py.File) -> None:
    rows, names = handle["site_index"][()], handle["site_names"][()]
    alias = int(np.flatnonzero(rows[:, 3] >= 0)[0])
    names[rows[alias, 0]] = 0xFF
    handle["site_names"][...] = names


def _negative_count(handle: h5py.File) -> None:
    counts = handle["committed"][()]
    counts[handle["vars/v"].attrs["slot"]] = -3
    handle["committed"][...] = counts


def _slot_not_an_integer(handle: h5py.File) -> None:
    handle["vars/v"].attrs["slot"] = "one"


def _slot_negative(handle: h5py.File) -> None:
    handle["vars/v"].attrs["slot"] = -1


def _slot_huge(handle: h5py.File) -> None:
    handle["vars/v"].attrs["slot"] = 1 << 24


def _last_tags_of_two(handle: h5py.File) -> None:
    handle.attrs[LAST_TAGS] = np.array([3, 3], np.int64)


def _last_tags_near_int64_end(handle: h5py.File) -> None:
    last = handle.attrs[LAST_TAGS]
    handle.attrs[LAST_TAGS] = np.array([2**63 - 2, last[1], last[2]], np.int64)


DAMAGES: dict[str, tuple[Callable[[h5py.File], None], str]] = {
    "site_names missing": (_no_site_names, "/site_index is there without /site_names"),
    "alias past the slots": (_alias_past_the_slots, "impossible row for slot"),
    "alias name not UTF-8": (_alias_name_not_utf8, "no UTF-8"),
    "negative count": (_negative_count, "counts -3 records"),
    "slot not an integer": (_slot_not_an_integer, "no integer 'slot'"),
    "slot negative": (_slot_negative, "has the slot -1"),
    "slot 2**24": (_slot_huge, f"has the slot {1 << 24}"),
    "last_tags of two values": (_last_tags_of_two, "last_tags is not 3 integers"),
    "last_tags near 2**63": (_last_tags_near_int64_end, "pass int64's largest"),
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_append_to_a_damaged_index_is_refused_leaving_the_file_as_it_was(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    craft, said = DAMAGES[damage]
    with h5py.File(path, "r+") as handle:
        craft(handle)
    before = _digest(path)
    saver = H5PYSaverCallback(path, append=True, metadata=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal, not a warning and a rewritten file
        with pytest.raises(RunFileError, match="damaged file") as refused:
            saver("w", Trace([torch.zeros(4)], [4], [0], [4]))
    assert said in str(refused.value)
    saver.close()
    assert _digest(path) == before


READ_TOO = ["site_names missing", "alias past the slots", "alias name not UTF-8", "negative count"]


@pytest.mark.parametrize("damage", READ_TOO)
def test_the_reader_refuses_the_same_damage(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    craft, said = DAMAGES[damage]
    with h5py.File(path, "r+") as handle:
        craft(handle)
    with vartrace.open(path) as run, pytest.raises(RunFileError, match=said):
        _ = run.names


def test_an_append_beside_a_killed_writers_uncounted_sites_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:  # sites a killed writer made, never counted
        slots = len(handle["committed"])
        for n in range(3):
            handle.create_group(f"vars/late{n}").attrs["slot"] = slots + n
    size = path.stat().st_size
    with H5PYSaverCallback(path, append=True, metadata=False) as saver:
        saver("w", Trace([torch.zeros(4)], [4], [0], [4]))
    assert path.stat().st_size < 2 * size
    with vartrace.open(path) as run:
        assert sorted(run.names) == ["a", "v", "w"] and len(run["w"]) == 4


def test_an_append_to_a_file_whose_last_tags_are_stale_reads_the_tags(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:  # (as a writer without last_tags leaves them)
        handle.attrs[LAST_TAGS] = np.array([1, 1, 999], np.int64)
    with H5PYSaverCallback(path, append=True, metadata=False) as saver:
        saver("w", Trace([torch.zeros(4)], [4], [0], [4]))
    with vartrace.open(path) as run:
        assert run["w"].iterations.tolist() == [1, 2, 3, 4]
        assert run["w"].order.tolist() == [0, 1, 2, 4]


def test_a_crafted_slot_met_walking_the_tags_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        handle.attrs[LAST_TAGS] = np.array([1, 1, 999], np.int64)
        handle["vars/v"].attrs["slot"] = 1 << 30
    before = _digest(path)
    saver = H5PYSaverCallback(path, append=True, metadata=False)
    with pytest.raises(RunFileError, match=f"has the slot {1 << 30}"):
        saver("w", Trace([torch.zeros(4)], [4], [0], [4]))
    saver.close()
    assert _digest(path) == before
