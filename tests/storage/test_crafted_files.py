"""Crafted run files, as a hostile sender makes them: nothing outside the file is read, and
nothing beyond what the file holds is allocated, through ``vartrace.open`` and every command.

Each file is a real vartrace file (written by the saver) altered with h5py: data kept in an
external file, external links, virtual datasets mapping another file, datasets declaring
gigabytes they do not hold (or hold as gzipped zeros, or as a few wide /meta entries).  The
"secret" is a local file (a ``.netrc`` stand-in).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import vartrace
from vartrace.statistics.records import Layout, record_dtype
from vartrace.storage import H5PYSaverCallback
from vartrace.storage.codec import IN_OTHER, Kind
from vartrace.storage.reader import RunFileError
from vartrace.trace import Trace

SECRET = "machine example.org login alice password hunter2-crafted"
#: Peak memory a command may reach on any crafted file (its own baseline is about 60 MiB).
RSS_LIMIT_MIB = 400
GIB = 1 << 30
#: Whether ``Site.to_xarray`` can run (its reads are checked only then).
XARRAY = importlib.util.find_spec("xarray") is not None


def _base(path: Path, version: int = 1) -> None:
    """A small genuine run of format `version` (1: the layout most cases below change by
    hand): a float site, a str site, and a little metadata."""
    with H5PYSaverCallback(path, metadata=False) as saver:
        saver._format = version
        saver("w", Trace([torch.arange(4.0) + i for i in range(3)], [1, 2, 3], [0] * 3, [0, 1, 2]))
        saver("note", Trace(["a", "b"], [1, 2], [0, 0], [3, 4]))
    with h5py.File(path, "r+") as handle:
        meta = handle.create_group("meta")
        meta.create_dataset("command", data=["train.py", "--lr", "0.1"])
        meta.create_group("git").create_dataset("commit", data="0123abcd")


def _secret_h5(root: Path) -> Path:
    path = root / "secret.h5"
    with h5py.File(path, "w") as handle:
        handle["x"] = np.frombuffer(SECRET.encode(), np.uint8)
        group = handle.create_group("w")
        group["values"] = np.frombuffer(SECRET.encode(), np.uint8)[None, :4].astype(np.float32)
    return path


def _meta_external_storage(handle: h5py.File, root: Path) -> str:
    size = len(SECRET)
    handle["meta"].create_dataset("notes", (size,), np.uint8, external=[(root / "netrc", 0, size)])
    return "/meta/notes"


def _values_external_storage(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    shape, dtype = group["values"].shape, group["values"].dtype
    del group["values"]
    values = group.create_dataset(
        "values", shape, dtype, external=[(root / "netrc", 0, int(np.prod(shape)) * 4)]
    )
    values.attrs.update(storage="array", key="float32/1", torch_dtype="")
    return "/vars/w/values"


def _meta_external_link(handle: h5py.File, root: Path) -> str:
    handle["meta/notes"] = h5py.ExternalLink(str(_secret_h5(root)), "/x")
    return "/meta/notes"


def _site_external_link(handle: h5py.File, root: Path) -> str:
    del handle["vars/w"]
    handle["vars/w"] = h5py.ExternalLink(str(_secret_h5(root)), "/w")
    return "/vars/w"


def _vanished_external_link(handle: h5py.File, root: Path) -> str:
    del handle["vars/w"]
    handle["vars/w"] = h5py.ExternalLink(str(root / "gone" / "vanished.h5"), "/w")
    return "/vars/w"


def _meta_virtual(handle: h5py.File, root: Path) -> str:
    layout = h5py.VirtualLayout((len(SECRET),), np.uint8)
    layout[:] = h5py.VirtualSource(str(_secret_h5(root)), "x", shape=(len(SECRET),))
    handle["meta"].create_virtual_dataset("notes", layout)
    return "/meta/notes"


def _values_virtual(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    shape = group["values"].shape
    del group["values"]
    layout = h5py.VirtualLayout(shape, np.float32)
    layout[0, :4] = h5py.VirtualSource(str(_secret_h5(root)), "w/values", shape=(1, 4))
    group.create_virtual_dataset("values", layout).attrs.update(
        storage="array", key="float32/1", torch_dtype=""
    )
    return "/vars/w/values"


def _meta_declared_8_gib(handle: h5py.File, root: Path) -> str:
    handle["meta"].create_dataset("big", (GIB,), np.int64, chunks=(1 << 16,))
    return "/meta/big"


def _tags_declared_8_gib(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    for name in ("iterations", "ranks", "order", "kinds"):
        group[name].resize((GIB,))
    group["values"].resize((GIB, *group["values"].shape[1:]))  # a row for each, declared too
    handle["committed"][int(group.attrs["slot"])] = GIB
    return "/vars/w/iterations"


def _record_declared_1_gib(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    del group["values"], group["shapes"]
    values = group.create_dataset("values", (3, GIB // 4), np.float32, chunks=(1, 1 << 16))
    values[:, :4] = 1.0
    values.attrs.update(storage="array", key="float32/1", torch_dtype="")
    group["shapes"] = np.full((3, 1), GIB // 4, np.int64)
    return "/vars/w/values"


def _record_gzip_bomb(handle: h5py.File, root: Path) -> str:
    """Records of 100 MiB of zeros, every chunk written (gzip: 4 KiB each), in a 0.4 MiB file."""
    group = handle["vars/w"]
    del group["values"], group["shapes"]
    chunk, record = 1 << 20, 25 << 20
    values = group.create_dataset(
        "values", (3, record), np.float32, chunks=(1, chunk), compression="gzip"
    )
    zeros = zlib.compress(bytes(chunk * 4))
    for row in range(3):
        for start in range(0, record, chunk):
            values.id.write_direct_chunk((row, start), zeros)
    values.attrs.update(storage="array", key="float32/1", torch_dtype="")
    group["shapes"] = np.full((3, 1), record, np.int64)
    return "/vars/w/values"


def _statistics_declared_1_gib(handle: h5py.File, root: Path) -> str:
    """Site w as statistics records (kind 15) whose compound values declare 1 GiB a record
    and no shapes: a record reads its whole row, a statistics view the whole dataset."""
    group = handle["vars/w"]
    del group["values"], group["shapes"]
    row = record_dtype(Layout(None, ()))
    values = group.create_dataset("values", (3, GIB // row.itemsize), row, chunks=(1, 1 << 12))
    first = np.zeros(3, row)
    first["count"], first["mean"] = 4, [1.5, 2.5, 3.5]
    values[:, 0] = first
    key = f"statistics:{','.join(row.names or ())}/0"
    values.attrs.update(storage="array", key=key, torch_dtype="statistics")
    group["kinds"][:] = 15
    return "/vars/w/values"


def _str_record_declared_wide(handle: h5py.File, root: Path) -> str:
    """Site note's strings as rows of 16 M entries each (one a record), nothing written."""
    group = handle["vars/note"]
    attrs, rows = dict(group["values"].attrs), len(group["values"])
    del group["values"]
    group.create_dataset(
        "values", (rows, 1 << 24), h5py.string_dtype(), chunks=(1, 1 << 12)
    ).attrs.update(attrs)
    return "/vars/note/values"


