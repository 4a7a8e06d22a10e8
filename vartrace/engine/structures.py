"""Walking captured values: splitting structures into leaves and following keys.

A captured value is either a *container* — a mapping, list, tuple,
namedtuple, dataclass, or a type registered with
`register_container` (the torch edge registers `nn.Module`, whose
children are its parameters, buffers and submodules) — or a *leaf*.  A
container is split into leaf sites named by its keys (`forward.0`,
`forward.logits`).  Keys are matched one segment at a time against the
rest of a `Pattern`.

Plain attributes of non-container objects (`forward.self.step_count`)
are reachable by writing their name literally; wildcards only expand over
container keys.

A structure that refers to itself (a ring of dicts linked by `prev` and
`next`) is walked once: the reference back to a container being walked
is an [`Unstored`][vartrace.Unstored] leaf naming it, with a warning.  A container
reached again along another path (shared, not cyclic) is walked again,
as long as the walk has entered fewer than `_MAX_NODES` containers; past
that, it is an [`Unstored`][vartrace.Unstored] leaf naming where it was walked, so that
deeply shared structures cost what they hold, not 2**depth.

Example:
    ```python
    >>> from vartrace.engine.paths import parse
    >>> p = parse("out.*.b")
    >>> states = p.step(p.start, "out")
    >>> sorted(select({"x": {"b": 1}, "y": {"b": 2, "c": 3}}, p, states, "f.out"))
    [('f.out.x.b', 1), ('f.out.y.b', 2)]
    ```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from vartrace._support.warnings import warn
from vartrace.engine.paths import Pattern, States
from vartrace.markers import Unstored

__all__ = [
    "Unstored",
    "children",
    "is_leaf",
    "leaf_types",
    "leaves",
    "register_container",
    "select",
]

Children = Callable[[Any], Iterable[tuple[str, Any]]]

_MAX_DEPTH = 32
_MAX_NODES = 10_000  # containers one walk enters before a shared one is no longer walked again
_ATOMIC: frozenset[type] = frozenset(
    {int, float, bool, complex, str, bytes, bytearray, type(None), type(Ellipsis)}
)
_registered: dict[type, Children] = {}
# type -> how to list its children, or None for leaves; filled lazily per type.
_kind_cache: dict[type, Children | None] = {}
leaf_types: set[type] = set()
"""The types `children` has found to be leaves so far (a type not in it may be one too).

