"""Splitting captured values into leaves and following keys (torch-free)."""

from __future__ import annotations

import itertools
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vartrace.engine.paths import parse
from vartrace.engine.structures import (
    Unstored,
    children,
    leaf_types,
    leaves,
    register_container,
    select,
)

Point = namedtuple("Point", ["x", "y"])


@dataclass
class Output:
    logits: Any
    aux: Any = None


class Box:
    """A plain object: not a container, attributes reachable by literal name."""

    def __init__(self) -> None:
        self.count = 3
        self.inner = {"k": 1}

    def method(self) -> int:
        return 1


def _select(value: Any, pattern_text: str, head: str = "v") -> dict[str, Any]:
    pattern = parse(pattern_text)
    states = pattern.step(pattern.start, head)
    return dict(select(value, pattern, states, head))


def test_leaves_of_nested_structures() -> None:
    value = {"a": [1, (2, 3)], "b": Point(4, 5), "c": Output(6), "d": OrderedDict(e=7)}
    assert dict(leaves(value, "f")) == {
        "f.a.0": 1,
        "f.a.1.0": 2,
        "f.a.1.1": 3,
        "f.b.x": 4,
        "f.b.y": 5,
        "f.c.logits": 6,
        "f.c.aux": None,
        "f.d.e": 7,
    }


def test_leaf_values_are_single_sites() -> None:
    box = Box()
    assert list(leaves(box, "f.box")) == [("f.box", box)]
    assert list(leaves(2.5, "f")) == [("f", 2.5)]
    assert list(leaves("text", "f")) == [("f", "text")]


def test_empty_containers_have_no_leaves() -> None:
    assert list(leaves([], "f")) == []
    assert list(leaves({}, "f")) == []


def test_select_by_key_and_glob() -> None:
    value = {"x": {"b": 1}, "y": {"b": 2, "c": 3}}
    assert _select(value, "v.*.b") == {"v.x.b": 1, "v.y.b": 2}
    assert _select(value, "v.y") == {"v.y.b": 2, "v.y.c": 3}
    assert _select(value, "v.**.c") == {"v.y.c": 3}
    assert _select(value, "v.z") == {}


def test_select_indices_and_fields() -> None:
    value = (Point(1, 2), [10, 20, 30])
    assert _select(value, "v.0.y") == {"v.0.y": 2}
    assert _select(value, "v.1.[12]") == {"v.1.1": 20, "v.1.2": 30}


def test_plain_attributes_only_by_literal_name() -> None:
    box = Box()
    assert _select(box, "v.count") == {"v.count": 3}
    assert _select(box, "v.inner.k") == {"v.inner.k": 1}
    assert _select(box, "v.*") == {}
    assert _select(box, "v.method") == {}, "methods are not values"


def test_dict_keys_are_not_attributes() -> None:
    assert _select({"a": 1}, "v.items") == {}


def test_registered_container() -> None:
    class Bag:
        def __init__(self) -> None:
            self.parts = {"w": 1.0, "b": 2.0}
            self.tag = "t"

    register_container(Bag, lambda bag: bag.parts.items())
    bag = Bag()
    assert sorted(children(bag)) == [("b", 2.0), ("w", 1.0)]  # type: ignore[arg-type]
    assert dict(leaves(bag, "m")) == {"m.w": 1.0, "m.b": 2.0}
    assert _select(bag, "v.tag") == {"v.tag": "t"}, "literal attributes still reachable"


def test_a_type_first_seen_as_a_leaf_can_be_registered_as_a_container() -> None:
    class Pouch:
        pass

    pouch = Pouch()
    assert children(pouch) is None
    assert Pouch in leaf_types
    register_container(Pouch, lambda _: [("coin", 1)])
    assert Pouch not in leaf_types, "the cache of leaf types forgets what registering changes"
    assert dict(leaves(pouch, "m")) == {"m.coin": 1}


def _ring(size: int) -> list[dict[str, Any]]:
    """Nodes linked both ways, as in a doubly linked ring: every node reaches every other."""
    nodes: list[dict[str, Any]] = [{"value": i} for i in range(size)]
    for i, node in enumerate(nodes):
        node["next"] = nodes[(i + 1) % size]
        node["prev"] = nodes[i - 1]
    return nodes


