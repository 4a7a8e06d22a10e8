"""Reading run files offline: `vartrace.open`.

Example:
    ```python
    import vartrace

    with vartrace.open("run.h5") as run:
        site = run["layers.0.attn.forward.scores"]
        site.values            # the h5py dataset (records x padded shape), read lazily
        site.iterations        # numpy int64 array, one entry per record
        site.get(iteration=8)  # the value the site held at iteration 8 (rank 0): its last
                               # record at or before 8, exact shape and dtype
        site.calls(iteration=8)  # every record of iteration 8, in capture order (a list)
        run.to_frame(stat="norm")
    ```

Opening reads nothing but the root attributes; records are read when asked
for.  Shards of a run written with `ModelTracer(gather=False)` open as one
run: `vartrace.open("run.rank*.h5")`, or `vartrace.open(["node0/", "node1/"])`;
shards with a manifest are listed without opening their files.

This module finds a run's sites (root index or manifests, shards, aliases) and is the
`Run`; `locations` resolves what is opened (local or through fsspec), `shard` holds
one file of a run, `files` opens files safely, `site_reader` reads one site of one file,
`site_stats` takes a statistic of its records in blocks, `sites` is the `Site`
users see.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import h5py
import numpy as np

from vartrace._support.html import block
from vartrace._support.series import every_series, series_read_as
from vartrace._support.text import missing_site, numbers_text
from vartrace._support.warnings import warn
from vartrace.storage.files import open_file, read_tree
from vartrace.storage.guard import RunFileError, child
from vartrace.storage.layout import (
    FORMAT_ATTR,
    NO_TARGET,
    unescape,
)
from vartrace.storage.locations import Location, is_url, resolve
from vartrace.storage.root_rows import Row, alias_rows, committed_counts
from vartrace.storage.root_rows import indexed as index_rows
from vartrace.storage.shard import Shard, close_shards, planned
from vartrace.storage.site_reader import Part, ReadAhead
from vartrace.storage.sites import Site, described

__all__ = ["Run", "RunFileError", "Site", "open_file", "open_run"]


def _first_order(parts: list[Part]) -> int:
    """The capture order of a site's first record (each file's records are in capture order)."""
    return min(part.first_order for part in parts)


def _aliases(indexed: list[Row]) -> dict[str, str]:
    """Alias name -> target name of a file's counted index rows (see `alias_rows`)."""
    return {name: target for name, (_, target) in alias_rows(indexed).items()}


#: HDF5's errors for an object that a running writer made after a SWMR reader opened the
#: file (past the end of the file as the reader saw it): the site is left out until a reopen.
_HTML_ROWS = 50  # the sites a run's notebook table lists, in execution order

_BEYOND_VIEW = re.compile(
    "address of object past end of allocation|actual len exceeds EOA"
    "|len not positive after adjustment for EOA"  # (an object header starting at the end)
)


def _shard(path: Location, shard: Shard) -> tuple[str, int, int | None]:
    """(run id, rank, world size or None) of a shard; `ValueError` for a run of its own."""
    run_id, ranks = shard.identity
    if ranks is not None:
        return run_id or "", ranks[0], ranks[1]
    named = re.search(r"\.rank(\d+)$", _pure(path).stem)
    if run_id is not None or named is None:  # older files: shards are named so
        raise ValueError(
            f"{path} holds a run of its own, not a shard of a sharded run: open it alone"
        )
    return "", int(named.group(1)), None


def _pure(path: Location) -> PurePath:
    """`path` as a path, a URL's path part included (for its stem and suffix)."""
    return path if isinstance(path, Path) else PurePosixPath(path)


def _ranks_of_nodes(nodes: list[tuple[tuple[int, ...], int]]) -> tuple[list[int], int]:
    """The global ranks none of the node shards `nodes` (ranks, world size) holds, and the
    run's world size."""
    world = max(size for _, size in nodes)
    held = {rank for ranks, _ in nodes for rank in ranks}
    return sorted(set(range(world)) - held), world


