"""Sites are made with HDF5's own calls, reusing the layout of the first of their kind: the
same groups, datasets, attributes and dimension scales as h5py's high-level calls make."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import vartrace
from vartrace import H5PYSaverCallback, Trace

# Records of each kind of site: numeric (1-D, 2-D, 0-d), str, bytes, mixed kinds (`other`),
# ragged, and None first.
KINDS: dict[str, list[Any]] = {
    "vector": [np.arange(5, dtype=np.float32) + step for step in range(3)],
    "matrix": [np.full((2, 3), step, np.int16) for step in range(3)],
    "scalar": [np.float64(step) for step in range(3)],
    "text": ["a", "bé", "c"],
    "blob": [b"x", b"\0y", b""],
    "mixed": [None, np.arange(3), "s"],
    "ragged": [np.zeros(step + 1, np.float32) for step in range(3)],
    "late": [None, None, np.arange(2)],
}


def _write(path: Path, copies: int, **options: Any) -> None:
    """`copies` sites of each kind (`<kind>.<n>`; `<kind>.é<n>`: a non-ASCII link name)."""
    with H5PYSaverCallback(path, metadata=False, **options) as saver:
        for copy in range(copies):
            for kind, records in KINDS.items():
                trace = Trace()
                for step, record in enumerate(records):
                    trace.append(record, step + 1, 0, step)
                saver(f"{kind}.{'é' if copy % 2 else ''}{copy}", trace)
        saver.flush()


def _structure(group: h5py.Group) -> dict[str, Any]:
    """What a site group holds, its own name left out: every object's creation properties,
    datatype, shape, attributes (type and value) and dimension-scale references."""
    site = group.name

    def attributes(obj: h5py.HLObject) -> dict[str, Any]:
        found = {}
        for name in obj.attrs:
            attribute = h5py.h5a.open(obj.id, name.encode())
            value = obj.attrs[name]
            if name == "DIMENSION_LIST":
                value = [
                    [h5py.h5r.get_name(ref, obj.id).decode() for ref in refs] for refs in value
                ]
            elif name == "REFERENCE_LIST":
                value = [
                    (h5py.h5r.get_name(ref, obj.id).decode(), int(axis)) for ref, axis in value
                ]
            elif name in ("name", "slot"):
                value = type(value)  # the site's own
            kind = attribute.get_type()
            found[name] = (kind.get_class(), kind.get_size(), attribute.shape, repr(value))
        return {name: repr(value).replace(site, "<site>") for name, value in found.items()}

    made: dict[str, Any] = {
        "": (attributes(group), group.id.get_create_plist().get_obj_track_times())
    }
    for name, dataset in group.items():
        plist = dataset.id.get_create_plist()
        filters = [plist.get_filter(index)[:3] for index in range(plist.get_nfilters())]
        made[name] = (
            dataset.dtype.str,
            h5py.check_vlen_dtype(dataset.dtype),
            dataset.shape,
            dataset.maxshape,
            dataset.chunks,
            dataset.fillvalue if dataset.dtype.kind != "O" else None,
            filters,
            plist.get_fill_time(),
            plist.get_alloc_time(),
            plist.get_obj_track_times(),
            attributes(dataset),
        )
    return made


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_a_site_made_from_a_reused_layout_holds_what_h5py_made_for_the_first(
    tmp_path: Path, compression: str | None
) -> None:
    path = tmp_path / "run.h5"
    _write(path, 3, compression=compression)
    with h5py.File(path, "r") as handle:
        sites = handle["vars"]
        for kind in KINDS:
            first = _structure(sites[f"{kind}.0"])  # made by h5py's calls
            assert _structure(sites[f"{kind}.é1"]) == first
            assert _structure(sites[f"{kind}.2"]) == first
            assert sites.id.links.get_info(f"{kind}.é1".encode()).cset == h5py.h5t.CSET_UTF8
            assert sites.id.links.get_info(f"{kind}.2".encode()).cset == h5py.h5t.CSET_ASCII
            # what every vartrace reader reads of a site group (vartrace 0.1 on)
            assert isinstance(sites[f"{kind}.2"].attrs["slot"], np.int64)
            assert sites[f"{kind}.é1"].attrs["name"] == f"{kind}.é1"
    with vartrace.open(path) as run:
        for kind, records in KINDS.items():
            site = run[f"{kind}.é1"]
            for index, record in enumerate(records):
                read = site.record(index)
                if isinstance(record, np.ndarray):
                    assert np.array_equal(read, record)
                else:
                    assert read == record


def test_sites_after_the_first_of_their_layout_skip_h5pys_per_call_setup(tmp_path: Path) -> None:
    # h5py's create_dataset rebuilt the creation property list and datatype for each of a
    # site's datasets: 8 calls a site, 80% of the cost of creating it.
    profile = cProfile.Profile()
    profile.enable()
    _write(tmp_path / "run.h5", 10)
    profile.disable()
    calls = {
        name: count
        for (path, _, name), (count, *_) in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
        if path.endswith("dataset.py") and name == "make_new_dset"
    }
    # one a layout (tags, kinds, values and shapes of each dtype and chunk shape, the scales);
    # the root index's three; none for the 9 later copies of each kind
    assert 0 < sum(calls.values()) < 2 * len(KINDS) + 16, calls
