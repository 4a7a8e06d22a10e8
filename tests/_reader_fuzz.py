"""The worker of tests/storage/test_reader_fuzz.py: damaged and crafted run files, read every way.

``python tests/_reader_fuzz.py BASE.h5 WORKDIR SEED CASES`` derives CASES files from the
genuine run file BASE.h5 with a seeded generator (structural mutations made with h5py:
external storage, external, soft and looping links, virtual datasets, datasets declaring
gigabytes, wrong dtypes, shapes and counters, missing pieces; and byte-level damage:
flipped bytes, truncation, zeroed ranges), reads each through ``vartrace.open``, the
sources behind compare and plot, ``vartrace.compare`` and the ``ls``/``show``/``meta``
commands (byte damage spares HDF5's global heap collections: see
:func:`heap_collections`), and prints one JSON line per case: its mutations, the outcome
(``read``, ``error`` with a clear message, or ``crash``: an exception no reader should
raise, or a read that contradicts itself, see :func:`check_read_back`) and the peak of the
memory Python and numpy allocated for it (tracemalloc); last, its own peak resident memory
(``VmHWM``, see tests/_peak.py).  Its address space is capped, so a runaway allocation
fails the case instead of the machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import resource
import shutil
import sys
import time
import traceback
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vartrace.storage.layout import SIGNATURE, _lookup3

try:
    from tests._peak import peak_rss_kib
except ImportError:  # run as a script: this folder is sys.path[0]
    from _peak import peak_rss_kib  # type: ignore[no-redef]

#: Exceptions that are a clear error on a damaged file; anything else is a crash.  h5py
#: raises RuntimeError for metadata HDF5 cannot read ("incorrect metadata checksum").
CLEAR = (ValueError, OSError, KeyError, RuntimeError)
#: Address space the worker may grow by over its start (a bound far above any honest read).
HEADROOM_BYTES = 3 << 30
GIB = 1 << 30


def _datasets(handle: h5py.File) -> list[str]:
    found: list[str] = []
    handle.visititems(
        lambda name, item: found.append(name) if isinstance(item, h5py.Dataset) else None
    )
    return found


def _groups(handle: h5py.File) -> list[str]:
    found = ["/"]
    handle.visititems(
        lambda name, item: found.append(name) if isinstance(item, h5py.Group) else None
    )
    return found


def _replace(handle: h5py.File, name: str, make: Callable[[h5py.Group, str], None]) -> None:
    parent, _, link = name.rpartition("/")
    group = handle[parent or "/"]
    del group[link]
    make(group, link)


def _external_storage(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle))
    size = secret.stat().st_size
    _replace(
        handle,
        name,
        lambda g, n: g.create_dataset(n, (size,), np.uint8, external=[(secret, 0, size)]),
    )
    return f"external storage at {name}"


def _external_link(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle) + _groups(handle)[1:])
    target = rng.choice([str(secret.with_suffix(".h5")), "/nonexistent/gone.h5"])
    _replace(handle, name, lambda g, n: g.__setitem__(n, h5py.ExternalLink(target, "/x")))
    return f"external link at {name}"


def _soft_link(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    group = rng.choice(_groups(handle))
    target = rng.choice(_groups(handle) + _datasets(handle) + ["/missing"])
    handle[group][f"soft{rng.randrange(99)}"] = h5py.SoftLink(
        target if target.startswith("/") else "/" + target
    )
    return f"soft link in {group} to {target}"


def _hard_loop(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    group = rng.choice(_groups(handle))
    for i in range(rng.randint(1, 4)):  # a loop, and a fan-out of the same group
        handle[group][f"again{i}"] = handle[group]
    return f"hard links looping at {group}"


def _virtual(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle))
    layout = h5py.VirtualLayout((8,), np.uint8)
    layout[:] = h5py.VirtualSource(str(secret.with_suffix(".h5")), "x", shape=(8,))
    _replace(handle, name, lambda g, n: g.create_virtual_dataset(n, layout))
    return f"virtual dataset at {name}"


def _declared_huge(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle))
    dtype = rng.choice([np.int64, np.float32, np.uint8, h5py.string_dtype()])
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice([1, 3, 1 << 10, 1 << 20, 1 << 30]) for _ in range(ndim))
    chunks = tuple(min(s, 64) for s in shape)

    def make(group: h5py.Group, link: str) -> None:
        dataset = group.create_dataset(link, shape, dtype, chunks=chunks, maxshape=(None,) * ndim)
        dataset.attrs.update(storage=rng.choice(["array", "str", "blob"]), key="float32/1")

    _replace(handle, name, make)
    if rng.random() < 0.5:
        _set_committed(handle, slice(None), rng.choice([GIB, 1 << 20, shape[0]]))
    return f"{name} declared {shape}"


def _set_committed(handle: h5py.File, index: int | slice, value: int) -> bool:
    """Write ``value`` into /committed (cast as a C cast would, for a dataset another
    mutation retyped); False where there is no such numeric dataset."""
    committed = handle.get("committed")
    if not isinstance(committed, h5py.Dataset) or committed.dtype.kind not in "iuf":
        return False
    if committed.size > 1 << 16:  # one declared huge: writing it whole would fill memory
        return False
    committed[index] = np.array(value, np.int64).astype(committed.dtype)
    return True


def _counters(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    value = rng.choice([-5, 0, 1, 7, 1 << 40, -(1 << 62)])
    committed = handle.get("committed")
    if not isinstance(committed, h5py.Dataset) or committed.ndim != 1 or not len(committed):
        return "no committed"
    if not _set_committed(handle, rng.randrange(len(committed)), value):
        return "no committed"
    return f"a committed count of {value}"


def _attribute(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    group = handle[rng.choice(_groups(handle))]
    datasets = [group] + [item for item in group.values() if isinstance(item, h5py.Dataset)]
    target = rng.choice(datasets)
    key = rng.choice(
        [
            "slot",
            "storage",
            "key",
            "torch_dtype",
            "vartrace_format",
            "shard",
            "run_id",
            "writer_pid",
        ]
    )
    value = rng.choice(
        [-1, 1 << 40, "garbage", "float99/3", np.arange(3), b"\xff", 2.5, "bfloat16"]
    )
    if rng.random() < 0.2 and key in target.attrs:
        del target.attrs[key]
        return f"no {key} on {target.name}"
    target.attrs[key] = value
    return f"{key}={value!r} on {target.name}"


def _retype(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle))
    data = rng.choice(
        [
            np.array(["a", "b"], dtype=object),
            np.zeros((2, 2, 2)),
            np.array(3),
            np.arange(5, dtype=np.int8) - 2,
            np.full((4, 3), 1 << 40),
        ]
    )
    kind = rng.choice(["data", "group"])
    if kind == "group":
        _replace(handle, name, lambda g, n: g.create_group(n))
    else:
        _replace(
            handle,
            name,
            lambda g, n: g.create_dataset(
                n, data=data, dtype=h5py.string_dtype() if data.dtype == object else None
            ),
        )
    return f"{name} replaced by a {kind}"


def _delete(rng: random.Random, handle: h5py.File, secret: Path) -> str:
    name = rng.choice(_datasets(handle) + _groups(handle)[1:])
    del handle[name]
    return f"{name} deleted"


STRUCTURAL = [
    _external_storage,
    _external_link,
    _soft_link,
    _hard_loop,
    _virtual,
    _declared_huge,
    _counters,
    _attribute,
    _retype,
    _delete,
]


def leave_open_for_writing(data: bytearray) -> bool:
    """Set a file's superblock flags as a SWMR writer killed mid-run leaves them; return
    whether the superblock has such flags (versions 2 and 3)."""
    if data[:8] != SIGNATURE or data[8] not in (2, 3):
        return False
    end = 12 + 4 * data[9]
    data[11] = 0x05  # H5F_SUPER_WRITE_ACCESS | H5F_SUPER_SWMR_WRITE_ACCESS
    data[end : end + 4] = _lookup3(bytes(data[:end])).to_bytes(4, "little")
    return True


def heap_collections(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each HDF5 global heap collection (variable-length data) in a file."""
    found = []
    for match in re.finditer(rb"GCOL\x01\x00\x00\x00", data):
        size = int.from_bytes(data[match.start() + 8 : match.start() + 16], "little")
        found.append((match.start(), match.start() + size))
    return found


