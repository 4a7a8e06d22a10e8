"""Format version 2 (one `tags` dataset a site, `shapes` only where a record needs it)
and version-1 files, written by the saver of the first layout, read and appended alike."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import vartrace
from vartrace import H5PYSaverCallback, Trace
from vartrace.storage.layout import FORMAT_VERSION


def _write(path: Path, version: int | None = None, *, append: bool = False) -> None:
    """Two gathers of a uniform site, a ragged one and a mixed one; a file of `version`
    (the saver's own when None)."""
    with H5PYSaverCallback(path, metadata=False, append=append) as saver:
        if version is not None:
            saver._format = version
        for gather in range(2):
            steps = [1 + 2 * gather, 2 + 2 * gather]
            uniform = [np.full(3, s, np.float32) for s in steps]
            saver("uniform", Trace(uniform, steps, [0, 0], [s - 1 for s in steps]))
            ragged = [np.ones((2, 2), np.float32), np.ones((2, 1 + 2 * gather), np.float32)]
            saver("ragged", Trace(ragged, steps, [0, 0], [10 + s for s in steps]))
            mixed = [np.zeros(2, np.float32), None if gather else "x"]
            saver("mixed", Trace(mixed, steps, [0, 0], [20 + s for s in steps]))
            saver.flush()


def _contents(path: Path) -> dict[str, list[tuple[int, int, int, object]]]:
    """Each site's records as (iteration, rank, order, value as a list or itself)."""
    with vartrace.open(path) as run:
        return {
            name: [
                (int(i), int(r), int(o), v.tolist() if hasattr(v, "tolist") else v)
                for i, r, o, v in zip(
                    site.iterations,
                    site.ranks,
                    site.order,
                    map(site.record, range(len(site))),
                    strict=True,
                )
            ]
            for name in run.names
            for site in [run[name]]
        }


def _version(path: Path) -> int:
    with h5py.File(path, "r") as handle:
        return int(handle.attrs["vartrace_format"])


def test_a_version_1_file_reads_as_the_same_records_of_version_2(tmp_path: Path) -> None:
    old, new = tmp_path / "old.h5", tmp_path / "new.h5"
    _write(old, 1)
    _write(new)
    assert (_version(old), _version(new)) == (1, FORMAT_VERSION) == (1, 2)
    with h5py.File(old, "r") as handle:
        assert {"iterations", "ranks", "order", "kinds", "shapes"} <= set(handle["vars/uniform"])
    assert _contents(old) == _contents(new)
    with vartrace.open(old) as run_old, vartrace.open(new) as run_new:
        for name in run_old.names:
            np.testing.assert_array_equal(run_old[name].shapes, run_new[name].shapes)
            np.testing.assert_array_equal(run_old[name].in_values, run_new[name].in_values)


def test_a_uniform_site_holds_its_tags_and_values_only(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write(path)
    with h5py.File(path, "r") as handle:
        uniform = handle["vars/uniform"]
        data = {name for name in uniform if not name.endswith(("_dim1", "records"))}
        assert data == {"tags", "values"}
        assert uniform["tags"][:].tolist() == [
            [step, 0, step - 1, uniform["tags"][0, 3]] for step in range(1, 5)
        ]
        assert "shapes" not in handle["vars/mixed"]  # None and str records: in kinds and other
        # the ragged site got its shapes at its second gather, the first's rows included
        assert handle["vars/ragged/shapes"][:].tolist() == [[2, 2], [2, 1], [2, 2], [2, 3]]
    with vartrace.open(path) as run:
        assert run["uniform"].shapes.tolist() == [[3]] * 4
        assert run["mixed"].shapes.tolist() == [[2], [-1], [2], [-1]]
        assert run["ragged"].record(1).shape == (2, 1)


@pytest.mark.parametrize("version", [1, 2])
def test_an_append_keeps_the_files_version(tmp_path: Path, version: int) -> None:
    path = tmp_path / "run.h5"
    _write(path, version)
    first = _contents(path)
    with pytest.warns(UserWarning, match="already holds iterations up to 4"):
        _write(path, append=True)  # a saver that would create version 2
    with H5PYSaverCallback(path, metadata=False, append=True) as saver:
        saver("late", Trace([np.ones(2, np.float32)], [9], [0], [100]))  # a site made anew
    assert _version(path) == version
    with h5py.File(path, "r") as handle:
        for name in ("uniform", "late"):
            assert ("tags" in handle["vars"][name]) == (version == 2)
            assert ("iterations" in handle["vars"][name]) == (version == 1)
    after = _contents(path)
    for name, records in first.items():
        assert after[name][: len(records)] == records and len(after[name]) == 2 * len(records)
    assert [i for i, *_ in after["uniform"]] == list(range(1, 9))