A membership test is cheaper than a call where every microsecond counts (a
captured tensor, on every traced call)."""


_warned_markers: set[str] = set()
_warned_listing: set[str] = set()  # sites whose container raised while listed


class _Walk:
    """One walk over a captured value: the containers on the current path, and those seen.

    `ancestors` holds a key per container being walked (its id, with the
    pattern's state when selecting); `first` the site where each container
    was first walked; `nodes` counts the containers entered.
    """

    __slots__ = ("ancestors", "first", "nodes", "root")

    def __init__(self, root: str) -> None:
        self.root = root
        self.ancestors: set[tuple[int, States | None]] = set()
        self.first: dict[int, str] = {}
        self.nodes = 0

    def enter(self, value: Any, key: tuple[int, States | None], path: str) -> Unstored | None:
        """Start walking the container `value` at `path`; or the marker to record instead."""
        self.nodes += 1
        first = self.first.setdefault(key[0], path)
        if key in self.ancestors:
            return self._marker(value, path, f"a reference back to {first} (a cycle)")
        if first != path and self.nodes > _MAX_NODES:
            return self._marker(value, path, f"the same object as {first}, walked there")
        self.ancestors.add(key)
        return None

    def _marker(self, value: Any, path: str, what: str) -> Unstored:
        """The marker for a container not walked again; the first one of a site warns."""
        marker = Unstored(f"{type(value).__qualname__}: {what}")
        if self.root not in _warned_markers:
            _warned_markers.add(self.root)
            warn(
                f"vartrace: {self.root} is not walked as a tree: {path} is {what}; such "
                f"parts are recorded as markers ({marker!r}) instead of walked again",
                RuntimeWarning,
                stacklevel=4,
            )
        return marker


def register_container(cls: type, children_of: Children) -> None:
    """Treat instances of `cls` (and subclasses) as containers.

    `children_of(obj)` yields `(key, child)` pairs.  Example:

    ```python
    register_container(nn.Module, lambda m: m._parameters.items())
    ```
    """
    _registered[cls] = children_of
    _kind_cache.clear()
    leaf_types.clear()


def _escape_key(key: str) -> str:
    return key.replace("\\", "\\\\").replace(".", "\\.") if "." in key or "\\" in key else key


def _key_names(keys: list[Any]) -> list[str]:
    """Unambiguous site segments for the keys of one mapping.

    A dot in a key is escaped (`"a.b"` -> `a\\.b`), so that it never reads
    as two levels; a non-str key named like a str key of the same mapping
    gets its type as a prefix (`{1: a, "1": b}` -> `int:1` and `1`).
    """
    names = [_escape_key(k if type(k) is str else str(k)) for k in keys]
    taken = {name for key, name in zip(keys, names, strict=True) if type(key) is str}
    for index, key in enumerate(keys):
        if type(key) is not str and names[index] in taken:
            names[index] = f"{type(key).__name__}:{names[index]}"
    return names


def _mapping_items(value: Mapping[Any, Any]) -> Iterable[tuple[str, Any]]:
    if all(type(k) is str and "." not in k and "\\" not in k for k in value):
        return value.items()
    keys = list(value)
    return zip(_key_names(keys), (value[k] for k in keys), strict=True)


def _sequence_items(value: Iterable[Any]) -> Iterable[tuple[str, Any]]:
    return ((str(i), v) for i, v in enumerate(value))


def _namedtuple_items(value: Any) -> Iterable[tuple[str, Any]]:
    return zip(value._fields, value, strict=True)


def _dataclass_items(value: Any) -> Iterable[tuple[str, Any]]:
    return ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))


def _classify(cls: type) -> Children | None:
    if cls in _ATOMIC:
        return None
    for base in cls.__mro__:
        if base in _registered:
            return _registered[base]
    if issubclass(cls, Mapping):
        return _mapping_items
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return _namedtuple_items
    if issubclass(cls, (list, tuple)):
        return _sequence_items
    if dataclasses.is_dataclass(cls):
        return _dataclass_items
    return None


def _kind(cls: type) -> Children | None:
    try:
        return _kind_cache[cls]
    except KeyError:
        kind = _kind_cache[cls] = _classify(cls)
        if kind is None:
            leaf_types.add(cls)
        return kind


def children(value: Any) -> Iterable[tuple[str, Any]] | None:
    """The `(key, child)` pairs of a container, or `None` for a leaf."""
    kind = _kind(type(value))
    return None if kind is None else kind(value)


def is_leaf(value: Any) -> bool:
    """Whether `value` is a leaf, judged by its type alone (nothing of it is called)."""
    return _kind(type(value)) is None


def _listed(value: Any, path: str) -> list[tuple[str, Any]] | Unstored | None:
    """`value`'s `(key, child)` pairs, listed now; `None` for a leaf.  A container that
    raises while listed (a dict subclass whose `__iter__` raises) is a marker naming it,
    with a warning the first time its site gives one: never the step's error."""
    kind = _kind(type(value))
    if kind is None:
        return None
    try:
        return list(kind(value))
    except Exception as error:
        lines = str(error).strip().splitlines()
        why = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        marker = Unstored(f"{type(value).__qualname__}: cannot list its items ({why})")
        if path not in _warned_listing:
            _warned_listing.add(path)
            warn(
                f"vartrace: site {path!r}: cannot list the items of a "
                f"{type(value).__qualname__} ({why}); recording the marker {marker!r} instead",
                RuntimeWarning,
            )
        return marker


def leaves(
    value: Any, path: str, _depth: int = 0, _walk: _Walk | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield `(site, leaf)` for every leaf below `value`, named from `path`."""
    kids = _listed(value, path) if _depth < _MAX_DEPTH else None
    if kids is None:
        yield path, value
        return
    if isinstance(kids, Unstored):
        yield path, kids
        return
    walk = _Walk(path) if _walk is None else _walk
    key = (id(value), None)
    marker = walk.enter(value, key, path)
    if marker is not None:
        yield path, marker
        return
    for name, child in kids:
        yield from leaves(child, _join(path, name), _depth + 1, walk)
    walk.ancestors.discard(key)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _attribute(value: Any, name: str) -> Any:
    """A plain, non-callable attribute of `value`, or raise AttributeError."""
    attr = getattr(value, name)
    if callable(attr) and children(attr) is None:
        raise AttributeError(name)
    return attr


def select(
    value: Any,
    pattern: Pattern,
    states: States,
    path: str,
    _depth: int = 0,
    _walk: _Walk | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yield `(site, leaf)` for the parts of `value` the rest of `pattern` selects.

    `states` is the pattern's state after the segments that led to
    `value` (named `path`).  A node that completes the pattern
    contributes all its leaves.  Going round a cycle back to a container
    in the same pattern state selects nothing new: the walk stops there.
    """
    walk = _Walk(path) if _walk is None else _walk
    if pattern.accepts(states):
        yield from leaves(value, path, _depth, walk)
        return
    if _depth >= _MAX_DEPTH or not pattern.alive(states):
        return
    kids = _listed(value, path)
    if isinstance(kids, Unstored):
        yield path, kids
        return
    seen: set[str] = set()
    if kids is not None:
        key = (id(value), states)
        if key in walk.ancestors:
            return
        marker = walk.enter(value, key, path)
        if marker is not None:
            yield path, marker
            return
        for name, child in kids:
            seen.add(name)
            after = pattern.step(states, name)
            if after:
                yield from select(child, pattern, after, _join(path, name), _depth + 1, walk)
        walk.ancestors.discard(key)
        if isinstance(value, (Mapping, list, tuple)):
            return
    for name in pattern.literal_next(states) - seen:
        try:
            child = _attribute(value, name)
        except AttributeError:
            continue
        after = pattern.step(states, name)
        yield from select(child, pattern, after, _join(path, name), _depth + 1, walk)