def _check_shards(paths: list[Location], shards: list[Shard]) -> list[int]:
    """Refuse files that are not shards of one run; return the ranks missing from them."""
    if len(shards) == 1 and shards[0].identity[1] is None:
        return []  # a run of its own
    found = [_shard(path, shard) for path, shard in zip(paths, shards, strict=True)]
    by_rank: dict[int, Location] = {}
    for path, (_, rank, world) in zip(paths, found, strict=True):
        if rank in by_rank:
            raise ValueError(
                f"{by_rank[rank]} and {path} are both rank {rank}: shards of different runs"
            )
        if world is not None and not 0 <= rank < world:
            raise ValueError(f"{path} says it is rank {rank} of {world}: a damaged file")
        by_rank[rank] = path
    first, (run_id, _, world) = paths[0], found[0]
    bases = {re.sub(r"\.rank\d+$", "", _pure(path).stem) + _pure(path).suffix for path in paths}
    for path, (other_id, _, other_world) in zip(paths[1:], found[1:], strict=True):
        if ((run_id or other_id) and other_id != run_id) or (not run_id and len(bases) > 1):
            raise ValueError(f"{first} and {path} are shards of different runs")
        if other_world != world:
            raise ValueError(
                f"{first} and {path} are shards of runs of different world sizes "
                f"({world} and {other_world})"
            )
    missing = [] if world is None else sorted(set(range(world)) - set(by_rank))
    nodes = [shard.node_ranks for shard in shards]
    if missing and all(node is not None for node in nodes):  # node shards: the ranks they hold
        ranks = _ranks_of_nodes([node for node in nodes if node is not None])
        warn(
            f"vartrace: the shards of node(s) {numbers_text(missing)} of a {world}-node run "
            f"are missing, with rank(s) {numbers_text(ranks[0])} of its {ranks[1]}: reading "
            f"the other {len(paths)}",
            RuntimeWarning,
            stacklevel=4,
        )
        return ranks[0]
    if missing:
        warn(
            f"vartrace: the shards of rank(s) {numbers_text(missing)} of a "
            f"{world}-rank run are missing: reading the other {len(paths)}",
            RuntimeWarning,
            stacklevel=4,
        )
    return missing