def _meta_wide_entries(handle: h5py.File, root: Path) -> str:
    """4096 entries of 32 KiB strings: few entries, 128 MiB declared, nothing written."""
    handle["meta"].create_dataset("wide", (4096,), np.dtype("S32768"))
    return "/meta/wide"


def _unknown_kind(handle: h5py.File, root: Path) -> str:
    """A record of site w whose kind code names no kind vartrace writes."""
    handle["vars/w/kinds"][0] = 126
    return "/vars/w/kinds"


def _statistics_kind_over_numbers(handle: h5py.File, root: Path) -> str:
    """A record of site w (float32 values) said to be a statistics record (kind 15)."""
    handle["vars/w/kinds"][0] = Kind.STATISTICS
    return "/vars/w/kinds"


def _none_kept_in_other(handle: h5py.File, root: Path) -> str:
    """A record of site w said to be a None kept in ``other`` (kind 128)."""
    handle["vars/w/kinds"][0] = IN_OTHER | Kind.NONE
    return "/vars/w/kinds"


def _statistics_without_fields(handle: h5py.File, root: Path) -> str:
    """Site w as statistics records whose rows hold only a count and a mean."""
    group = handle["vars/w"]
    del group["values"], group["shapes"]
    row = np.dtype([("count", "<i8"), ("mean", "<f8")])
    values = group.create_dataset("values", data=np.array([(4, 1.5), (4, 2.5), (4, 3.5)], row))
    values.attrs.update(storage="array", key="statistics:count,mean/0", torch_dtype="statistics")
    group["kinds"][:] = Kind.STATISTICS
    return "/vars/w/values"


