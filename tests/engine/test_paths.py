"""The path language: parsing, errors, and glob / ``**`` matching (torch-free)."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vartrace.engine.paths import parse


@pytest.mark.parametrize(
    ("text", "segments", "when"),
    [
        ("forward.x", ("forward", "x"), None),
        ("layers.*.attn.forward.scores", ("layers", "*", "attn", "forward", "scores"), None),
        ("**.scores@every", ("**", "scores"), "every"),
        ("head.forward.self.weight@grad", ("head", "forward", "self", "weight"), "grad"),
        ("encoder.[0-3]@return", ("encoder", "[0-3]"), "return"),
        ("forward.x@entry", ("forward", "x"), "entry"),
        # A function that a method at any depth calls: "**" then "*>function".
        (
            "**>eager_attention_forward.attn_weights",
            ("**", "*>eager_attention_forward", "attn_weights"),
            None,
        ),
    ],
)
def test_parse(text: str, segments: tuple[str, ...], when: str | None) -> None:
    pattern = parse(text)
    assert pattern.segments == segments
    assert pattern.when == when
    assert pattern.text == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("@entry", "empty"),
        ("layers..x", "segment 2 is empty"),
        (".forward", "segment 1 is empty"),
        ("forward.", "segment 2 is empty"),
        ("forward.x@sometimes", "unknown timing '@sometimes'"),
        ("a.b**.c", "'**' must be a whole segment"),
        ("a.**x>f.c", "'**' must be a whole segment"),
        ("a.[0-3.c", "unbalanced brackets"),
    ],
)
def test_malformed_patterns_quote_the_pattern(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        parse(text)
    assert repr(text) in str(error.value)


def test_non_string_pattern() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        parse(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "site", "expected"),
    [
        ("layers.*.attn.forward.scores", "layers.3.attn.forward.scores", True),
        ("layers.*.attn.forward.scores", "layers.3.mlp.forward.scores", False),
        ("layers.[0-1].attn", "layers.1.attn", True),
        ("layers.[0-1].attn", "layers.2.attn", False),
        ("layers.?", "layers.7", True),
        ("layers.?", "layers.12", False),
        ("**.scores", "layers.0.attn.forward.scores", True),
        ("**.scores", "scores", True),
        ("**", "a.b.c", True),
        ("a.**.d", "a.d", True),
        ("a.**.d", "a.b.c.d", True),
        ("a.**.d", "a.b.c.e", False),
        ("**.**.x", "x", True),
        ("forward.*", "forward.self", False),
        ("forward.self", "forward.self", True),
        ("forward.**.step", "forward.self.step", False),
        ("forward.self.*", "forward.self.step", True),
        ("**", "forward.self", False),
        ("forward.s*", "forward.self", False),
    ],
)
def test_matching(pattern: str, site: str, expected: bool) -> None:
    assert parse(pattern).matches(site.split(".")) is expected


def test_incremental_states() -> None:
    pattern = parse("layers.*.attn")
    states = pattern.step(pattern.start, "layers")
    assert pattern.alive(states) and not pattern.accepts(states)
    states = pattern.step(pattern.step(states, "0"), "attn")
    assert pattern.accepts(states) and not pattern.alive(states)
    assert pattern.step(states, "more") == frozenset()


def test_literal_next() -> None:
    pattern = parse("a.*.step_count")
    states = pattern.step(pattern.step(pattern.start, "a"), "x")
    assert pattern.literal_next(states) == {"step_count"}


_names = st.sampled_from(["a", "b", "ab", "x1", "self", "0", "12"])
_globs = st.sampled_from(["a", "b", "*", "?", "a*", "[ab]", "**", "x?", "1*", "self"])


def _reference(segments: list[str], site: list[str]) -> bool:
    """Obvious recursive matcher that the automaton must agree with."""
    if not segments:
        return not site
    head, rest = segments[0], segments[1:]
    if head == "**":
        if _reference(rest, site):
            return True
        return bool(site) and site[0] != "self" and _reference(segments, site[1:])
    if not site:
        return False
    if site[0] == "self" and head != "self":
        return False
    return fnmatchcase(site[0], head) and _reference(rest, site[1:])


@given(st.lists(_globs, min_size=1, max_size=5), st.lists(_names, max_size=6))
def test_automaton_agrees_with_reference(segments: list[str], site: list[str]) -> None:
    pattern = parse(".".join(segments))
    assert pattern.matches(site) == _reference(segments, site)