class Run:
    """A run read from one file, or from the shards of a sharded run.

    `run.names` lists the sites, `run[name]` is a [`Site`][vartrace.Site], `run.meta`
    the metadata dict.  Close it (or use `with`) to release the files.
    """

    def __init__(
        self,
        paths: Sequence[Location],
        allow_pickle: bool = False,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        #: The files of the run: local `Path`s, or URLs (text) read through fsspec.
        self.paths: list[Location] = [p if is_url(p) else Path(p) for p in paths]
        self.allow_pickle = allow_pickle
        #: fsspec's options for the URLs among `paths` (credentials, endpoint...): a task
        #: reopening a shard by its URL passes them again.
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self._shards: list[Shard] = []
        self._sites: dict[str, Site] = {}
        try:
            for path, manifest in zip(
                self.paths, planned(self.paths, self.storage_options, stacklevel=3), strict=True
            ):
                self._shards.append(Shard(path, self.storage_options, manifest))
            #: Ranks of a sharded run whose shard is not among the files opened: global
            #: ranks, those of a missing node's shard (`gather="node"`) included.
            self.missing_ranks = _check_shards(self.paths, self._shards)
        except BaseException:
            self.close()
            raise
        self._ahead = ReadAhead()

    @property
    def live(self) -> bool:
        """Whether a writer still runs on one of the files (or that cannot be told).

        Such a file is read in SWMR mode, as of the writer's last flush; reopen
        the run to see the records it flushes later.
        """
        return any(shard.live for shard in self._shards)

    @property
    def manifests(self) -> list[dict[str, Any] | None]:
        """The manifest each file of `paths` was listed from (see `vartrace.storage.manifest`:
        per site its records, iterations, dtype, shape and bytes), `None` for a file read
        without one (no manifest, or one that does not describe the file)."""
        return [None if s.manifest is None else s.manifest.content for s in self._shards]

    @property
    def _links(self) -> dict[str, list[Part]]:
        """Site name -> its parts (one a file holding it), aliases left out."""
        return self._catalogue[0]

    @cached_property
    def _catalogue(self) -> tuple[dict[str, list[Part]], dict[str, str]]:
        """The sites (name -> parts) and the aliases (name -> target name) of the files."""
        links: dict[str, list[Part]] = {}
        aliases: dict[str, str] = {}
        for shard in self._shards:
            counts, indexed, tagged, live = self._listing(shard)
            if indexed is None:
                parts = [
                    Part.walked(shard, link, counts, self._ahead, tagged=tagged)
                    for link in shard.vars
                ]
            else:
                parts = [
                    Part(shard, link, slot, int(counts[slot]), self._ahead, first, tagged=tagged)
                    for slot, link, first, target in indexed
                    if target == NO_TARGET
                ]
                aliases = _aliases(indexed) | aliases  # the first file's, where shards differ
            for part in parts:
                if not part.rows:  # a site a killed writer created but never flushed is left out
                    continue
                if live:  # its datasets may lie past this reader's view
                    try:
                        part.open()
                        _ = part.first_order
                    except RunFileError as error:
                        if _BEYOND_VIEW.search(str(error)):
                            continue  # the writer made the site after this reader's view
                        raise
                links.setdefault(unescape(part.link), []).append(part)
        # A site of its own wins over an alias (a commit cut short between them); an alias
        # whose target was never committed is left out.
        kept = {
            name: target
            for name, target in aliases.items()
            if target in links and name not in links
        }
        return links, kept

    @staticmethod
    def _listing(
        shard: Shard,
    ) -> tuple[np.ndarray, list[tuple[int, str, int, int]] | None, bool, bool]:
        """(record counts, root index rows or None to walk `/vars`, format 2, live) of a
        shard: from its manifest, else from its file."""
        if shard.manifest is not None:
            manifest = shard.manifest
            return manifest.counts, manifest.indexed, manifest.format >= 2, False
        handle = shard.handle
        counts = committed_counts(handle)
        _ = shard.vars  # (a file without /vars is refused here)
        tagged = int(handle.attrs[FORMAT_ATTR]) >= 2  # (checked by open_file)
        live = shard.live
        try:
            indexed = index_rows(handle, counts)
        except RunFileError as error:
            if not (live and _BEYOND_VIEW.search(str(error))):
                raise
            indexed = None  # the writer grew the index after this reader's view of the file
        return counts, indexed, tagged, live

    @property
    def aliases(self) -> dict[str, str]:
        """Alias name -> the name of the site whose records it reads (stored once); empty
        when the run has none.  See [`H5PYSaverCallback.alias`][vartrace.H5PYSaverCallback.alias].

        Example: `run[alias].values is run[run.aliases[alias]].values`.
        """
        return dict(self._catalogue[1])

    @cached_property
    def series(self) -> dict[str, list[str]]:
        """`@every` series -> its line sites, in execution order: `run["forward.h@every"]`
        (and `run["forward.h"]` when `h` was recorded only `@every`) reads every value `h`
        took, each line site a site of its own too.

        Example: `run.series  # {"forward.h@every": ["forward.h@every:L27", ...]}`.
        """
        links, aliases = self._catalogue
        groups = every_series([*links, *aliases])
        return {series: sorted(lines, key=self._order_key) for series, lines in groups.items()}

    def _order_key(self, name: str) -> tuple[int, str]:
        """Where site `name` (or an alias of one) ran first, for sorting by execution."""
        links, aliases = self._catalogue
        return _first_order(links[aliases.get(name, name)]), name

    @cached_property
    def names(self) -> list[str]:
        """The site names in execution order: by the capture order of each site's first record.

        `blocks.2` comes before `blocks.10` when the model ran it first.
        Ties (sites of shards with independent counters) go by name.  An `@every`
        variable is listed by its line sites; `series` names what reads them as one.
        """
        links, aliases = self._catalogue
        return sorted([*links, *aliases], key=self._order_key)

    def __getitem__(self, name: str) -> Site:
        site = self._sites.get(name)
        if site is None:
            links, aliases = self._catalogue
            parts = links.get(aliases.get(name, name))
            if parts is not None:
                site = Site(name, parts, self.allow_pickle, run=self)
            else:
                series = series_read_as(name, self.series, links.keys() | aliases.keys())
                if series is None:
                    raise missing_site(name, [*self.series, *self.names], self._describe())
                site = self._sites.get(series) or self._series_site(series)
            self._sites[name] = self._sites[site.name] = site
        return site

    def _series_site(self, series: str) -> Site:
        """The site reading every record of `series`' line sites, in execution order."""
        links, aliases = self._catalogue
        lines = {aliases.get(line, line) for line in self.series[series]}
        parts = [part for line in sorted(lines) for part in links[line]]
        return Site(series, parts, self.allow_pickle, run=self)

    def __contains__(self, name: object) -> bool:
        links, aliases = self._catalogue
        if name in links or name in aliases:
            return True
        return series_read_as(name, self.series, links.keys() | aliases.keys()) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        links, aliases = self._catalogue
        return len(links) + len(aliases)

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The run metadata (of the first file for shards); empty if none was written."""
        handle = self._shards[0].handle
        if not handle.id.links.exists(b"meta"):
            return {}
        return read_tree(child(handle, "meta", h5py.Group))

    def to_frame(
        self,
        stat: str | Callable[[Any], Any] | Sequence[str] = "mean",
        names: Sequence[str] | None = None,
        scheduler: Any = None,
    ) -> Any:
        """A pandas DataFrame with one row per record and a column per statistic.

        Columns: site, iteration, rank, order, shape, dtype and the statistic
        (named after `stat`).  `stat` is a name of
        `vartrace.analysis.sources.STATS` (`mean`, `std`, `var`, `min`, `max`,
        `absmax`, `norm` over the finite values; `nan`, `posinf`, `neginf`,
        `zeros`, `count`: float64, NaN for non-numeric records), a field of
        statistics records (`q0.5`; records of [`vartrace.stats`][vartrace.stats] give their
        stored fields) or a callable receiving each record's value as
        [`Site.get`][vartrace.Site.get] returns it; a list of names gives a column each
        (`run.to_frame(["absmax", "nan"])`).  `names` may name an `@every` series
        (`series`): its records under its name, in execution order.

        `scheduler` computes it on Dask, a task per file: the same frame (see
        [`compare`][vartrace.compare] and the "Big runs" how-to).

        Example: `run.to_frame("absmax").groupby("site")["absmax"].max()`.
        """
        if scheduler is not None:
            from vartrace.analysis.dask_frames import frame_on

            return frame_on(self, stat, names, scheduler)
        from vartrace.analysis.sources.frames import FrameSite, records_frame

        def sites() -> Iterator[FrameSite]:
            for name in self.names if names is None else names:
                site = self[name]
                describe = functools.partial(described, site)
                yield FrameSite(name, site.iterations, site.ranks, site.order, describe)

        return records_frame(sites(), stat, caller="Run.to_frame()")

    def to_dask_frame(
        self,
        stat: str | Callable[[Any], Any] | Sequence[str] = "mean",
        names: Sequence[str] | None = None,
    ) -> Any:
        """`to_frame` as a dask DataFrame, one partition per file (needs the `dask` extra)."""
        from vartrace.analysis.dask_frames import dask_frame

        return dask_frame(self, stat, names)

    def to_dask(self, pattern: str = "*", scheduler: Any = None) -> dict[str, Any]:
        """A dask array per numeric site matching `pattern`, chunks of ~128 MB read by
        path (needs the `dask` extra).

        Records come file by file, not in the site's order (`to_frame`, `Site.iterations`):
        the files of `paths` holding the site in that order, each file's records in the
        order it gives them opened alone; `Site.to_xarray(chunks=...)` labels them.
        """
        from vartrace.analysis.dask_arrays import dask_arrays

        return dask_arrays(self, pattern, scheduler)

    def _describe(self) -> str:
        return str(self.paths[0]) if len(self.paths) == 1 else f"{len(self.paths)} shards"

    def close(self) -> None:
        """Close the files."""
        self._sites.clear()  # (their datasets, released first: fewer objects for HDF5 to go over)
        self.__dict__.pop("_catalogue", None)
        close_shards(self._shards)
        self._shards = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Run {self._describe()} sites={len(self)}>"

    def _repr_html_(self) -> str:
        """The run in a notebook: its files, state and sites (records, dtype, bytes)."""
        names, aliases = self.names, self.aliases
        stored = [self[name] for name in names if name not in aliases]
        state = "live: its writer still runs (reopen for newer records)" if self.live else "closed"
        facts = [
            ("files", self._describe()),
            ("state", state),
            ("sites", len(stored)),
            ("records", sum(len(site) for site in stored)),
        ]
        if aliases:
            facts.append(("aliases", len(aliases)))
        rows = [site._summary_row() for site in stored[:_HTML_ROWS]]
        head = ("site", "records", "dtype", "bytes")
        more = max(0, len(stored) - _HTML_ROWS)
        return block(f"Run {self._describe()}", facts, head=head, rows=rows, more=more)


def open_run(
    path_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Run:
    """Open a run file read-only (`vartrace.open`), lazily.

    `path_or_glob` is a path, a glob pattern (`"run.rank*.h5"`), a directory
    (its `*.h5` files), or a list of any of these (`["node0/", "node1/"]`);
    several files are read as the shards of one run, a missing rank reported
    in `run.missing_ranks` and by one warning.  A URL (`s3://`, `gs://`,
    `memory://`...) is read through fsspec (`pip install
    'torch-vartrace[remote]'`), given `storage_options` (credentials,
    endpoint); globs and directories too.  Shards with a manifest beside
    them (`run.rank3.h5.manifest.json`, written by the saver) are listed
    from it, their files opened when their records are read.  Pickled
    records are refused unless `allow_pickle=True`, since unpickling runs
    code stored in the file.

    Example:
        ```python
        with vartrace.open("run.h5") as run:
            print(run.names, run.meta["git"].get("commit"))
        with vartrace.open("s3://bucket/run/", storage_options={"anon": True}) as run:
            print(run.missing_ranks)
        ```
    """
    options = dict(storage_options or {})
    return Run(resolve(path_or_glob, options), allow_pickle=allow_pickle, storage_options=options)
