"""`compare(..., scheduler=...)`: the comparison as Dask tasks over pairs of shards.

Records are matched by (site, iteration, rank, occurrence), so two sharded
runs whose every rank's records sit in one shard on each side compare shard
pair by shard pair: `plan` pairs the shards by their name (`run.rank3.h5`
with `run.rank3.h5`, `.node<k>` likewise; a shard without a partner, a
missing rank, is compared with nothing), one task per pair or per
`TASK_BYTES` of it (the pair's sites dealt out among its tasks).  Each task
opens its two files by path where it runs and returns, per site, its rows
(`SiteRows`: the statistics of every record pair) with the ranks it saw;
the driver checks that no rank of a site came from two tasks, merges each
site's rows in the order the in-process comparison gives them and assembles
the same report.

Where the shards cannot be paired (a gathered file against shards, shards
named otherwise, the ranks of one shard found in another), the tasks take
groups of sites of the whole runs instead (each opens every file).  Runs in
memory (a `ModelTracer`, its results) are compared in process.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, NamedTuple

import numpy as np

from vartrace.analysis.comparison.engine import compare_views
from vartrace.analysis.comparison.report import STATUS_ONLY_A, STATUS_ONLY_B
from vartrace.analysis.comparison.rows import SiteRows
from vartrace.analysis.scheduling import Call, run_calls, scheduler_of
from vartrace.analysis.sources import FileMaps, SiteView, Source
from vartrace.analysis.sources.views import FileSiteView, MemorySiteView, dtype_label
from vartrace.analysis.tasks import RunFiles, byte_groups, file_bytes, naming, opened
from vartrace.reduced import ReducedFrom
from vartrace.trace import Trace

__all__ = ["ShardTask", "compare_on", "compare_task", "plan"]

_SHARD_NAME = re.compile(r"\.(rank|node)(\d+)$")


class _Site(NamedTuple):
    """A compared site: its name and the name whose records it reads in each run."""

    name: str
    stored_a: str
    stored_b: str


class ShardTask(NamedTuple):
    """One task: some sites of some files of each run (`None`: none of that run)."""

    a: RunFiles | None
    b: RunFiles | None
    sites: tuple[_Site, ...]
    atol: float
    rtol: float


class _Piece(NamedTuple):
    """What a task found of one site: its rows and where they came from."""

    rows: SiteRows
    present: tuple[bool, bool]  # the site has records in the task's files of a, of b
    ranks: tuple[np.ndarray, np.ndarray]  # the ranks of those records
    reduced: tuple[ReducedFrom | None, ReducedFrom | None]


def _shard_key(path: str) -> tuple[str, int] | None:
    """`("rank", 3)` for `run.rank3.h5` (a local path or a URL), `None` for other names."""
    found = _SHARD_NAME.search(PurePosixPath(path.replace("\\", "/")).stem)
    return None if found is None else (found.group(1), int(found.group(2)))


def _pairs(paths_a: Sequence[str], paths_b: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """The files each task of a pairing opens, one pair of shards each; `[]` when the
    shards cannot be paired by name."""
    if len(paths_a) == 1 and len(paths_b) == 1:
        return [((paths_a[0],), (paths_b[0],))]
    named_a = {_shard_key(path): path for path in paths_a}
    named_b = {_shard_key(path): path for path in paths_b}
    if None in named_a or None in named_b:
        return []
    keys_a = {key: path for key, path in named_a.items() if key is not None}
    keys_b = {key: path for key, path in named_b.items() if key is not None}
    kinds = {key[0] for key in [*keys_a, *keys_b]}
    if len(keys_a) < len(paths_a) or len(keys_b) < len(paths_b) or len(kinds) != 1:
        return []
    return [
        (tuple(filter(None, [keys_a.get(key)])), tuple(filter(None, [keys_b.get(key)])))
        for key in sorted({*keys_a, *keys_b})
    ]


def plan(
    files: tuple[RunFiles, RunFiles],
    sites: Sequence[_Site],
    atol: float,
    rtol: float,
    *,
    whole: bool = False,
) -> list[ShardTask]:
    """The tasks comparing `sites` of two runs: by pairs of shards, or (`whole`, or
    when shards do not pair by name) by groups of sites of the whole runs."""
    files_a, files_b = files
    pairs = [] if whole else _pairs(files_a.paths, files_b.paths)
    pairs = pairs or [(files_a.paths, files_b.paths)]
    tasks = []
    for paths_a, paths_b in pairs:
        nbytes = max(
            sum(file_bytes(path, files_a.storage_options) for path in paths_a),
            sum(file_bytes(path, files_b.storage_options) for path in paths_b),
        )
        groups = byte_groups(nbytes, len(sites))
        for group in range(groups):
            tasks.append(
                ShardTask(
                    files_a.subset(paths_a) if paths_a else None,
                    files_b.subset(paths_b) if paths_b else None,
                    tuple(sites[group::groups]),
                    atol,
                    rtol,
                )
            )
    return tasks


def _view(run: Any, name: str, stored: str, maps: FileMaps) -> tuple[SiteView, Any]:
    """The view of `stored` in `run` under `name`, its `reduced_from` taken out (the
    driver labels statistics rows from the whole site's); an empty view where the
    files hold no record of it."""
    if run is None or stored not in run or stored in run.aliases:
        return MemorySiteView(name, Trace()), None
    view = FileSiteView(name, run[stored], maps)
    reduced, view.reduced_from = view.reduced_from, None
    return view, reduced


def compare_task(task: ShardTask) -> list[_Piece]:
    """Run one task where it is scheduled: open its files, compare its sites."""
    with naming(task.a, task.b), opened(task.a) as run_a, opened(task.b) as run_b:
        maps = FileMaps()
        views = [
            (
                _view(run_a, site.name, site.stored_a, maps),
                _view(run_b, site.name, site.stored_b, maps),
            )
            for site in task.sites
        ]
        results = compare_views(
            ((site.name, a, b) for site, ((a, _), (b, _)) in zip(task.sites, views, strict=True)),
            task.atol,
            task.rtol,
            threads=1,
        )
        return [
            _Piece(
                result.taken(np.arange(len(result.status)), result.n_pairs),
                (len(a.iterations) > 0, len(b.iterations) > 0),
                (np.unique(a.ranks), np.unique(b.ranks)),
                (reduced_a, reduced_b),
            )
            for result, ((a, reduced_a), (b, reduced_b)) in zip(results, views, strict=True)
        ]


def _consistent(pieces: list[tuple[int, _Piece]]) -> bool:
    """Whether every rank of the site came from one task on each side, the same one."""
    owners: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for task, piece in pieces:
        for side in (0, 1):
            for rank in piece.ranks[side].tolist():
                if owners[side].setdefault(rank, task) != task:
                    return False
    return all(owners[1].get(rank, task) == task for rank, task in owners[0].items())


def _merged(
    name: str, found: list[tuple[ShardTask, _Piece]], runs: tuple[RunFiles, RunFiles]
) -> SiteRows:
    """One site's rows from its tasks, in the order `compare` gives them in process:
    pairs by (iteration, rank, occurrence), then the unpaired records of each side in
    the order its run reads them (by iteration, rank and capture order where the
    site spans several files)."""
    pieces = [piece for _, piece in found]
    rows = SiteRows.joined(name, [piece.rows for piece in pieces])
    segment = np.concatenate([_segments(piece.rows) for piece in pieces])
    order = []
    for kind, key in ((0, rows.occurrence), (1, rows.order_a), (2, rows.order_b)):
        members = np.flatnonzero(segment == kind)
        if kind == 0 or sum(piece.present[kind - 1] for piece in pieces) > 1:
            keys = (key[members], rows.rank[members], rows.iteration[members])
            members = members[np.lexsort(keys)]
        order.append(members)
    merged = rows.taken(np.concatenate(order), rows.n_pairs)
    for side, labels in enumerate((merged.dtype_a, merged.dtype_b)):
        reduced = _reduced(found, side, runs[side])
        labels[:] = [dtype_label(dtype, reduced) for dtype in labels]
    return merged


def _segments(rows: SiteRows) -> np.ndarray:
    """0 for each row of a pair, 1 for a record of a only, 2 for one of b only."""
    segment = np.zeros(len(rows.status), np.int8)
    segment[rows.status == STATUS_ONLY_A] = 1
    segment[rows.status == STATUS_ONLY_B] = 2
    segment[: rows.n_pairs] = 0
    return segment


def _reduced(found: list[tuple[ShardTask, _Piece]], side: int, run: RunFiles) -> ReducedFrom | None:
    """The site's `reduced_from` in one run: its files', merged in the order the run
    lists its files (as its reader merges them)."""
    described = [
        (run.position(files.paths[0]), reduced)
        for task, piece in found
        if (files := (task.a, task.b)[side]) is not None
        and (reduced := piece.reduced[side]) is not None
    ]
    described.sort(key=lambda entry: entry[0])
    found_in_order = [reduced for _, reduced in described]
    return functools.reduce(ReducedFrom.merged, found_in_order) if found_in_order else None


def _merge(
    tasks: list[ShardTask],
    outputs: list[list[_Piece]],
    names: list[str],
    runs: tuple[RunFiles, RunFiles],
) -> list[SiteRows] | None:
    """Every site's merged rows, or `None` when a rank of a site came from two tasks."""
    by_site: dict[str, list[tuple[ShardTask, _Piece]]] = {name: [] for name in names}
    owners: dict[str, list[tuple[int, _Piece]]] = {name: [] for name in names}
    for index, (task, pieces) in enumerate(zip(tasks, outputs, strict=True)):
        for site, piece in zip(task.sites, pieces, strict=True):
            by_site[site.name].append((task, piece))
            owners[site.name].append((index, piece))
    if not all(_consistent(pieces) for pieces in owners.values()):
        return None
    return [_merged(name, by_site[name], runs) for name in names]


def compare_on(
    scheduler: Any,
    source_a: Source,
    source_b: Source,
    common: list[str],
    atol: float,
    rtol: float,
    progress: bool = False,
) -> list[SiteRows] | None:
    """The rows of the `common` sites computed on `scheduler`; `None` when a run is
    not read from files (the caller compares in process)."""
    with scheduler_of(scheduler, "compare(scheduler=)") as engine:
        files_a, files_b = RunFiles.of(source_a.run), RunFiles.of(source_b.run)
        if files_a is None or files_b is None:
            return None
        for whole in (False, True):
            tasks = compare_calls((files_a, files_b), source_a, source_b, common, atol, rtol, whole)
            outputs = run_calls(engine, tasks, progress=progress, desc="compare")
            merged = _merge([args[0] for _, args in tasks], outputs, common, (files_a, files_b))
            if merged is not None:
                return merged
    raise AssertionError("site groups of whole runs always merge")


def compare_calls(
    files: tuple[RunFiles, RunFiles],
    source_a: Source,
    source_b: Source,
    common: list[str],
    atol: float,
    rtol: float,
    whole: bool = False,
) -> list[Call]:
    """The calls (`compare_task`, one `ShardTask` each) comparing `common`."""
    sites = [
        _Site(name, source_a.aliases.get(name, name), source_b.aliases.get(name, name))
        for name in common
    ]
    return [(compare_task, (task,)) for task in plan(files, sites, atol, rtol, whole=whole)]
