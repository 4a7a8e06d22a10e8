"""The path language: parsing patterns and matching them one segment at a time.

A pattern is a dot-separated sequence of segments, each an fnmatch glob
(`*`, `?`, `[0-3]`) over one segment, or `**` for zero or more
segments, optionally followed by a timing suffix:

```python
layers.*.attn.forward.scores
**.scores@every
layers.0.attn.forward.scores@every:L73
head.forward.self.weight@grad
```

`@every` keys each value by the source line that bound it: the site
`layers.0.attn.forward.scores@every:L73` holds the values line 73 gave
`scores`, and the pattern `...scores@every:L73` records that line's only.
The line is part of the suffix, after the `@`, so it never reads as a
segment (`int:1`, the name of an int key, is one).

Matching is incremental: a `Pattern` is a small non-deterministic
automaton whose state is a frozenset of positions in the segment list.
The static part of a site (module path, method, variable) is matched once
when a tracer starts; the dynamic part (keys inside runtime values) is
matched while walking a captured value.  Wildcards never match the
*variable* `self` (the module object): only a literal `self` does.  A
module path segment named `self` (Hugging Face BERT's `attention.self`)
is an ordinary name: callers step module path segments with `plain=True`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import translate
from typing import Literal

__all__ = [
    "GLOB_CHARS",
    "LINE_MARK",
    "WHENS",
    "Pattern",
    "States",
    "When",
    "is_glob",
    "parse",
]

When = Literal["entry", "return", "every", "grad"]
WHENS: tuple[When, ...] = ("entry", "return", "every", "grad")
GLOB_CHARS = frozenset("*?[")
LINE_MARK = ":L"
"""Joins `@every` and a source line, in a site name and a pattern: `scores@every:L73`."""

States = frozenset[int]


def is_glob(segment: str) -> bool:
    """Whether a pattern segment is a wildcard (`*`, `?`, `[...]`, `**`)."""
    return not GLOB_CHARS.isdisjoint(segment)


@dataclass(frozen=True)
class Pattern:
    """A parsed pattern.

    Example:
        ```python
        >>> p = parse("layers.*.attn.forward.scores@every")
        >>> p.segments, p.when
        (('layers', '*', 'attn', 'forward', 'scores'), 'every')
        >>> p.matches("layers.3.attn.forward.scores".split("."))
        True
        >>> parse("attn.forward.scores@every:L73").line
        73
        ```

    `line` is the source line an `@every` pattern keeps the values of, if any.
    """

    text: str
    segments: tuple[str, ...]
    when: When | None = None
    line: int | None = None
    _regexes: tuple[re.Pattern[str] | None, ...] = field(
        default=(), repr=False, compare=False, hash=False
    )

    @property
    def start(self) -> States:
        """The automaton's initial state set."""
        return self._closure(frozenset((0,)))

    def _closure(self, states: States) -> States:
        # ``**`` may match zero segments: a position on ``**`` also stands past it.
        out = set(states)
        for i in states:
            j = i
            while j < len(self.segments) and self.segments[j] == "**":
                j += 1
                out.add(j)
        return frozenset(out)

    def step(self, states: States, segment: str, *, plain: bool = False) -> States:
        """The states after consuming `segment` (empty when the pattern cannot match).

        A segment reading `self` is matched only by a literal `self`,
        unless `plain` says it is an ordinary name (a module path segment).
        """
        nxt: set[int] = set()
        is_self = segment == "self" and not plain
        for i in states:
            if i >= len(self.segments):
                continue
            if self.segments[i] == "**":
                if not is_self:
                    nxt.add(i)
            elif self._matches_at(i, segment, is_self):
                nxt.add(i + 1)
        return self._closure(frozenset(nxt)) if nxt else frozenset()

    def _matches_at(self, i: int, segment: str, is_self: bool) -> bool:
        """Whether the (non-`**`) pattern segment `i` matches `segment`."""
        regex = self._regexes[i]
        if regex is None:
            return self.segments[i] == segment
        return not is_self and regex.match(segment) is not None

    def accepts(self, states: States) -> bool:
        """Whether the segments consumed so far form a complete match."""
        return len(self.segments) in states

    def alive(self, states: States) -> bool:
        """Whether consuming more segments could still lead to a match."""
        return any(i < len(self.segments) for i in states)

    def literal_next(self, states: States) -> set[str]:
        """The literal segments that may come next (for attribute look-ups)."""
        return {
            self.segments[i]
            for i in states
            if i < len(self.segments) and self._regexes[i] is None and self.segments[i] != "**"
        }

    def explicit(self, states: States, segment: str) -> bool:
        """Whether a segment other than `**` can consume `segment` from `states`.

        `False` means that only a `**` would swallow it: the pattern names
        something further down, not `segment` itself.
        """
        is_self = segment == "self"
        return any(
            i < len(self.segments)
            and self.segments[i] != "**"
            and self._matches_at(i, segment, is_self)
            for i in states
        )

    def matches(self, segments: list[str] | tuple[str, ...], *, plain: int = 0) -> bool:
        """Whether the whole sequence `segments` matches.

        The first `plain` segments are ordinary names (a module path), so
        wildcards match them even where one reads `self`.
        """
        states = self.start
        for position, segment in enumerate(segments):
            states = self.step(states, segment, plain=position < plain)
            if not states:
                return False
        return self.accepts(states)


def parse(text: str) -> Pattern:
    """Parse a pattern, raising `ValueError` that quotes it when it is malformed.

    Example:
        ```python
        >>> parse("encoder.1").segments
        ('encoder', '1')
        ```
    """
    if not isinstance(text, str):
        raise TypeError(f"a pattern must be a str, not {type(text).__name__}: {text!r}")
    body, at, suffix = text.partition("@")
    when, mark, line = suffix.partition(LINE_MARK)
    if at and when not in WHENS:
        raise ValueError(
            f"pattern {text!r}: unknown timing '@{suffix}'; use one of "
            + ", ".join(f"@{w}" for w in WHENS)
            + f" (@every{LINE_MARK}<line> for the values one source line binds)"
        )
    if mark and (when != "every" or not (line.isascii() and line.isdigit())):
        raise ValueError(
            f"pattern {text!r}: '@{suffix}' is no timing; a line follows @every only, as a "
            f"number: 'scores@every{LINE_MARK}73' records the values line 73 binds"
        )
    if not body:
        raise ValueError(f"pattern {text!r} is empty")
    # "**>function": a function that a method at any depth calls; "**" then "*>function".
    segments = tuple(
        part
        for segment in body.split(".")
        for part in (("**", "*" + segment[2:]) if segment.startswith("**>") else (segment,))
    )
    for position, segment in enumerate(segments, 1):
        if not segment:
            raise ValueError(f"pattern {text!r}: segment {position} is empty")
        if "**" in segment and segment != "**":
            raise ValueError(
                f"pattern {text!r}: '**' must be a whole segment, not part of {segment!r}"
            )
        if segment.count("[") != segment.count("]"):
            raise ValueError(f"pattern {text!r}: unbalanced brackets in segment {segment!r}")
    regexes = tuple(
        re.compile(translate(s)) if is_glob(s) and s != "**" else None for s in segments
    )
    return Pattern(
        text,
        segments,
        when if at else None,  # type: ignore[arg-type]
        int(line) if mark else None,
        regexes,
    )