def _outside(rng: random.Random, length: int, heaps: list[tuple[int, int]]) -> int:
    """A random offset of the file outside its global heap collections.

    Damage inside one makes HDF5 2.0 loop forever (H5HG__cache_heap_deserialize, in C:
    no reader can interrupt it); test_reader_fuzz.py keeps that known hang in view.
    """
    while True:
        offset = rng.randrange(length)
        if not any(start <= offset < end for start, end in heaps):
            return offset


def _damage(rng: random.Random, path: Path) -> str:
    data = bytearray(path.read_bytes())
    heaps = heap_collections(bytes(data))
    how = rng.choice(["flip", "truncate", "zero"])
    if how == "flip":
        for _ in range(rng.randint(1, 16)):
            data[_outside(rng, len(data), heaps)] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del data[rng.randrange(len(data)) :]
    else:
        start = _outside(rng, len(data), heaps)
        stop = min([len(data), start + rng.randint(1, 4096), *(s for s, _ in heaps if s > start)])
        data[start:stop] = bytes(stop - start)
    left_open = rng.random() < 0.3 and leave_open_for_writing(data)  # read in SWMR mode
    path.write_bytes(bytes(data))
    return f"bytes: {how}" + (", left open for writing" if left_open else "")


def make_case(rng: random.Random, base: Path, path: Path, secret: Path) -> list[str]:
    """Write one damaged or crafted file at ``path``; return what was done to it."""
    shutil.copyfile(base, path)
    done: list[str] = []
    if rng.random() < 0.8:
        with h5py.File(path, "r+") as handle:
            for mutate in rng.sample(STRUCTURAL, rng.randint(1, 2)):
                done.append(mutate(rng, handle, secret))
    if not done or rng.random() < 0.3:
        done.append(_damage(rng, path))
    return done