def test_self_referencing_structure_terminates() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.warns(RuntimeWarning, match=r"loop\.1 is a reference back to loop \(a cycle\)"):
        sites = dict(leaves(loop, "loop"))
    assert sites == {"loop.0": 1, "loop.1": "list: a reference back to loop (a cycle)"}
    assert isinstance(sites["loop.1"], Unstored)


def test_a_ring_is_walked_once_with_markers_at_the_references_back() -> None:
    ring = _ring(3)
    with pytest.warns(RuntimeWarning, match="ring is not walked as a tree"):
        sites = dict(itertools.islice(leaves(ring[0], "ring"), 1000))  # a tree: 2**32 leaves
    values = {site: leaf for site, leaf in sites.items() if not isinstance(leaf, Unstored)}
    assert values == {
        "ring.value": 0,
        "ring.next.value": 1,
        "ring.next.next.value": 2,
        "ring.prev.value": 2,
        "ring.prev.prev.value": 1,
    }
    markers = {site: leaf for site, leaf in sites.items() if isinstance(leaf, Unstored)}
    assert markers["ring.next.next.next"] == "dict: a reference back to ring (a cycle)"
    assert markers["ring.prev.prev.next"] == "dict: a reference back to ring.next.next (a cycle)"
    assert len(markers) == 6


def test_select_in_a_ring_stops_going_round() -> None:
    ring = _ring(3)
    pattern = parse("v.**.value")
    going_round = select(ring[0], pattern, pattern.step(pattern.start, "v"), "v")
    assert dict(itertools.islice(going_round, 1000)) == {
        "v.value": 0,
        "v.next.value": 1,
        "v.next.next.value": 2,
        "v.prev.value": 2,
        "v.prev.prev.value": 1,
    }
    # Named literally, a way round the ring is followed as far as the pattern goes.
    assert _select(ring[0], "v.next.next.next.prev.value") == {"v.next.next.next.prev.value": 2}


def test_shared_parts_are_walked_again_until_the_walk_grows_too_large() -> None:
    shared = {"w": 1}
    assert dict(leaves({"a": shared, "b": [shared]}, "f")) == {"f.a.w": 1, "f.b.0.w": 1}
    node: list[Any] = [0]
    for _ in range(24):  # 2**24 paths to 24 distinct lists
        node = [node, node]
    with pytest.warns(RuntimeWarning, match="dag is not walked as a tree.* the same object as"):
        sites = list(itertools.islice(leaves(node, "dag"), 100_000))
    assert len(sites) < 100_000
    assert sum(leaf == 0 for _, leaf in sites) > 1000  # walked as a tree at first
    assert any(isinstance(leaf, Unstored) for _, leaf in sites)
    pattern = parse("v.**.0")
    with pytest.warns(RuntimeWarning, match="v is not walked as a tree"):
        selected = list(
            itertools.islice(select(node, pattern, pattern.step(pattern.start, "v"), "v"), 100_000)
        )
    assert len(selected) < 100_000


_leaf = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats(allow_nan=False))
_keys = st.text(alphabet="abc", min_size=1, max_size=3)
_tree = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(_keys, inner, max_size=3),
        st.tuples(inner, inner),
    ),
    max_leaves=12,
)


def _walk(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        value = value[int(key)] if isinstance(value, (list, tuple)) else value[key]
    return value


@given(_tree)
def test_leaves_round_trip(tree: Any) -> None:
    """Every leaf site names a path that leads back to that exact leaf."""
    for site, leaf in leaves(tree, "root"):
        path = tuple(site.split(".")[1:])
        assert _walk(tree, path) is leaf


@given(_tree, st.sampled_from(["a", "b", "0", "1", "*", "**"]))
def test_select_is_the_matching_subset_of_leaves(tree: Any, key: str) -> None:
    """select(pattern) == the leaves whose site (or an ancestor's) matches the pattern."""
    pattern = parse(f"root.{key}")
    selected = dict(select(tree, pattern, pattern.step(pattern.start, "root"), "root"))
    expected = {}
    for site, leaf in leaves(tree, "root"):
        parts = site.split(".")
        if any(pattern.matches(parts[:n]) for n in range(1, len(parts) + 1)):
            expected[site] = leaf
    assert selected.keys() == expected.keys()
