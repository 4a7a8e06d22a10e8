"""What indexing a site costs: each of its datasets opened once, its checks kept.

`vartrace.compare` indexes every site of both runs before it reduces any
record, so a dataset opened twice per site shows in every comparison.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import vartrace
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.codec import Kind
from vartrace.storage.reader import RunFileError
from vartrace.trace import Trace


def _run(path: Path, compression: str | None = None, version: int = 2) -> Path:
    """A run of one site `w`: four float32 records of shape (64, 64), which fill a chunk (so
    that, compressed, their chunk goes through the filter), in a file of format `version`."""
    records = [torch.full((64, 64), float(i)) for i in range(4)]
    with H5PYSaverCallback(path, metadata=False, compression=compression) as saver:
        saver._format = version
        saver("w", Trace(records, [1, 2, 3, 4], [0] * 4, [0, 1, 2, 3]))
    return path


def _opened(monkeypatch: pytest.MonkeyPatch) -> Counter[bytes]:
    """The names HDF5 objects are opened by from now on (h5py's opens still run)."""
    opened: Counter[bytes] = Counter()
    for module in (h5py.h5o, h5py.h5d):
        real = module.open

        def counted(location: Any, name: bytes, *args: Any, _real: Any = real) -> Any:
            opened[name] += 1
            return _real(location, name, *args)

        monkeypatch.setattr(module, "open", counted)
    return opened


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_indexing_a_site_opens_each_dataset_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str | None
) -> None:
    path = _run(tmp_path / "run.h5", compression)
    with h5py.File(path, "r") as handle:
        chunked = handle["vars/w/values"].chunks is not None
    with vartrace.open(path) as run:
        _ = run.names
        opened = _opened(monkeypatch)
        site = run["w"]
        assert len(site) == 4
    assert chunked
    expected = {b"w", b"values", b"tags"}
    assert set(opened) == expected
    # Compressed values are opened again with a chunk cache (rows share a compressed chunk).
    again = {b"values": 2} if compression else {}
    assert {name: n for name, n in opened.items() if n != 1} == again


def test_indexed_site_reads_its_records(tmp_path: Path) -> None:
    path = _run(tmp_path / "run.h5")
    with vartrace.open(path) as run:
        site = run["w"]
        assert site.dtype == "float32"
        assert site.kinds.tolist() == ["tensor"] * 4
        np.testing.assert_array_equal(site.record(2), np.full((64, 64), 2.0, np.float32))


def test_kind_code_beyond_a_byte_is_refused(tmp_path: Path) -> None:
    """A kinds dataset of wider integers than vartrace writes, one code past 127 whose low
    bits name a kind `values` holds: refused as a damaged file, naming the record."""
    path = _run(tmp_path / "run.h5", version=1)
    with h5py.File(path, "r+") as handle:
        group = handle["vars/w"]
        kinds = group["kinds"][()].astype(np.int64)
        kinds[1] = 0x100 | Kind.TENSOR
        del group["kinds"]
        group["kinds"] = kinds
    with vartrace.open(path) as run, pytest.raises(RunFileError, match=r"record 1 .*kind 257"):
        run["w"]