def check_read_back(site: Any, index: int, value: Any) -> None:
    """Raise ``AssertionError`` (a crash) unless record ``index`` of ``site`` is what the reader
    says it is: its kind, and for a record in ``values`` its shape and dtype."""
    kind = str(site.kinds[index])
    where = f"record {index} of {site.name!r} ({kind})"
    if kind == "none":
        assert value is None, (where, value)
    elif kind in ("str", "bytes", "int", "float", "bool", "complex"):
        assert type(value).__name__ == kind, (where, type(value))
    if kind not in ("tensor", "ndarray") or not site.in_values[index]:
        return
    shape = tuple(int(n) for n in site.shapes[index])
    assert tuple(value.shape) == shape, (where, tuple(value.shape), shape)
    dtype = str(value.dtype).removeprefix("torch.")
    assert dtype == site.dtype, (where, dtype, site.dtype)


def read_everything(path: Path) -> None:
    """Every reader path over ``path``: what ``vartrace.open``, compare, plot and the CLI read.

    What reads is checked against itself: each site's tags of one length, records as the
    reader describes them (:func:`check_read_back`), ``to_frame`` one row per record with
    the means the sources (compare, plot) compute from ``values``, and the file equal to
    itself under ``compare``.
    """
    import vartrace
    from vartrace.analysis.sources import open_source, record_stats
    from vartrace.cli import main as cli_main

    with vartrace.open(path) as run:
        _ = (run.names, run.meta, run.live)
        counts = {}
        for name in run.names:
            site = run[name]
            counts[name] = len(site)
            lengths = {len(site.kinds), len(site.shapes), len(site.iterations), len(site.ranks)}
            assert lengths == {len(site)}, (name, lengths, len(site))
            _ = site.dtype
            for index in range(min(len(site), 6)):
                check_read_back(site, index, site.record(index))
        frame = run.to_frame()
        assert len(frame) == sum(counts.values()), (len(frame), counts)
    with open_source(str(path)) as source:
        for name in source.names:
            mean = record_stats(source.site(name), ["mean", "std"])["mean"]
            expected = frame.loc[frame["site"] == name, "mean"].to_numpy(float)
            assert mean.shape == expected.shape, (name, mean.shape, expected.shape)
            known = ~np.isnan(mean)  # (the sources leave records outside values as NaN)
            assert np.allclose(mean[known], expected[known]), (name, mean, expected)
    report = vartrace.compare(path, path)
    assert report.ok, f"the file differs from itself: {report.first_divergence}"
    for args in (["ls", str(path)], ["show", str(path), "*"], ["meta", str(path)]):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli_main(args)
        lines = err.getvalue().strip().splitlines()
        if code not in (0, 1) and (len(lines) != 1 or "Traceback" in err.getvalue()):
            raise AssertionError(
                f"vartrace {args[0]} exit {code} without a one-line error: {lines}"
            )


def _warm_up(base: Path) -> None:
    """Read the genuine file once: every module a reader path imports (torch, pandas) is
    loaded before any case is measured, and the genuine file must read."""
    with contextlib.redirect_stdout(io.StringIO()):
        read_everything(base)


def main(base: Path, work: Path, seed: int, cases: int) -> None:
    secret = work / "netrc"
    secret.write_text("machine example.org login alice password hunter2-fuzz\n")
    with h5py.File(secret.with_suffix(".h5"), "w") as handle:
        handle["x"] = np.frombuffer(b"hunter2-fuzz-in-h5", np.uint8)
    # Warmed up before the cap: a CUDA build of torch maps gigabytes of libraries on import.
    _warm_up(base)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM_BYTES, hard))
    rng = random.Random(seed)
    for case in range(cases):
        path = work / f"case{case}.h5"
        done = make_case(rng, base, path, secret)
        print(json.dumps({"case": case, "started": done}), flush=True)
        tracemalloc.start()
        began = time.perf_counter()
        outcome, detail = "read", ""
        try:
            read_everything(path)
        except CLEAR as error:
            outcome, detail = "error", f"{type(error).__name__}: {error}"
        except Exception as error:  # every other exception is reported as a crash
            outcome = "crash"
            detail = "".join(traceback.format_exception(error)[-3:])
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        record = {"case": case, "mutations": done, "outcome": outcome, "detail": detail[:2000]}
        record.update(peak=peak, seconds=time.perf_counter() - began)
        print(json.dumps(record), flush=True)
        path.unlink()
    print(json.dumps({"done": True, "peak_rss_kib": peak_rss_kib()}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
