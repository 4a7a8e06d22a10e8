"""A site's appends cost HDF5's own work: no h5py wrapper, dataspace or datatype is made
per write of its tags, shapes and axis labels, and what they write reads back."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import h5py
import numpy as np
import pytest

import vartrace
from vartrace import H5PYSaverCallback, Trace
from vartrace.storage.layout import FORMAT_VERSION
from vartrace.storage.lifecycle import _CLOSING_CACHE
from vartrace.storage.lifecycle import shrink_metadata_cache as _shrink_metadata_cache


def _write(path: Path, sites: int, gathers: int, version: int = FORMAT_VERSION) -> None:
    """`sites` sites of 2-D float32 records (tags, values, shapes, an axis label each),
    `gathers` gathers of 3 records, the second with a wider record (its label grows), in a
    file of format `version`."""
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver._format = version
        for gather in range(gathers):
            for site in range(sites):
                trace = Trace()
                for step in range(3):
                    width = 4 + (gather == 1)
                    order = (3 * gather + step) * sites + site
                    trace.append(
                        np.full((2, width), order, np.float32), 3 * gather + step, 0, order
                    )
                saver(f"site{site}", trace)
            saver.flush()


def _calls(path: Path, sites: int, file: str, function: str) -> int:
    """Calls of `function` (of h5py's or vartrace's `file`) while `_write` writes `sites`."""
    profile = cProfile.Profile()
    profile.enable()
    _write(path, sites, gathers=3)
    profile.disable()
    path.unlink()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(
        count
        for (name, _, called), (count, *_) in stats.items()
        if name.endswith(file) and called == function
    )


def _per_site(path: Path, file: str, function: str) -> float:
    """Calls of `function` for each site beyond the first 10 (the file's own left out)."""
    return (_calls(path, 20, file, function) - _calls(path, 10, file, function)) / 10


def test_a_site_wraps_no_dataset_in_h5py_but_values(tmp_path: Path) -> None:
    # Each site wrapped its 8 datasets in h5py.Dataset, which makes three property lists
    # of its own (a third of the cost of creating a dataset).
    assert _per_site(tmp_path / "run.h5", "dataset.py", "__init__") <= 1


def test_a_new_site_wraps_not_even_its_values_in_h5py(tmp_path: Path) -> None:
    # A new site wrapped `values` in h5py.Dataset (two property lists: 100 k instructions,
    # a tenth of the Python above HDF5 in a site's creation) that no write used.
    assert _per_site(tmp_path / "run.h5", "dataset.py", "__init__") == 0


def test_a_new_sites_chunks_are_shaped_without_numpy_reductions(tmp_path: Path) -> None:
    # The chunk shape of a new site's values took np.prod twice and np.argmax once on a
    # list of a few ints (numpy's dispatch for each: 8 k instructions).
    assert _per_site(tmp_path / "run.h5", "fromnumeric.py", "prod") == 0


def test_sites_of_one_layout_share_the_dataspaces_their_datasets_are_made_with(
    tmp_path: Path,
) -> None:
    # Each dataset of a site was made with a dataspace of its own (h5s.create_simple: 14 k
    # instructions, 5 a site); HDF5 copies the one it is given into the dataset.
    with H5PYSaverCallback(tmp_path / "run.h5", metadata=False) as saver:
        for site in range(10):
            trace = Trace()
            trace.append(np.zeros((2, 4), np.float32), 1, 0, site)
            saver(f"site{site}", trace)
        # tags, the record axis' scale, a label of 4 rows, values and its label of 2 rows
        assert len(saver._made.spaces) == 5


def test_a_new_site_looks_up_no_group(tmp_path: Path) -> None:
    # The saver opened /vars again for each new site (0.1 ms of h5py's lookup).
    assert _per_site(tmp_path / "run.h5", "group.py", "__getitem__") == 0


def test_a_sites_appends_write_its_tags_and_shapes_without_put(tmp_path: Path) -> None:
    # _put asked HDF5 for each tag's dataspace and made a memory dataspace and datatype at
    # every write: 5 of a site's 6 writes a gather, a third of a small write's time.  What
    # is left is the records' own: stacked in gathers 1 and 2, one by one in gather 3.
    assert _per_site(tmp_path / "run.h5", "writer.py", "_put") == 1 + 1 + 3


@pytest.mark.parametrize("version", [1, 2])
def test_tags_shapes_and_grown_labels_read_back(tmp_path: Path, version: int) -> None:
    path = tmp_path / "run.h5"
    _write(path, sites=3, gathers=3, version=version)
    with vartrace.open(path) as run:
        site = run["site1"]
        assert len(site) == 9
        for index in range(9):
            width = 4 + (index // 3 == 1)
            order = index * 3 + 1
            np.testing.assert_array_equal(
                site.record(index), np.full((2, width), order, np.float32)
            )
    with h5py.File(path, "r", swmr=True) as handle:
        assert handle.attrs["vartrace_format"] == version
        group = handle["vars/site1"]
        assert group["values_dim2"].shape == (5,)
        if version == 1:
            iterations, order, kinds = (group[name][:] for name in ("iterations", "order", "kinds"))
        else:
            assert group["tags"].shape == (9, 4)
            iterations, _, order, kinds = group["tags"][:].T
        assert iterations.tolist() == list(range(9))
        assert order.tolist() == [index * 3 + 1 for index in range(9)]
        assert kinds.tolist() == [kinds[0]] * 9
        assert group["shapes"][:].tolist() == [[2, 4 + (index // 3 == 1)] for index in range(9)]


def test_a_closing_file_evicts_its_metadata_before_hdf5_empties_the_cache(tmp_path: Path) -> None:
    # HDF5 empties the cache at the close in passes that start over after each entry whose
    # eviction takes others along: 4 s to close a file of 4,000 sites (0.2 s evicted first).
    path = tmp_path / "run.h5"
    saver = H5PYSaverCallback(path, metadata=False)
    for site in range(1000):
        saver(f"site{site}", Trace([np.zeros(16, np.float32)], [1], [0], [site]))
    saver.flush()
    handle = saver._file
    assert handle is not None
    saver._appender.sites.clear()
    held = handle.id.get_mdc_size()[2]  # bytes of its entries
    _shrink_metadata_cache(handle)
    assert handle.id.get_mdc_size()[2] <= _CLOSING_CACHE < held / 4, held
    saver.close()
    with vartrace.open(path) as run:
        assert len(run.names) == 1000
        np.testing.assert_array_equal(run["site999"].record(0), np.zeros(16, np.float32))