def _other_statistics_without_fields(handle: h5py.File, root: Path) -> str:
    """Site w's last record a statistics record kept in ``other``, its row a bare count."""
    handle["vars/w/kinds"][2] = IN_OTHER | Kind.STATISTICS
    payload = io.BytesIO()
    np.save(payload, np.zeros((), [("count", "<i8")]))
    rows = np.empty(3, object)
    rows[:] = [np.zeros(0, np.uint8)] * 2 + [
        np.frombuffer(b"statistics\n" + payload.getvalue(), np.uint8)
    ]
    handle["vars/w"].create_dataset("other", data=rows, dtype=h5py.vlen_dtype(np.uint8))
    return "/vars/w/other"


def _values_too_few_rows(handle: h5py.File, root: Path) -> str:
    """Site w's values replaced by one row, where its 3 records are committed."""
    del handle["vars/w/values"]
    handle["vars/w"].create_dataset("values", data=np.zeros((1, 4), np.float32))
    handle["vars/w/values"].attrs.update(storage="array", key="float32/1")
    return "/vars/w/values"


def _other_too_few_rows(handle: h5py.File, root: Path) -> str:
    """Site w's last record said to be kept in an ``other`` dataset holding one row."""
    handle["vars/w/kinds"][2] |= IN_OTHER
    handle["vars/w"].create_dataset("other", data=np.zeros((1, 8), np.uint8))
    return "/vars/w/other"


def _other_of_fixed_strings(handle: h5py.File, root: Path) -> str:
    """Site w's last record said to be kept, as bytes, in a dataset of fixed-size strings."""
    handle["vars/w/kinds"][2] |= IN_OTHER
    handle["vars/w"].create_dataset("other", data=np.array([b"abc"] * 3, "S8"))
    return "/vars/w/other"


def _unknown_storage(handle: h5py.File, root: Path) -> str:
    """Site note's str records said to be stored in a way vartrace does not write: read as
    numbers, they are strings."""
    handle["vars/note/values"].attrs["storage"] = "float99/3"
    return "/vars/note/values"


def _key_names_no_dtype(handle: h5py.File, root: Path) -> str:
    """Site w's values keyed as numpy records of a dtype that does not exist."""
    handle["vars/w/values"].attrs.update(key="float99/1", torch_dtype="")
    return "/vars/w/values"


def _str_records_in_numbers(handle: h5py.File, root: Path) -> str:
    """Site note's str records said to be in a dataset of floats."""
    del handle["vars/note/values"]
    handle["vars/note"].create_dataset("values", data=np.zeros(2))
    handle["vars/note/values"].attrs.update(storage="str")
    return "/vars/note/values"


