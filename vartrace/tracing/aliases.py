"""Names that read as another site's records: what a `**` pattern stored once.

A tensor handed from one method to another (returned up through the layers, or
passed as an argument to a helper) matches a `**` pattern at every site that holds
it.  It is stored once, under the site that captured it first; every other name
the pattern matched becomes an *alias* of that site, so that each name a pattern
matched can be read back (`run["attn.forward.attn_weights"]` gives the records
stored under `attn.forward>eager_attention_forward.attn_weights`).

An alias never holds records of its own.  Should its value later differ from the
first site's (the code took another path), the name stores its own records from
then on, and a warning says under which name the earlier ones are.
"""

from __future__ import annotations

import threading

from vartrace._support.warnings import warn

__all__ = ["Aliases"]


class Aliases:
    """The aliases of one tracer's `**` patterns, declared as the run finds them.

    The capture side calls `share` when a name holds a tensor another site stored
    and `own` when a name stores a record itself; the tracer hands `taken()` to
    its sinks at each gather, before the records.

    Example:
        ```python
        aliases = Aliases()
        aliases.share("attn.forward.w", "attn.forward>eager.w")  # True: read as the other
        aliases.taken()  # [("attn.forward.w", "attn.forward>eager.w")]
        ```
    """

    def __init__(self) -> None:
        self._targets: dict[str, str] = {}
        self._owners: set[str] = set()  # names that stored records of their own
        self._new: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def share(self, name: str, target: str) -> bool:
        """Whether `name`, holding the tensor `target` stored, may skip its record.

        True makes (or keeps) `name` an alias of `target`.  False when `name`
        stored records of its own before, or reads as another site: it stores
        this one too.
        """
        known = self._targets.get(name)
        if known is not None:
            return known == target
        with self._lock:
            if name in self._owners or name in self._targets:
                return self._targets.get(name) == target
            self._targets[name] = target
            self._new.append((name, target))
        return True

    def adopt(self, name: str, target: str) -> bool:
        """Whether `name`, an alias of `target` on another rank, can be one here too.

        True when it already is, or `name` stored nothing here: it becomes one, and the
        caller declares it (it is not handed out by `taken()`).  False when `name`
        stored records of its own here, or reads as another site.
        """
        with self._lock:
            if name in self._owners or self._targets.get(name, target) != target:
                return False
            self._targets[name] = target
        return True

    def own(self, name: str) -> None:
        """Note that `name` stores a record itself (an alias becomes an ordinary site)."""
        if name in self._owners:
            return
        with self._lock:
            self._owners.add(name)
            target = self._targets.pop(name, None)
        if target is not None:
            warn(
                f"vartrace: {name} held the same tensor as {target} until now and read "
                f"as it; from here on it holds a value of its own, stored under {name} "
                f"(its earlier records are those of {target})",
                UserWarning,
                stacklevel=2,
            )

    def taken(self) -> list[tuple[str, str]]:
        """The `(alias, target)` pairs declared since the last call, oldest first."""
        if not self._new:  # the common case, at every gather: nothing new
            return []
        with self._lock:
            new, self._new = self._new, []
        return [(name, target) for name, target in new if self._targets.get(name) == target]

    def __len__(self) -> int:
        return len(self._targets)

    def __contains__(self, name: object) -> bool:
        """Whether `name` reads as another site now."""
        return name in self._targets

    def items(self) -> list[tuple[str, str]]:
        """Every alias and its target now."""
        return list(self._targets.items())
