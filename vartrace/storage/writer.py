"""The streaming HDF5 writer: a post-gather callback that appends every chunk to a file.

Example:
    ```python
    from vartrace import H5PYSaverCallback, ModelTracer

    with H5PYSaverCallback("run.h5", compression="blosc") as saver, ModelTracer(
        model, ["layers.*.attn.forward.scores"], post_gather_callbacks=[saver],
        gathering_interval=8,
    ):
        train(model)
    ```

Each call takes the chunk's records of a site and empties the chunk, so memory stays
bounded; the tracer hands each gather to the saver's writer thread
([`flush_later`][vartrace.H5PYSaverCallback.flush_later]), which appends the records to
the sites' datasets and commits them, in order, while the next step runs.  The file is
written in HDF5's SWMR mode: a process killed at any moment leaves a file holding every
record committed before (at most the gather being written and one queued are lost), and
`vartrace.open` (or `h5py.File(path, "r", swmr=True)`) can read a file
while it is being written.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py

from vartrace._support import forks as _forks
from vartrace._support import memory as _memory
from vartrace._support.warnings import release, warn
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.storage.appender import Appender
from vartrace.storage.background import BackgroundWriter, Handed, Item
from vartrace.storage.codec import dtype_name
from vartrace.storage.filters import Made, dataset_filters
from vartrace.storage.layout import (
    FORMAT_ATTR,
    FORMAT_VERSION,
)
from vartrace.storage.lifecycle import (
    close_after_failure,
    create_file,
    idle_error,
    interrupts_held,
    last_tags,
    open_for_writing,
    os_error,
    shrink_metadata_cache,
    size_metadata_cache,
    written_path,
)
from vartrace.storage.metadata import collect_metadata, metadata_options
from vartrace.storage.site_datasets import SiteDatasets
from vartrace.trace import RunContext, Trace, report_during

__all__ = ["H5PYSaverCallback", "unused_savers"]

_UNUSED: weakref.WeakSet[H5PYSaverCallback] = weakref.WeakSet()


def unused_savers() -> list[H5PYSaverCallback]:
    """Savers created but neither started by a tracer, called nor closed yet.

    [`ModelTracer`][vartrace.ModelTracer] warns about those it is not given:
    they would write nothing.
    """
    return list(_UNUSED)


class H5PYSaverCallback:
    """Post-gather callback streaming every record into an HDF5 file.

    Example:
        ```python
        saver = H5PYSaverCallback("run.h5")
        with ModelTracer(model, paths, post_gather_callbacks=[saver], gathering_interval=8):
            train(model)
        saver.close()
        vartrace.open("run.h5")["forward.x"].get(iteration=3)
        ```

    Args:
        dataset_file: the file to write.  In a sharded run (`ModelTracer(gather=False)`
            on several ranks) each rank writes `<stem>.rank<r><suffix>` instead.
        overwrite: replace an existing file.
        append: continue an existing vartrace file (a resumed run): records are appended
            to its sites, new sites are added, its metadata is kept.  A missing file is
            created.  Without `overwrite` or `append` an existing file raises
            `FileExistsError` and is left untouched.
        float_dtype / int_dtype: store floating / integer tensors and arrays in this dtype
            (e.g. `"float16"`; `"bfloat16"` applies to tensors only); `None` keeps
            each record's dtype, bit-exact.  Python scalars are always kept exact.
        compression / compression_opts / shuffle: HDF5 filters for numeric `values`
            datasets: `"gzip"`, `"lzf"`, an `hdf5plugin` filter object, or the
            shortcuts of `COMPRESSIONS`: `"blosc"` (Blosc + LZ4 + byte shuffle:
            fast, the recommended one), `"blosc2"`, `"blosc2-zstd"` (smaller, slower);
            the shortcuts need `pip install hdf5plugin`.  gzip and lzf compress on one
            core inside the training step: far slower.
        metadata: store the run's metadata under `/meta` when the file is created;
            `False`: none; a dict of options, e.g. `{"git_diff": False}`: all of it but
            the uncommitted git diff (see `vartrace.storage.collect_metadata`).
        background: where the records are written.  `None` (the default): records a
            tracer gathers are written on a thread of the saver's own, a gather handed
            to it at each `flush_later` (the tracer's call after a gather), so the
            training step pays the hand-over, not the write; once a tracer started the
            saver (`on_start`), `flush()` also hands the records over and returns when
            they are durable.  A saver no tracer started (called by hand) writes on the
            caller's thread, as with `False`.  `True`: every call only takes the records
            over, and `flush()` hands them to the thread and returns (`flush(wait=True)`
            waits).  `False`: written on the caller's thread, each call as it comes;
            `flush` returns once the gather is durable.
            On the thread, the records not written yet and those the tracer gathers add
            up to at most the largest gather (or 64 MiB if more), each record let go
            once written: a step whose record would pass that waits until the thread
            has written enough of the previous gathers (`make_room`; with the tracer's
            `staging="sync"`, a model on the CPU), and so does a hand-over otherwise.
            So host memory stays near one gather, as in the foreground, and a step
            waits only when the thread falls behind.  With `staging="async"` (a model
            on an accelerator) the staging thread waits in `make_room` instead, before
            it keeps each record; the step waits (or drops, `on_full="drop"`) only once
            records in flight reach `max_inflight_bytes` behind it.  The thread writes
            and commits the gathers in order, each durable once committed: a process
            killed (SIGKILL) loses only the gathers handed over and not committed yet,
            at most the one being written and one queued, besides what the tracer had
            not gathered; every record committed stays readable.  A tracer that stops
            waits for the thread, and so do `flush()` (but with `background=True`),
            `datasets`, `close` and the interpreter's exit; h5py releases the GIL
            while HDF5 writes.  A write that fails on the thread (a full disk) stops
            the saver with one warning naming the file and the cause, as in the
            foreground; another error of the thread is raised by the next `flush`
            or by `close`, as `vartrace.storage.WorkerError` (the original exception
            is its `__cause__`).

    The file is opened lazily: by `on_start` (the tracer calls it when it starts)
    or by the first call.  In a gathered multi-rank run only rank 0 writes; the saver
    of the other ranks stays idle.  Records handed to the saver are removed from the
    chunk (`trace.clear()`), so they are not also kept in `tracer.results`.
    """

    def __init__(
        self,
        dataset_file: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        append: bool = False,
        float_dtype: Any = None,
        int_dtype: Any = None,
        compression: Any = None,
        compression_opts: Any = None,
        shuffle: bool = False,
        metadata: bool | Mapping[str, Any] = True,
        background: bool | None = None,
    ) -> None:
        if overwrite and append:
            raise ValueError("overwrite=True and append=True exclude each other")
        self.path = Path(dataset_file)
        self.overwrite = overwrite
        self.append = append
        self.metadata = metadata
        self._metadata = metadata_options(metadata)  # collect_metadata's options; None: none
        filters = dataset_filters(compression, compression_opts, shuffle)
        self._options = {
            "float_dtype": dtype_name(float_dtype, "f"),
            "int_dtype": dtype_name(int_dtype, "i"),
            "filters": filters,
            "format": FORMAT_VERSION,  # the layout of the open file's sites (see _open)
        }
        #: The format version of a file this saver creates: tests set 1 to write a file of
        #: the first layout (private; an appended file keeps its own).
        self._format = FORMAT_VERSION
        self._made = Made(filters)  # the file's groups, datasets and attributes
        self._file: h5py.File | None = None
        self._appender: Appender | None = None  # writes into the open file
        self._unreleased = 0  # bytes of records written since memory was last given back
        self._context = RunContext()
        self._idle = False
        self._closed = False
        self._created = False  # this saver created the file (and removes it if it stays empty)
        self.background = background
        # Calls take the records over for the writer thread (with `None`: once a tracer
        # started the saver), rather than write them.
        self._threaded = background is True
        # Records (aliases: their target's name; `reduced`) taken over, not yet handed to
        # the thread.
        self._pending: list[tuple[str, Item]] = []
        self._thread = BackgroundWriter()  # the writer thread, started by a flush
        self._failure: OSError | None = None  # the write failure that ended the file
        # Callers (tracers in several threads) take records and flush one at a time; the
        # writer thread never takes it, so a caller waiting for the thread cannot block it.
        self._lock = threading.RLock()
        self._owner: int | None = None  # the process that opened the file
        self._descriptor = -1  # the file's descriptor in this process, once open
        self._parent_file: h5py.File | None = None  # in a forked child: the parent's, never used
        _UNUSED.add(self)

    # -- lifecycle ------------------------------------------------------------------------

    def on_start(self, context: RunContext) -> None:
        """Open the file for this rank (called by the tracer before the first record); with
        `background=None`, write on the saver's thread from now on."""
        self._check_process()
        _UNUSED.discard(self)
        if self.background is None:
            self._threaded = True
        if self._file is not None or self._closed:
            return
        self._context = context
        self._thread.limit = context.held_bytes
        path = written_path(self.path, context)
        if path is None:
            self._idle = True  # another rank writes the records this rank gathers to it
            return
        self.path = path
        self._open()

    def _check_process(self) -> None:
        if self._owner is not None and self._owner != os.getpid():
            raise RuntimeError(
                f"H5PYSaverCallback for {self.path} belongs to process {self._owner}; this "
                "process is a fork of it and never writes that file: give a tracer started "
                "here a saver of its own"
            )

    def _forget(self) -> None:
        """In a forked child: let go of the parent's file without writing it, even at exit.

        HDF5 keeps the file open in the child too and would write it when it closes
        it (when the child exits): its descriptor is pointed at a scratch file instead.
        """
        self._lock = threading.RLock()  # a thread of the parent may have held it at the fork
        if self._file is not None and self._descriptor >= 0:
            with tempfile.TemporaryFile() as scratch:
                os.dup2(scratch.fileno(), self._descriptor)
        self._parent_file, self._file = self._file, None  # kept: closing would write
        self._appender = None
        self._pending = []
        self._thread = BackgroundWriter()  # the one writing them stayed in the parent
        self._closed = True

    def _open(self) -> h5py.File:
        self._check_process()
        if self._failure is not None:
            raise RuntimeError(
                f"H5PYSaverCallback for {self.path} stopped writing after a failed write: "
                f"{self._failure.strerror}"
            ) from self._failure
        if self._closed:
            raise RuntimeError(f"H5PYSaverCallback for {self.path} is closed")
        if self._idle:
            raise idle_error(self.path, self._context)
        if self._file is not None:
            return self._file
        handle, self._created = open_for_writing(
            self.path, overwrite=self.overwrite, append=self.append, create=self._create
        )
        last = None if self._created else last_tags(handle)
        self._options["format"] = int(handle.attrs[FORMAT_ATTR])  # a file never mixes layouts
        handle.attrs.update(writer_host=socket.gethostname(), writer_pid=os.getpid())
        self._appender = Appender(handle, self.path, self._options, self._made, last)
        size_metadata_cache(handle)
        handle.swmr_mode = True  # from here on, a killed process leaves a consistent file
        self._descriptor = handle.id.get_vfd_handle()
        self._owner = os.getpid()
        self._file = handle
        _forks.watch(self)
        return handle

    def _create(self, path: Path) -> h5py.File:
        meta = None
        if self._metadata is not None:  # collected first: outside SWMR mode only briefly
            meta = collect_metadata(self._context.world_size, **self._metadata)
        return create_file(path, self._format, self._context, meta)

    def flush(self, *, wait: bool | None = None) -> None:
        """Make every record taken so far durable in the file.

        HDF5 writes out the records first; then the per-site record counts that
        readers trust are rewritten in place.  A process killed at any moment
        leaves every record of the last completed flush readable, and nothing
        half-written visible.  On the caller's thread (`background=False`, or a
        saver no tracer started) it returns once they are.  Otherwise the records
        are handed to the writer thread, which writes and commits them, and `flush`
        waits until it has, unless `wait=False` (the default with `background=True`).
        """
        with self._lock:
            if not self._threaded:
                with interrupts_held(), self._guard():
                    self._commit()
                self._release()
                return
            if self._pending:
                batch, self._pending = self._pending, []
                name = f"vartrace-writer {self.path.name}"
                self._thread.submit(batch, self._write, name=name, at_exit=self.close)
        if wait if wait is not None else self.background is not True:
            self._thread.join()

    def flush_later(self) -> None:
        """Hand the records taken so far to the writer thread, which writes and commits
        them after those handed before, and return without waiting (the tracer calls it
        after each gather but its last, which calls `flush`).  On the caller's thread
        (`background=False`) it is `flush`.
        """
        self.flush(wait=False)

    def make_room(self, nbytes: int) -> None:
        """When the records go to the writer thread, wait until `nbytes` of records fit
        beside those it has not written yet (the tracer calls it before it copies a record,
        with the bytes of its chunk and of the record).

        They fit when they add up to at most the largest gather handed to the thread
        (or 64 MiB if more; at most the tracer's `RunContext.held_bytes`, where it
        gives one), or when the thread holds none: a tracer
        whose records are as large as a gather waits until the thread has written as
        many of the previous gather's.  It returns at once in the foreground, when
        the thread holds nothing or once a job of the thread failed (the next `flush`
        raises its error).
        """
        if self._threaded:
            self._thread.make_room(nbytes)

    def _write(self, handed: Handed) -> None:
        """Write a batch handed to the writer thread, on that thread, and commit it."""
        with handed as pieces, self._guard():
            if self._failure is not None:
                return  # an earlier gather's write failed: the saver stopped writing
            for name, piece in pieces:
                self._apply(name, piece)
                del piece  # the record goes now, not when the job ends
            self._commit()
        self._release()

    def _release(self) -> None:
        """Give the memory of the records written since the last time back to the system,
        once they add up to `TRIM_ABOVE` (see `vartrace._support.memory`)."""
        if _memory.release(self._unreleased):
            self._unreleased = 0

    def _apply(self, name: str, item: Item) -> None:
        """Write one taken item of site `name` into the open file (see `Appender.apply`)."""
        self._open()  # raises once the saver is closed or stopped
        assert self._appender is not None  # made with the file
        self._unreleased += self._appender.apply(name, item)

    def _commit(self) -> None:
        if self._file is not None and self._appender is not None:
            self._appender.commit()

    def close(self) -> None:
        """Flush and close the file; later records raise.  Safe to call twice.

        With a writer thread it first waits for it, and raises
        its error, if it had one, after closing the file.  The file is closed
        whatever happens.  A write that fails (a full disk) raises nothing: it
        was warned about once and is kept in `failure`.  Then the warnings
        that a `-W error` filter turned into errors during the run are emitted
        again (see `vartrace._support.warnings`).
        """
        with self._lock, interrupts_held():
            self._close()
        release()

    def _close(self) -> None:
        _UNUSED.discard(self)
        try:
            if self._threaded:
                self.flush(wait=False)  # hands over what was taken since the last flush
            self._thread.stop()
        finally:
            self._closed = True
            appender = self._appender
            try:
                if self._file is not None and appender is not None:
                    with self._guard():
                        appender.commit()
                        appender.sites.clear()  # their datasets are closed, their metadata clean
                        shrink_metadata_cache(self._file)
                if self._file is not None and appender is not None:  # a failed commit closed it
                    self._file.close()
                    self._file = None
                    _forks.unwatch(self)
                    if self._created and not appender.index.counts.any():
                        self.path.unlink(missing_ok=True)
                        warn(
                            f"vartrace: H5PYSaverCallback received no record, so it removed the "
                            f"empty {self.path} it had created (a model that never ran in the "
                            "traced mode, a saver missing from post_gather_callbacks, or a failed "
                            "first write)",
                            stacklevel=3,
                        )
                    appender.manifest.write(appender.index, closed=True)
                if appender is not None and appender.unresolved:
                    unresolved = appender.unresolved
                    warn(
                        f"vartrace: H5PYSaverCallback wrote no alias for "
                        f"{', '.join(map(repr, unresolved))} in {self.path}: their target "
                        f"site(s) {', '.join(map(repr, dict.fromkeys(unresolved.values())))} "
                        "received no record",
                        stacklevel=3,
                    )
            finally:
                if appender is not None:
                    appender.sites.clear()
                    appender.forget_facts()  # of sites that received no record

    @property
    def failure(self) -> OSError | None:
        """The write failure (a full disk, a file-size limit) that stopped this saver, or `None`.

        After it the saver writes nothing more: later records are dropped, and
        the file holds every record flushed before.  With a writer thread it first
        waits for the records handed to it (a tracer reads it as it
        stops: the run's records are then in the file).  Example:

        ```python
        if saver.failure is not None:
            print("the run file is incomplete:", saver.failure.strerror)
        ```
        """
        self._thread.settle()
        return self._failure

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn a failed write into a closed file, `failure` and one warning.

        After a failed write HDF5 can neither flush the file nor close its
        datasets; closing them anyway, or leaving it to the process's exit,
        crashes the process (SIGSEGV).  So the file's descriptor is first pointed
        at the null device, where the close writes what it still must, and the
        file on disk keeps what was written before.
        """
        try:
            yield
        except Exception as error:
            handle, cause = self._file, os_error(error)
            if handle is None or cause is None:
                raise
            # Set first: from here on no thread reopens the file.
            self._failure = OSError(
                cause[0],
                f"writing the run file failed ({cause[1]}); it is closed and holds the "
                "records of every flush before this one",
                str(self.path),
            )
            self._failure.__cause__ = error
            self._file = None
            assert self._appender is not None  # made with the file
            close_after_failure(handle, self.path, self._appender.sites.clear)
            warn(
                f"vartrace: H5PYSaverCallback stopped writing {self.path}: {cause[1]} "
                f"(errno {cause[0]}); the file holds the records of every flush before, later "
                "records are dropped, training goes on (saver.failure holds the error)",
                RuntimeWarning,
                stacklevel=4,
            )

    def __enter__(self) -> H5PYSaverCallback:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:  # the exception of the with-block goes on, not this one
            report_during(exc, f"H5PYSaverCallback.close() failed for {self.path}", error)
        release(during=exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._file is not None else "not opened"
        if self._failure is not None:
            state = "stopped after a failed write"
        sites = 0 if self._appender is None else len(self._appender.sites)
        return f"<H5PYSaverCallback {str(self.path)!r} {state} sites={sites}>"

    # -- writing --------------------------------------------------------------------------

    def __call__(self, name: str, trace: Trace) -> None:
        """Append the chunk's records of site `name` to the file and empty the chunk."""
        _UNUSED.discard(self)
        # Ctrl-C is held until the records are written and taken from the chunk: neither
        # half written nor written twice (the tracer keeps what a callback did not take).
        with self._lock, interrupts_held():
            # The writer thread sets `_failure`, then drops `_file`: a saver that failed
            # meanwhile is not reopened (which raises) but drops the records, never grows.
            if self._file is None and self._failure is None:
                self._open()
            if self._failure is not None:
                trace.clear()
                return
            if not len(trace):
                return
            if self._threaded:
                taken = Trace(
                    trace.values, trace.iterations, trace.ranks, trace.order, trace.shapes
                )
                self._pending.append((name, taken))
            else:
                with self._guard():
                    self._apply(name, trace)
            trace.clear()

    def alias(self, name: str, target: str) -> None:
        """Make site `name` read as site `target` (the same records, stored once).

        `target` is a site with records in this file, or one that receives them
        before the next flush; `name` has no records of its own.  `vartrace.open`
        lists `name` (`run.aliases` maps it to `target`) and `run[name]` reads
        `target`'s records.  Records that later arrive for `name` itself make it an
        ordinary site from then on (the earlier ones stay readable under `target`).
        Like a call, it is ordered with the records (on the writer thread included);
        it takes effect at the next flush.  Example:

        ```python
        saver.alias("layers.0.attn.forward.attn_weights",
                    "layers.0.attn.forward>eager_attention_forward.attn_weights")
        ```
        """
        self._take(name, target)

    def _take(self, name: str, fact: str | ReducedFrom | Placement) -> None:
        """Write a fact about site `name` (an alias's target, `reduced`, `placed`), or with
        a writer thread queue it, ordered with the records."""
        _UNUSED.discard(self)
        with self._lock, interrupts_held():
            if self._failure is not None:  # the saver stopped writing
                return
            self._open()
            if self._threaded:
                self._pending.append((name, fact))
            else:
                with self._guard():
                    self._apply(name, fact)

    def reduced(self, name: str, origin: ReducedFrom) -> None:
        """Note what a pre-save callback made site `name`'s records from: the dtype and
        shape of its values (the tracer calls it for statistics mode's rows).

        Stored as the site's attributes `reduced_dtype` and `reduced_shape` (-1 on the
        axes whose size differed; absent when the number of axes differed), read back
        as `run[name].reduced_from`.  A description only widens: one noted in an
        earlier session of an appended file is merged with this one.  Like a call, it
        is ordered with the records.  Example:

        ```python
        saver.reduced("blocks.0.forward", ReducedFrom("bfloat16", (8, -1, 768)))
        ```
        """
        self._take(name, origin)

    def placed(self, name: str, placement: Placement) -> None:
        """Note that site `name`'s records are each rank's local shard of a DTensor placed
        as `placement` (the tracer calls it for tensor parallelism's and FSDP2's DTensors).

        Stored as the site's attributes `placements`, `mesh_shape`, `mesh_ranks` and
        `global_shape`, read back as `run[name].placement`, which
        [`vartrace.assemble`][vartrace.assemble] joins the records by.  Like a call, it is
        ordered with the records.  Example:

        ```python
        saver.placed("a.weight", Placement(("Shard(dim=0)",), (2,), (0, 1), (8, 4)))
        ```
        """
        self._take(name, placement)

    @property
    def datasets(self) -> Mapping[str, h5py.Dataset]:
        """Site name -> its `values` dataset (opened when looked up), while the file is open.

        With a writer thread, it first waits for the records handed to the thread.
        """
        self._thread.join()
        return SiteDatasets(self._file)