def _v2_tags_declared_8_gib(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    group["tags"].resize((GIB, 4))
    group["values"].resize((GIB, *group["values"].shape[1:]))  # a row for each, declared too
    handle["committed"][int(group.attrs["slot"])] = GIB
    return "/vars/w/tags"


def _v2_tags_of_three_columns(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    tags = group["tags"][:, :3]
    del group["tags"]
    group["tags"] = tags
    return "/vars/w/tags"


def _v2_tags_of_one_axis(handle: h5py.File, root: Path) -> str:
    group = handle["vars/w"]
    tags = group["tags"][:, 0]
    del group["tags"]
    group["tags"] = tags
    return "/vars/w/tags"


def _v2_kind_not_a_byte(handle: h5py.File, root: Path) -> str:
    """A record of site w whose kind is its own plus 256: as a byte (version 1 stores
    kinds as bytes) the record's kind again."""
    handle["vars/w/tags"][0, 3] += 256
    return "/vars/w/tags"


def _v2_unknown_kind(handle: h5py.File, root: Path) -> str:
    handle["vars/w/tags"][0, 3] = 126
    return "/vars/w/tags"


def _v2_tags_too_few_rows(handle: h5py.File, root: Path) -> str:
    handle["vars/w/tags"].resize((1, 4))
    return "/vars/w/tags"


#: Cases of format version 2's own datasets, crafted from a version-2 base.
V2_CASES: dict[str, Callable[[h5py.File, Path], str]] = {
    "v2 tags declared 8 GiB": _v2_tags_declared_8_gib,
    "v2 tags of three columns": _v2_tags_of_three_columns,
    "v2 tags of one axis": _v2_tags_of_one_axis,
    "v2 kind not a byte": _v2_kind_not_a_byte,
    "v2 unknown kind": _v2_unknown_kind,
    "v2 tags with too few rows": _v2_tags_too_few_rows,
}

CASES: dict[str, Callable[[h5py.File, Path], str]] = {
    "meta external storage": _meta_external_storage,
    "values external storage": _values_external_storage,
    "meta external link": _meta_external_link,
    "site external link": _site_external_link,
    "vanished external link": _vanished_external_link,
    "meta virtual dataset": _meta_virtual,
    "values virtual dataset": _values_virtual,
    "meta declared 8 GiB": _meta_declared_8_gib,
    "tags declared 8 GiB": _tags_declared_8_gib,
    "record declared 1 GiB": _record_declared_1_gib,
    "record gzip bomb": _record_gzip_bomb,
    "meta wide entries": _meta_wide_entries,
    "unknown kind": _unknown_kind,
    "statistics kind over numbers": _statistics_kind_over_numbers,
    "None kept in other": _none_kept_in_other,
    "statistics without fields": _statistics_without_fields,
    "other statistics without fields": _other_statistics_without_fields,
    "statistics declared 1 GiB": _statistics_declared_1_gib,
    "str record declared wide": _str_record_declared_wide,
    "values with too few rows": _values_too_few_rows,
    "other with too few rows": _other_too_few_rows,
    "other of fixed strings": _other_of_fixed_strings,
    "unknown storage": _unknown_storage,
    "key naming no dtype": _key_names_no_dtype,
    "str records in numbers": _str_records_in_numbers,
    **V2_CASES,
}


def _craft(root: Path, name: str) -> tuple[Path, str]:
    """The crafted file of case ``name`` and the dataset or link it names in its error."""
    (root / "netrc").write_text(SECRET + "\n")
    path = root / "crafted.h5"
    _base(path, 2 if name in V2_CASES else 1)
    with h5py.File(path, "r+") as handle:
        where = CASES[name](handle, root)
    return path, where


def _xarray(site: vartrace.Site) -> str:
    """``site.to_xarray()`` as text: "" for a site of non-numeric records (a TypeError)."""
    try:
        return repr(site.to_xarray())
    except TypeError:
        return ""


def _read_everything(path: Path) -> str:
    """Everything ``vartrace.open`` gives of a run, as text (``Site.to_xarray`` first, when
    xarray is installed: it reads a whole ``values`` dataset in one go)."""
    with vartrace.open(path) as run:
        parts = [repr(run.names), repr(run.meta)]
        for name in run.names:
            site = run[name]
            if XARRAY:
                parts.append(_xarray(site))
            parts += [repr(site.record(i)) for i in range(len(site))]
            parts.append(repr(np.asarray(site.values)))
        parts.append(run.to_frame().to_string())
    return "\n".join(parts)


def test_a_genuine_compressed_record_above_the_free_bound_reads(tmp_path: Path) -> None:
    """72 MiB of values that gzip about 8x: more than the free bound and than the file."""
    path = tmp_path / "run.h5"
    value = (torch.arange(18 << 20) % 4096).to(torch.float32)
    with H5PYSaverCallback(path, metadata=False, compression="gzip", compression_opts=1) as saver:
        saver("w", Trace([value], [1], [0], [0]))
    assert path.stat().st_size * 2 < value.numel() * 4 < 32 * path.stat().st_size
    with vartrace.open(path) as run:
        assert torch.equal(run["w"].record(0), value)


@pytest.mark.parametrize("case", list(CASES))
def test_open_refuses_a_crafted_file_naming_the_dataset(tmp_path: Path, case: str) -> None:
    path, where = _craft(tmp_path, case)
    with pytest.raises(RunFileError) as raised:
        _read_everything(path)
    message = str(raised.value)
    assert where in message and str(path) in message
    assert "hunter2" not in message


#: Runs ``vartrace ARGS...`` and writes the peak resident memory of the command itself (its
#: ``VmHWM``, not the suite's high-water mark that a forked child's ``ru_maxrss`` carries).
_MEASURED = Path(__file__).parents[1] / "_peak.py"


def _command(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``vartrace ARGS`` (at most 120 s); the result and the peak memory it reached (MiB)."""
    peak = cwd / "peak.txt"
    peak.unlink(missing_ok=True)
    try:
        done = subprocess.run(
            [sys.executable, str(_MEASURED), *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "VARTRACE_TEST_PEAK": str(peak)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"vartrace {' '.join(args)} ran past 120 s")
    assert peak.exists(), ("the command ended before its exit handlers", args, done.stderr)
    return done, int(peak.read_text()) / 1024


COMMANDS = {
    "ls": ["ls", "crafted.h5"],
    "show": ["show", "crafted.h5", "*"],
    "meta": ["meta", "crafted.h5"],
    "compare": ["compare", "crafted.h5", "crafted.h5"],
    "plot": ["plot", "crafted.h5", "w", "-o", "stat.png"],
    "plot similarity": ["plot", "crafted.h5", "crafted.h5", "-o", "similarity.png"],
}


def _check_commands(root: Path, case: str, commands: dict[str, list[str]]) -> None:
    """A command that reads the crafted part fails in one line naming it (exit 2); one that
    does not read it (only ``meta`` reads /meta) works.  Never the secret, never gigabytes."""
    _, where = _craft(root, case)
    if where.startswith("/meta"):
        readers = {"meta"}
    else:  # ls checks where a site's values lie but reads none of them
        # (statistics declared 1 GiB: its values have an axis its shapes lack, which ls reads)
        unread = (
            "record declared 1 GiB",
            "record gzip bomb",
            "str record declared wide",
            "str records in numbers",
            "unknown storage",
            "other statistics without fields",
        )
        readers = set(commands) - {"meta"} - ({"ls"} if case in unread else set())
        if where.startswith("/vars/note"):  # plot draws site w only
            readers -= {"plot"}
    for command, args in commands.items():
        done, peak_mib = _command(args, root)
        assert "hunter2" not in done.stdout + done.stderr, (command, done)
        assert peak_mib < RSS_LIMIT_MIB, (command, peak_mib)
        if command not in readers:
            assert done.returncode in (0, 1), (command, done.stderr)
            continue
        assert done.returncode == 2, (command, done)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (command, done.stderr)
        assert where in lines[0], (command, lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_command_refuses_or_ignores_a_crafted_file(tmp_path: Path, case: str) -> None:
    _check_commands(tmp_path, case, COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tensorboard_refuses_or_ignores_a_crafted_file(tmp_path: Path, case: str) -> None:
    """``vartrace tensorboard`` reads every record, as ``show`` does (a test of its own: it
    needs the tensorboard package)."""
    pytest.importorskip("tensorboard", reason="vartrace tensorboard needs tensorboard installed")
    _check_commands(
        tmp_path, case, {"tensorboard": ["tensorboard", "crafted.h5", "--logdir", "tb"]}
    )


@pytest.mark.parametrize("version", [1, 2])
def test_a_genuine_file_reads_exactly(tmp_path: Path, version: int) -> None:
    """The checks refuse nothing vartrace writes: the base of every crafted case reads back."""
    path = tmp_path / "run.h5"
    _base(path, version)
    with vartrace.open(path) as run:
        assert run.names == ["w", "note"]
        assert run.meta == {"command": ["train.py", "--lr", "0.1"], "git": {"commit": "0123abcd"}}
        assert torch.equal(run["w"].get(2), torch.arange(4.0) + 1)
        assert run["note"].calls(2) == ["b"]
        assert run.to_frame()["mean"].tolist()[:3] == [1.5, 2.5, 3.5]


@pytest.mark.parametrize("case", ["record declared 1 GiB", "record gzip bomb"])
def test_to_xarray_refuses_a_crafted_record(tmp_path: Path, case: str) -> None:
    """``Site.to_xarray`` reads the whole ``values`` dataset: bounded like every other read."""
    pytest.importorskip("xarray", reason="Site.to_xarray needs xarray installed")
    path, where = _craft(tmp_path, case)
    with vartrace.open(path) as run, pytest.raises(RunFileError) as raised:
        run["w"].to_xarray()
    assert where in str(raised.value)


def test_a_scalar_record_stored_with_axes_is_an_error_naming_it(tmp_path: Path) -> None:
    """A record whose kind says Python float over values of shape (4,): a clear error
    naming it, not a TypeError from numpy."""
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        handle["vars/w/kinds"][1] = Kind.FLOAT
    stored = "record 1 of site 'w' is a float stored with shape"
    with vartrace.open(path) as run, pytest.raises(ValueError, match=stored):
        run["w"].record(1)


@pytest.mark.parametrize("torch_dtype", ["float99", "1099511627776", "float64"])
def test_values_said_to_hold_the_bits_of_no_such_torch_dtype_are_an_error(
    tmp_path: Path, torch_dtype: str
) -> None:
    """A ``torch_dtype`` that names no torch dtype, or one of another size than the stored
    integers (float64 over 4-byte ones), is a clear error from the API; the CLI works or
    says so in one line."""
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        handle["vars/w/values"].attrs["torch_dtype"] = torch_dtype
    with vartrace.open(path) as run, pytest.raises(ValueError, match="no torch dtype of 4 bytes"):
        run.to_frame()
    for command in (["ls"], ["show"], ["plot", "w", "-o", str(tmp_path / "w.png")]):
        done, _ = _command([command[0], str(path), *command[1:]], tmp_path)
        assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == (done.returncode == 2), done.stderr


def test_numeric_records_in_a_dataset_of_strings_are_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        del handle["vars/w/values"]
        handle["vars/w"].create_dataset("values", data=np.array([[b"ab"] * 4] * 3, "S4"))
        handle["vars/w/values"].attrs.update(storage="array", key="float32/1")
    with vartrace.open(path) as run, pytest.raises(RunFileError, match="/vars/w/values holds"):
        run["w"].record(0)


@pytest.mark.parametrize("version", [np.arange(3), "1", 1.5])
def test_a_format_version_that_is_no_integer_is_not_a_vartrace_file(
    tmp_path: Path, version: object
) -> None:
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        handle.attrs["vartrace_format"] = version
    with pytest.raises(ValueError, match="not a vartrace file: no integer 'vartrace_format'"):
        vartrace.open(path)


@pytest.mark.parametrize("key", ["float64/1", "int8/1", ">f4/1"])
def test_a_values_key_must_name_the_values_dtype_in_some_byte_order(
    tmp_path: Path, key: str
) -> None:
    """The key says which dtype (and byte order) the records were written with: one of
    another size than the dataset's is a damaged file; the same one byte-swapped reads."""
    path = tmp_path / "run.h5"
    _base(path)
    with h5py.File(path, "r+") as handle:
        handle["vars/w/values"].attrs.update(key=key, torch_dtype="")
    with vartrace.open(path) as run:
        if np.dtype(key.split("/")[0]).itemsize == 4:
            assert np.array_equal(run["w"].record(1), np.arange(4.0) + 1)
        else:
            with pytest.raises(RunFileError, match="/vars/w/values has the key"):
                run["w"].record(1)


#: Opens the FIFO argv[1] for writing every 5 s, releasing a reader stuck opening it.
_RELEASE = """
import os, sys, time
while True:
    time.sleep(5)
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader is waiting on it
        pass
"""


@contextlib.contextmanager
def _released(fifo: Path) -> Iterator[None]:
    """While the block runs, a process opens ``fifo`` for writing every 5 s: a reader stuck
    opening it (nothing else ever writes to it) reads end of file and fails instead of
    hanging the suite.  A process, not a thread: h5py holds the GIL while HDF5 opens a file."""
    opener = subprocess.Popen([sys.executable, "-c", _RELEASE, str(fifo)])
    try:
        yield
    finally:
        opener.kill()
        opener.wait()


@pytest.mark.parametrize(
    ("what", "make"),
    [
        ("a named pipe (FIFO)", os.mkfifo),
        ("a directory", os.mkdir),
        ("a character device", lambda path: path.symlink_to("/dev/zero")),
    ],
)
def test_open_refuses_a_path_that_is_no_regular_file(
    tmp_path: Path, what: str, make: Callable[[Path], None]
) -> None:
    """Refused before it is opened (opening a FIFO waits until something writes to it),
    naming the path and what it is."""
    path = tmp_path / "run.h5"
    make(path)
    with _released(path), pytest.raises(ValueError) as raised:
        vartrace.open(path)
    assert str(raised.value) == f"{path} is not a vartrace file: it is {what}, not a regular file"


def test_every_command_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    """A FIFO (or a glob matching one) is an error in one line, exit 2; never a wait."""
    os.mkfifo(tmp_path / "crafted.h5")
    for command, args in COMMANDS.items():
        with _released(tmp_path / "crafted.h5"):
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "vartrace", *args],
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"vartrace {' '.join(args)} waited on a FIFO for 60 s")
        assert done.returncode == 2, (command, done)
        assert done.stderr == (
            f"vartrace {args[0]}: error: crafted.h5 is not a vartrace file: it is a named pipe "
            "(FIFO), not a regular file\n"
        ), (command, done.stderr)
