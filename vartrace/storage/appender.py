"""What an open run file receives: records appended to their sites, facts about sites, commits.

`H5PYSaverCallback` (`vartrace.storage.writer`) decides when and on which thread; an
`Appender` does the writing into the one file it opened.  Example:

```python
appender = Appender(handle, path, options, made, last=None)
written = appender.apply("forward.x", trace)  # bytes of records written
appender.apply("layers.0.attn.forward.attn_weights", "layers.0.attn.forward.scores")
appender.commit()  # HDF5 flush, then the counts readers trust
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vartrace._support.warnings import warn
from vartrace.placements import Placement
from vartrace.reduced import ReducedFrom
from vartrace.storage.background import Item, one_by_one
from vartrace.storage.filters import Made
from vartrace.storage.layout import FIRST_ORDER, LAST_TAGS, escape
from vartrace.storage.lifecycle import shift_past
from vartrace.storage.manifest_writer import ManifestWriter
from vartrace.storage.root_index import RootIndex
from vartrace.storage.site_writer import SiteWriter, describe, int64
from vartrace.trace import Trace

__all__ = ["Appender"]

# Sites whose datasets stay open between gathers (about 200 KiB of HDF5 memory each).
# Beyond this the least recently written are closed and reopened when written (about 2 ms).
_OPEN_SITES = 2048


class Appender:
    """Writes taken items into the open file `handle` (at `path`) and commits them.

    Args:
        handle: the file, open for writing.
        path: its path, for warnings.
        options: the saver's storage options (dtypes, filters, the file's format).
        made: the maker of the file's groups, datasets and attributes.
        last: the file's largest (iteration, order) when it was opened (`None`: a new
            file); an appended session's tags continue past it.
    """

    def __init__(
        self,
        handle: h5py.File,
        path: Path,
        options: dict[str, Any],
        made: Made,
        last: tuple[int, int] | None,
    ) -> None:
        self.handle = handle
        self.path = path
        self._options = options
        self._made = made
        self.index = RootIndex(handle)
        self.manifest = ManifestWriter.start(path, handle, self.index)
        self.sites: dict[str, SiteWriter] = {}  # open sites, most recently written last
        self.unresolved: dict[str, str] = {}  # alias -> target: a target with no site yet
        # `reduced` and `placed` of a site not yet made
        self._undescribed: dict[str, list[ReducedFrom | Placement]] = {}
        self._dirty = False
        self._shift: tuple[int, int] | None = None  # added to (iterations, order) when appending
        self._last = last  # the file's largest (iteration, order) at open
        self._newest = last  # ... and of the records written since

    def apply(self, name: str, item: Item) -> int:
        """Write one taken item of site `name`: records, an alias's target, `reduced`,
        `placed`; the bytes of records written."""
        if isinstance(item, str):
            self._alias(name, item)
        elif isinstance(item, (ReducedFrom, Placement)):
            self._describe(name, item)
        else:
            return self._append(name, item)
        return 0

    def commit(self) -> None:
        """Make everything applied so far durable: HDF5 writes out the records first, then
        the per-site record counts that readers trust are rewritten in place."""
        for name, target in list(self.unresolved.items()):
            self._alias(name, target)
        if not self._dirty:
            return
        self.index.write_rows()
        if self._newest is not None:  # with the sum of the counts it goes with (see last_tags)
            last = np.array([*self._newest, int(self.index.counts.sum())], np.int64)
            self.handle.attrs.modify(LAST_TAGS, last)
        self.handle.flush()
        self.index.write_counts()
        self._dirty = False
        self.manifest.write(self.index)

    def forget_facts(self) -> None:
        """Drop what waits for a site that never came: the file is closing."""
        self.unresolved.clear()
        self._undescribed.clear()

    def _alias(self, name: str, target: str) -> None:
        index = self.index
        target = index.aliases.get(target, (0, target))[1]  # an alias's alias reads its target
        self.unresolved.pop(name, None)
        if name == target:  # it reads as asked already
            return
        held = index.slots.get(escape(name))
        if held is not None and index.count(held):
            warn(
                f"vartrace: {self.path}: site {name!r} holds records of its own, so it is not "
                f"made an alias of {target!r}",
                RuntimeWarning,
            )
            return
        target_slot = index.slots.get(escape(target))
        if target_slot is None or not index.count(target_slot):
            self.unresolved[name] = target  # its records come later in this gather
            return
        old = index.aliases.get(name)
        if old is not None and old[1] == target:
            return
        slot = index.add(None)
        index.define(slot, escape(name), int(index.rows[target_slot, FIRST_ORDER]), target_slot)
        index.set_count(slot, 1)
        if old is not None:  # retargeted: the old row gives way in the same commit
            index.set_count(old[0], 0)
        index.aliases[name] = (slot, target)
        self._dirty = True

    def _describe(self, name: str, origin: ReducedFrom | Placement) -> None:
        index = self.index
        site = self.sites.get(name)
        slot = index.slots.get(escape(name))
        if site is None and (slot is None or not index.count(slot)):
            self._undescribed.setdefault(name, []).append(origin)  # made with its records
            return
        describe(site.group if site is not None else index.vars[escape(name)], origin)
        self._dirty = True

    def _append(self, name: str, trace: Trace) -> int:
        index = self.index
        self.unresolved.pop(name, None)
        replaced = index.aliases.pop(name, None)
        if replaced is not None:  # records of its own: an ordinary site from now on
            index.set_count(replaced[0], 0)
        site = self.sites.pop(name, None)
        if site is None:
            link = escape(name)
            slot = index.slots.get(link)
            if slot is None:
                slot = index.add(link)
                site = SiteWriter.create(
                    index.vars, name, self._options, self._made, slot, len(trace)
                )
            else:
                site = SiteWriter(index.vars[link], self._options, self._made, index.count(slot))
        self.sites[name] = site  # most recently used last
        if len(self.sites) > _OPEN_SITES:
            del self.sites[next(iter(self.sites))]
        trace = self._continued(trace)
        newest = (int(int64(trace.iterations).max()), int(int64(trace.order).max()))
        if self._newest is not None:
            newest = (max(newest[0], self._newest[0]), max(newest[1], self._newest[1]))
        self._newest = newest
        if not site.rows:  # its first records (or a killed writer's never committed)
            index.define(site.slot, escape(name), int(int64(trace.order)[0]))
        written = 0
        for piece in one_by_one(trace):
            written += site.append(piece)
            del piece  # written: freed before the next record is taken
        index.set_count(site.slot, site.rows)
        self.manifest.note(name, site, trace)
        for origin in self._undescribed.pop(name, ()):
            describe(site.group, origin)
        self._dirty = True
        return written

    def _continued(self, trace: Trace) -> Trace:
        """`trace` with tags that continue the file's (appending): never a duplicate iteration.

        The first records appended decide: when they are tagged at or before the
        file's last iteration (a restarted tracer counts from 1 again), every
        iteration of this session is moved past it, with a warning naming
        `set_iteration`; capture order numbers likewise continue the file's.
        """
        if self._shift is None:
            self._shift = (0, 0) if self._last is None else shift_past(self.path, self._last, trace)
        moved, orders = self._shift
        if not moved and not orders:
            return trace
        return Trace(
            trace.values,
            int64(trace.iterations) + moved,
            trace.ranks,
            int64(trace.order) + orders,
            trace.shapes,
        )
