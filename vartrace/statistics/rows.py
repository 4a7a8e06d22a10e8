"""Statistics mode's record path for a plain dense CPU tensor, as short as a whole record's.

Where a tracer's one pre-save callback is `vartrace.stats()` (no histogram, no quantiles,
every site) and its records are kept on the CPU by synchronous staging with no saver to
wait for, `SiteRows.record` takes a plain tensor's record straight from the capture: the
compiled kernel writes its row (the one `StatsReducer` makes of it) and compares it with
the site's last row in the same call, so an unchanged row is left out without a tensor
made or compared, and a changed one is kept as it is (the staging's copy of a fresh row
is the row itself).  Whatever the kernel does not read takes the tracer's general path.
Change detection is the chunk's for each path alone: where one site's records switch
between them (a tensor read dense, then one that is not), the first record after the
switch is compared with nothing and kept.

Example:
    ```python
    rows = SiteRows.of(hooks.pre_save, config, chunk, reductions)  # None: not this case
    if rows is None or not rows.record("blocks.0.forward.h", h, iteration):
        ...  # the general path
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vartrace.statistics import compiled
from vartrace.statistics.kernels import BLOCK
from vartrace.statistics.records import StatsReducer

__all__ = ["SiteRows", "build_kernel"]

_CPU = torch.device("cpu")


def build_kernel(pre_save: Sequence[tuple[Callable[..., Any], bool]]) -> None:
    """Build (or load) the compiled kernel now where a pre-save callback is a statistics
    reducer: at the tracer's start, so that no step compiles it (without a compiler, its
    records take the numpy kernel, as before)."""
    if any(isinstance(callback, StatsReducer) for callback, _ in pre_save):
        compiled.available()


class SiteRows:
    """Statistics rows of plain dense CPU tensors, each compared with its site's last row
    by the kernel that writes it, kept in a tracer's chunk (see the module).

    Args:
        header: the reducer's header (the record's first element).
        keep: the chunk's `keep(site, record, iteration, host, nbytes)`.
        note: the tracer's `Reductions.note(site, value)` (the value a row replaced).
        compare: change detection: a row equal to its site's last one is left out.
    """

    def __init__(
        self,
        header: float,
        keep: Callable[[str, Any, int, Any, int], None],
        note: Callable[[str, Any], None],
        compare: bool,
    ) -> None:
        self._header = header
        self._keep = keep
        self._note = note
        self._compare = compare
        self._last: dict[str, np.ndarray] = {}  # site -> the fields of its last row kept

    @classmethod
    def of(
        cls,
        pre_save: Sequence[tuple[Callable[..., Any], bool]],
        config: Any,
        chunk: Any,
        facts: Any,
    ) -> SiteRows | None:
        """The rows of a tracer whose callbacks, `config` (a `TracerConfig`) and `chunk`
        (a `Chunk`: no saver to wait for) allow this path, noting what rows replaced in
        `facts` (its `Reductions`); `None` otherwise."""
        if len(pre_save) != 1 or chunk.waits or config.staging != "sync" or config.device != _CPU:
            return None
        reducer = pre_save[0][0]
        if type(reducer) is not StatsReducer or reducer.sites is not None:
            return None
        layout = reducer.layout
        if layout.bins is not None or layout.quantiles:
            return None
        return cls(layout.header, chunk.keep, facts.note, config.change_detection)

    def record(self, site: str, value: Any, iteration: int) -> bool:
        """Record `value`'s statistics row at `site`, unless it equals the site's last one;
        `False` where the kernel does not read `value` (the caller's general path)."""
        out = np.empty(12)
        same = compiled.dense_summary(value, self._header, BLOCK, out, self._last.get(site))
        if same is None:
            return False
        self._note(site, value)
        if not same:
            if self._compare:
                self._last[site] = out
            # Compared here: `None` as the host copy makes the chunk forget its own last one.
            self._keep(site, torch.from_numpy(out), iteration, None, 0)
        return True

    def forget(self, site: str) -> None:
        """A record of `site` took the general path: its next row is compared with nothing
        here (the chunk compares that record with the next one it is given)."""
        self._last.pop(site, None)
