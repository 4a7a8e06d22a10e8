"""Which sites of two runs `compare` pairs: by name, and the `@every` line sites of one
variable by their rank in its binding order, so that an edit moving lines is no divergence.

`@every` keys each value by the source line that bound it (`forward.h@every:L27`).  An
inserted comment moves every later line, so the same statement has another name in the
other run: the line sites of one variable are paired by rank (the first binding with the
first, ...) when both runs bind it on as many lines, and say so in the report's notes.
When the counts differ, no pairing can tell which statement is which: those line sites
are listed as present in one run only, with a note, never compared against another
statement.  The series names (`forward.h@every`) are compared only when named exactly:
their records are those of their line sites.

Example:
    ```python
    pairs = pair_sites(["forward.h@every:L27"], ["forward.h@every:L28"])
    pairs.common, pairs.moved      # [], {"forward.h@every:L27": "forward.h@every:L28"}
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vartrace._support.series import line_of, series_of

__all__ = ["Pairs", "pair_sites"]


@dataclass
class Pairs:
    """The sites of two runs as `compare` pairs them.

    Attributes:
        common: names present in both runs, compared under that name.
        moved: a's line site -> b's line site of the same binding, under another line.
        only_a / only_b: sites present in one run only (in the order of its names).
        notes: what the report says about the pairing (lines moved, bindings not paired).
    """

    common: list[str] = field(default_factory=list)
    moved: dict[str, str] = field(default_factory=dict)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _lines(names: Sequence[str]) -> dict[str, list[str]]:
    """Series -> its line sites among `names`, in the order of `names` (binding order)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        series = series_of(name)
        if series is not None:
            groups.setdefault(series, []).append(name)
    return groups


def _line_text(lines: Sequence[str]) -> str:
    return ", ".join(f"L{line_of(name)}" for name in lines)


def pair_sites(names_a: Sequence[str], names_b: Sequence[str]) -> Pairs:
    """Pair the sites of two runs, each list in the run's execution order."""
    pairs = Pairs()
    lines_a, lines_b = _lines(names_a), _lines(names_b)
    regrouped: set[str] = set()  # line sites paired (or refused) by rank, not by name
    for series in lines_a.keys() & lines_b.keys():
        a, b = lines_a[series], lines_b[series]
        if a == b:
            continue
        regrouped.update(a, b)
        if len(a) == len(b):
            pairs.moved.update((x, y) for x, y in zip(a, b, strict=True) if x != y)
            pairs.common.extend(x for x, y in zip(a, b, strict=True) if x == y)
            pairs.notes.append(
                f"lines moved: {series} binds at {_line_text(a)} in a, {_line_text(b)} in b "
                "(paired in binding order)"
            )
        else:
            pairs.only_a.extend(a)
            pairs.only_b.extend(b)
            pairs.notes.append(
                f"not paired: {series} binds at {len(a)} line(s) in a ({_line_text(a)}) and "
                f"{len(b)} in b ({_line_text(b)}); the statements cannot be matched"
            )
    in_a, in_b = set(names_a), set(names_b)
    paired, refused_a, refused_b = set(pairs.common), set(pairs.only_a), set(pairs.only_b)
    pairs.common = [n for n in names_a if n in paired or (n not in regrouped and n in in_b)]
    pairs.only_a = [n for n in names_a if n in refused_a or (n not in regrouped and n not in in_b)]
    pairs.only_b = [n for n in names_b if n in refused_b or (n not in regrouped and n not in in_a)]
    return pairs
