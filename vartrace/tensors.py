"""Detached copies of captured leaves, and bit-exact change detection.

A record must not change when the live value does, must not keep an
autograd graph alive, and must live on the tracer's `device`.  An object
that holds tensors in its attributes (a Hugging Face `DynamicCache`) is
never recorded live: `split_object` splits it into its tensors, and
a value that can be neither split nor copied (an object refusing
`deepcopy`, a tensor of a dtype torch cannot copy, an expanded view of
more than 1 GiB) is recorded as a [`vartrace.Unstored`][vartrace.Unstored] marker saying
why (with a warning per site).  Change detection compares a new copy with
the last one recorded for the site, bit for bit: in-place writes that do
not bump a tensor's version counter (BatchNorm running statistics, writes
through `.data`) are still seen, a NaN equals only a NaN of the same
payload, and `-0.0` differs from `0.0`, for tensors, numpy arrays and
scalars and Python floats alike.  A `DTensor` (tensor parallelism) is recorded
as its rank's local shard (`local_shard`), and a tensor subclass without
storage of its own is compared through torch, never byte by byte.
"""

from __future__ import annotations

import copy
import struct
import sys
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vartrace._support import memory
from vartrace._support.memory import MAP_FROM, map_large_blocks
from vartrace._support.text import size_text
from vartrace._support.warnings import warn
from vartrace.engine.structures import children
from vartrace.markers import Unstored

__all__ = [
    "NOT_BYTEWISE",
    "copy_leaf",
    "dense_clone",
    "is_distributed",
    "is_transformed",
    "local_shard",
    "same",
    "snapshot",
    "split_object",
    "unchanged",
    "untransformed",
]

_IMMUTABLE: frozenset[type] = frozenset(
    {int, float, bool, complex, str, bytes, type(None), type(Ellipsis)}
)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_uncopyable_warned: set[str] = set()  # the sites whose value could not be copied (or reduced)
_sharded_warned: set[str] = set()  # the sites whose DTensor was recorded as its local shard
_DISTRIBUTED: tuple[type, ...] = ()  # DTensor and AsyncCollectiveTensor, once both are imported
_MAX_EXPANDED_BYTES = 1 << 30
_NO_STORAGE = "a tensor subclass wrapping other tensors, with no storage of its own"
# Compared with ``==``: reading ``device.type`` builds a str, about a microsecond a record.
_CPU = torch.device("cpu")
_TENSOR = torch.Tensor  # module constants: read on every record
_STRIDED = torch.strided
_MAX_STATE_DEPTH = 8
_MAX_STATE_OBJECTS = 4096  # an object reaching a whole program (a trainer) is not walked further


def _tensor_state(value: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """The tensors reachable from `value` through containers and attributes, with their paths."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= _MAX_STATE_DEPTH or type(value) in _IMMUTABLE:
        return
    if id(value) in seen or len(seen) >= _MAX_STATE_OBJECTS:
        return
    seen.add(id(value))
    kids = children(value)
    if kids is None:
        # Plain objects only: never walk the namespace of a class, module or function.
        plain = not isinstance(value, ModuleType) and not callable(value)
        kids = _attributes(value) if plain else ()
    for key, child in kids:
        yield from _tensor_state(child, f"{path}.{key}", depth + 1, seen)


def _attributes(value: Any) -> Iterator[tuple[str, Any]]:
    """An object's attributes: its `__dict__`, then the slots of its classes that are set
    (a base class's first)."""
    yield from getattr(value, "__dict__", {}).items()
    for cls in reversed(type(value).__mro__):
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # private: mangled
                name = f"_{cls.__name__.lstrip('_')}{name}"
            try:
                yield name, getattr(value, name)
            except AttributeError:  # a slot never assigned
                continue


def split_object(site: str, value: Any, warned: set[type]) -> Iterator[tuple[str, Any]]:
    """`(site, value)` itself, or, for an object whose attributes hold tensors, those tensors.

    Recording such an object live (a `DynamicCache` refuses `deepcopy`)
    would keep every tensor it holds, and their autograd graph, alive; its
    tensors are recorded instead, as leaves named by attribute path
    (`forward.past_key_values.layers.0.keys`).  Warns once per type
    (`warned` holds the types already named).

    Example:
        ```python
        list(split_object("forward.cache", cache, set()))
        # [('forward.cache.keys.0', tensor(...)), ('forward.cache.values.0', tensor(...))]
        ```
    """
    if type(value) in _IMMUTABLE or isinstance(value, (torch.Tensor, np.ndarray)):
        yield site, value
        return
    try:
        tensors = list(_tensor_state(value, site, 0, set()))
    except Exception:  # a container or attribute that raises when read: the object as it is
        tensors = []  # (its copy, or a marker)
    if not tensors:
        yield site, value
        return
    if type(value) not in warned:
        warned.add(type(value))
        warn(
            f"vartrace: {site} is a {type(value).__name__} holding tensors; recording its "
            f"{len(tensors)} tensors ({tensors[0][0]}, ...) instead of the live object, "
            "which would keep their autograd graph alive",
            stacklevel=2,
        )
    yield from tensors


_functorch = torch._C._functorch
is_transformed: Callable[[torch.Tensor], bool] = _functorch.is_functorch_wrapped_tensor
"""Whether a tensor is a `torch.func` wrapper (`vmap`'s batched tensor, `grad`'s ...)."""


def untransformed(value: torch.Tensor, site: str, warned: set[str]) -> torch.Tensor | Unstored:
    """The plain tensor behind the `torch.func` wrappers of `value`, detached.

    Inside `vmap` / `grad` / `jacrev` / `jvp` / `functionalize` a
    method sees wrapper tensors: their shape is the per-call one, they have no
    storage, and they die with the transform.  The record is the value they
    stand for: under `grad` and the others the wrapped tensor itself; under
    `vmap` the batched tensor holding every mapped call, the mapped
    dimensions first (outermost `vmap` first), with a warning once per
    site (`warned` holds the sites already named).  A wrapper of another
    kind gives an [`vartrace.Unstored`][vartrace.Unstored] marker, with a warning.

    Example:
        ```python
        # inside torch.func.vmap(model)(x):
        untransformed(h, "forward.h", set()).shape   # (len(x), *h.shape)
        ```
    """
    unwrapped = _unwrapped(value)
    if unwrapped is None:
        marker = Unstored("torch.func: a wrapper tensor of an unknown kind")
        if site not in warned:
            warned.add(site)
            warn(
                f"vartrace: {site} is a torch.func wrapper tensor of an unknown kind; "
                f"recording the marker {marker!r} instead",
                RuntimeWarning,
                stacklevel=3,
            )
        return marker
    tensor, mapped = unwrapped
    if mapped and site not in warned:
        warned.add(site)
        warn(
            f"vartrace: {site} is computed under torch.func.vmap; each record holds every "
            f"mapped call, the {mapped} mapped dimension(s) first: shape "
            f"{tuple(tensor.shape)} for the per-call shape {tuple(value.shape)}",
            stacklevel=3,
        )
    return tensor


def _unwrapped(value: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The detached plain tensor behind `value`'s wrappers and how many `vmap` levels
    it maps, or `None` for a wrapper of an unknown kind."""
    dims: list[int] = []
    tensor = value
    while is_transformed(tensor):
        if _functorch.is_batchedtensor(tensor):
            dims.append(_functorch.maybe_get_bdim(tensor))
            tensor = _functorch.get_unwrapped(tensor)
        elif _functorch.is_gradtrackingtensor(tensor):
            tensor = _functorch.get_unwrapped(tensor)
        elif _functorch.is_functionaltensor(tensor):
            torch._sync(tensor)
            tensor = torch._from_functional_tensor(tensor)
        else:
            return None
    with torch._C._DisableFuncTorch():
        tensor = tensor.detach()
        for placed, dim in enumerate(reversed(dims)):
            # Each level's dimension counts among the dimensions the levels outside it left.
            tensor = tensor.movedim(dim + placed, placed)
    return tensor, len(dims)


def is_distributed(value: torch.Tensor) -> bool:
    """Whether `value` is a `torch.distributed.tensor.DTensor` or an
    `AsyncCollectiveTensor` (a functional collective's result, awaited at its first
    use).  Neither exists before its module is imported: nothing is imported here."""
    kind = type(value)
    if kind is torch.Tensor:  # the common case: one comparison a record
        return False
    return issubclass(kind, _distributed_kinds())


def _distributed_kinds() -> tuple[type, ...]:
    """The classes of `is_distributed` imported so far (kept once both are)."""
    global _DISTRIBUTED
    if len(_DISTRIBUTED) == 2:
        return _DISTRIBUTED
    found = (
        getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None),
        getattr(
            sys.modules.get("torch.distributed._functional_collectives"),
            "AsyncCollectiveTensor",
            None,
        ),
    )
    kinds = tuple(kind for kind in found if kind is not None)
    if len(kinds) == 2:
        _DISTRIBUTED = kinds
    return kinds


def local_shard(value: Any, site: str) -> torch.Tensor:
    """This rank's part of the distributed tensor `value`, detached: a DTensor's local
    shard, with a warning once per site naming its placement, or an
    `AsyncCollectiveTensor`'s result (awaited, as the first op of whoever receives it
    would: on an accelerator the stream waits, not the host).

    A DTensor (`parallelize_module`, FSDP2's sharded parameters) has no storage of
    its own: reading its bytes would crash the process, and copying it whole would
    run collectives in the step.  Each rank records its local shard (tagged with
    its rank as every record); the placement on the device mesh tells how the
    ranks' records make the full tensor: `Shard(d)` concatenates them along `d`
    in mesh order, `Replicate()` holds the whole tensor on every rank, `Partial()`
    sums them.

    Example:
        ```python
        local_shard(colwise_weight, "a.weight").shape  # (8 // world, 4)
        ```
    """
    if not hasattr(value, "to_local"):  # an AsyncCollectiveTensor
        return _local_part(value).detach()
    shard = _local_part(value.detach())
    if site not in _sharded_warned:
        _sharded_warned.add(site)
        placements = ", ".join(map(repr, value.placements))
        warn(
            f"vartrace: {site} is a DTensor of shape {tuple(value.shape)} placed "
            f"({placements}) on a device mesh of shape {tuple(value.device_mesh.shape)}; "
            f"each rank records its local shard, of shape {tuple(shard.shape)} here "
            "(vartrace.assemble joins the ranks' records)",
            stacklevel=3,
        )
    return shard


def _local_part(value: Any) -> torch.Tensor:
    """A DTensor's local shard, an `AsyncCollectiveTensor`'s awaited result."""
    part = value.to_local() if hasattr(value, "to_local") else value.trigger_wait()
    return cast(torch.Tensor, part)


_FLOAT = struct.Struct("<d")
_COMPLEX = struct.Struct("<dd")


def dense_clone(value: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `value`, a plain dense CPU tensor that is no `torch.func`
    wrapper: `.data` detaches it for less than `detach()` (torch.func refuses it), and the
    clone of a contiguous tensor is contiguous without a memory format to parse."""
    plain = value.data
    if plain.is_contiguous():
        return plain.clone()
    return plain.clone(memory_format=torch.contiguous_format)


def copy_leaf(value: Any, device: torch.device, site: str = "") -> Any:
    """A detached, independent copy of `value`; tensors land on `device`.

    A value that cannot be copied gives a [`vartrace.Unstored`][vartrace.Unstored] marker
    instead, never an exception in the step, with one warning per site (the
    first time the process meets it): an object that refuses `deepcopy`, a
    tensor subclass that wraps other tensors and has no storage of its own (a
    `DTensor` gives its local shard instead: `local_shard`), a
    tensor whose dtype torch cannot copy (the sub-byte `torch.uint4`,
    `torch.int1` ... `torch.int7`, `torch.quint4x2`), one the device
    has no memory for.  An expanded view
    (`expand`, `broadcast_to`: a dimension of stride 0) is copied whole,
    as the value it stands for, up to 1 GiB; above that the record is a
    marker giving both sizes (`"4 bytes expanded to 512 GiB"`): its copy
    would need that memory, and the file that space.

    Example:
        ```python
        record = copy_leaf(hidden, torch.device("cpu"))
        ```
    """
    if isinstance(value, torch.Tensor):
        try:  # every operation on the value: a subclass may implement only a few ops
            if (
                # The common case, a plain dense CPU tensor below MAP_FROM for the CPU.
                type(value) is _TENSOR
                and value.is_cpu
                and device == _CPU
                and value.layout is _STRIDED
                and not value.is_nested
                and value.nbytes < MAP_FROM
                and not is_transformed(value)
            ):
                return dense_clone(value)
            detached = value.detach()
            if type(detached) is not torch.Tensor:
                if is_distributed(detached):
                    detached = local_shard(detached, site)
                elif is_traceable_wrapper_subclass(detached) and not detached.is_nested:
                    return _uncopyable(site, _tensor_text(detached), _NO_STORAGE)
            # nbytes is refused for sparse and nested tensors.  Below MAP_FROM (8 MiB) a
            # copy neither needs its own mapping nor can be an expanded view too large.
            if detached.layout is torch.strided and not detached.is_nested:
                if detached.nbytes >= MAP_FROM:
                    map_large_blocks()  # no glibc heap holes from records this large
                    refused = refused_copy(detached, site)
                    if refused is not None:
                        return refused
                if detached.is_cpu and device == _CPU:
                    return detached.clone(memory_format=torch.contiguous_format)  # the common case
            if detached.is_meta:
                return detached.clone()  # no data to move: shape and dtype are the record
            if detached.layout != torch.strided:  # sparse: copied as it is, in its own layout
                return detached.clone() if detached.device == device else detached.to(device)
            if detached.device == device:
                return detached.clone(memory_format=torch.contiguous_format)
            return detached.to(device, copy=True, memory_format=torch.contiguous_format)
        except Exception as error:  # an uncopyable dtype, no memory left: never the step's error
            return failed_copy(value, site, error)
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return value.copy()
    try:
        return copy.deepcopy(value)
    except Exception as error:  # never keep the live object: it may hold a graph
        return _uncopyable(site, type(value).__qualname__, _first_line(error))


def refused_copy(tensor: torch.Tensor, site: str) -> Unstored | None:
    """The marker (warned once per site) for an expanded view too large to copy, else
    `None`: the check `copy_leaf` makes, for copies made elsewhere (a device clone)."""
    if _expanded_too_far(tensor):
        return _uncopyable(site, _tensor_text(tensor), _overexpanded(tensor))
    return None


def failed_copy(tensor: torch.Tensor, site: str, error: BaseException) -> Unstored:
    """The marker (warned once per site) for `tensor` whose copy raised `error`."""
    return _uncopyable(site, _tensor_text(tensor), _first_line(error))


def failed_reduction(value: Any, site: str, reducer: str, error: BaseException) -> Unstored:
    """The marker (warned once per site) for `value` that vartrace's own pre-save
    `reducer` (`"vartrace.stats()"`) could not reduce: it raised `error`."""
    what = _tensor_text(value) if isinstance(value, torch.Tensor) else type(value).__qualname__
    return _uncopyable(site, what, f"{reducer}: {_first_line(error)}", verb="reduce")


def _uncopyable(site: str, what: str, why: str, verb: str = "copy") -> Unstored:
    """The marker recorded for `what` at `site` that cannot be copied (or reduced:
    `verb`) because of `why`; warns the first time a site gives one."""
    marker = Unstored(f"{what}: cannot {verb} it ({why})")
    if site not in _uncopyable_warned:
        _uncopyable_warned.add(site)
        warn(
            f"vartrace: site {site!r}: cannot {verb} a {what} ({why}); "
            f"recording the marker {marker!r} instead of the live value",
            RuntimeWarning,
            stacklevel=3,
        )
    return marker


def _tensor_text(tensor: torch.Tensor) -> str:
    """A tensor as a marker names it: `"torch.uint4 tensor of shape (2, 3)"`, a subclass
    by its class (`"torch.float32 TwoTensor of shape (3,)"`); what it cannot tell (a
    nested tensor's shape, anything a subclass refuses) is left out."""
    dtype = _told(lambda: str(tensor.dtype), type(tensor).__qualname__)
    kind = _told(lambda: _kind(tensor), "tensor")
    shape = _told(lambda: f" of shape {tuple(int(size) for size in tensor.shape)}", "")
    return f"{dtype} {kind}{shape}"


def _kind(tensor: torch.Tensor) -> str:
    if tensor.is_nested:
        return "nested tensor"
    return "tensor" if type(tensor) is torch.Tensor else type(tensor).__name__


def _told(tell: Callable[[], str], otherwise: str) -> str:
    """What `tell()` says of a value, or `otherwise` if it raises."""
    try:
        return tell()
    except Exception:
        return otherwise


def _first_line(error: BaseException) -> str:
    """An error's first line: torch appends C++ stack traces to some messages."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _expanded_too_far(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an expanded view whose copy would exceed 1 GiB."""
    return (
        tensor.layout is torch.strided
        and not tensor.is_nested
        and tensor.nbytes > _MAX_EXPANDED_BYTES
        and _reach(tensor) < tensor.nbytes
    )


def _reach(tensor: torch.Tensor) -> int:
    """The bytes a strided tensor's elements span in memory: fewer than its copy holds
    when the view is expanded (a dimension of stride 0, or overlapping strides)."""
    steps = zip(tensor.shape, tensor.stride(), strict=True)
    return (1 + sum((n - 1) * abs(step) for n, step in steps)) * tensor.element_size()


def _overexpanded(tensor: torch.Tensor) -> str:
    """Why an expanded view is not copied: `"4 bytes expanded to 512 GiB; ..."`."""
    return (
        f"{size_text(_reach(tensor))} expanded to {size_text(tensor.nbytes)}; an expanded "
        f"view is copied up to {size_text(_MAX_EXPANDED_BYTES)}"
    )


#: Dtypes whose equal values may differ in bytes, or equal bytes differ in value: a complex
#: tensor may carry a lazy conjugation, a quantized one its scale.
NOT_BYTEWISE = frozenset(
    getattr(torch, name)
    for name in (
        "bcomplex32",
        "complex32",
        "complex64",
        "complex128",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "quint2x4",
    )
    if hasattr(torch, name)
)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()  # sparse: equal values, whatever entries are stored
    tensor = tensor.resolve_conj().resolve_neg()  # lazy views: compare what they stand for
    if tensor.dtype == torch.bool or tensor.is_quantized:
        return tensor
    if tensor.dtype == torch.complex128:
        tensor = tensor.view(torch.float64)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.view(_INT_OF_SIZE[tensor.element_size()])
    return tensor


def same(a: Any, b: Any) -> bool:
    """Whether two recorded copies are identical, bit for bit."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is _TENSOR or isinstance(a, torch.Tensor):
        if a.is_nested or b.is_nested:  # components may differ in shape: no single one
            return _same_nested(a, b)
        dtype = a.dtype
        if dtype is not b.dtype or a.shape != b.shape:  # dtypes are singletons
            return False
        if (
            # The common case, two dense CPU records: memcmp stops at the first differing
            # byte, where torch.equal on integer views costs two views and a dispatch.  The
            # fewest tensor attribute reads first: each costs about a microsecond in a step.
            # A subclass's data may be no storage at all (a wrapper's data_ptr() is 0).
            kind is _TENSOR
            and a.is_cpu
            and b.is_cpu
            and dtype not in NOT_BYTEWISE
            and a.layout is _STRIDED
            and b.layout is _STRIDED
            and a.is_contiguous()
            and b.is_contiguous()
            and memory.memcmp is not None
        ):
            size = a.nbytes
            return size == 0 or memory.memcmp(a.data_ptr(), b.data_ptr(), size) == 0
        device = a.device
        if device != b.device:
            return False
        if device.type == "meta":
            return True  # no data: shape and dtype are all there is
        try:
            return torch.equal(_bits(a), _bits(b))
        except Exception:  # no kernel, an op a tensor subclass lacks: not known equal, kept
            return False
    if isinstance(a, (np.ndarray, np.generic)) and not a.dtype.hasobject:
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if kind is float:
        return _FLOAT.pack(a) == _FLOAT.pack(b)
    if kind is complex:
        return _COMPLEX.pack(a.real, a.imag) == _COMPLEX.pack(b.real, b.imag)
    try:
        return bool(a == b)
    except Exception:
        return False


def _same_nested(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two nested tensors of one layout hold the same components, bit for bit."""
    if not (a.is_nested and b.is_nested) or a.layout != b.layout or a.dtype is not b.dtype:
        return False
    parts, others = a.unbind(), b.unbind()
    return len(parts) == len(others) and all(
        same(part, other) for part, other in zip(parts, others, strict=True)
    )


class _Identity(NamedTuple):
    """What `snapshot` keeps of an opaque object: its identity and version counter."""

    id: int
    version: Any


def _identity(value: Any) -> _Identity:
    return _Identity(id(value), getattr(value, "_version", None))


class _Uncopied(NamedTuple):
    """What `snapshot` keeps of a CPU tensor it cannot clone: a weak reference (a new
    tensor may take the id of a dead one) and the version counter."""

    tensor: weakref.ReferenceType[torch.Tensor]
    version: int


def snapshot(value: Any) -> Any:
    """A copy of `value`'s content for `unchanged`: what `@every` compares with.

    CPU tensors are detached and cloned, numpy arrays copied, lists, tuples and
    dicts copied element by element; of other objects (a module, a custom
    class) only the identity is kept, as copying them on every line would cost
    too much.  Of a tensor on an accelerator too only the identity and version
    counter are kept: comparing its contents would wait for the device at
    every line.  Such a value is a candidate whenever it is rebound or written
    in place by an operation that bumps its version; the record path's own
    change detection then drops candidates equal to the last record.  A write
    that bumps no version counter (through `.data`) makes no candidate: the
    value it leaves is seen only once the name is rebound or written in place
    again.  Example:

    ```python
    old = snapshot(hidden)
    hidden.data.add_(1)
    assert not unchanged(old, hidden)
    ```
    """
    if isinstance(value, torch.Tensor):
        if is_distributed(value):
            value = _local_part(value)  # what a record of it holds: never a collective
        if is_transformed(value):
            return _transformed_snapshot(value)
        if value.is_cpu or value.is_meta:
            return _tensor_snapshot(value)
        return _identity(value)
    if type(value) in (list, tuple):
        return type(value)(snapshot(item) for item in value)
    if type(value) is dict:
        return {key: snapshot(item) for key, item in value.items()}
    if type(value) in _IMMUTABLE or isinstance(value, np.generic):
        return value
    if isinstance(value, np.ndarray):
        return copy.deepcopy(value) if value.dtype.hasobject else value.copy()
    return _identity(value)


def _tensor_snapshot(tensor: torch.Tensor) -> Any:
    """A detached clone of a CPU or meta tensor, or its identity where `copy_leaf`
    records no copy of it either (a sub-byte dtype, an expanded view above 1 GiB)."""
    try:
        if _expanded_too_far(tensor):
            return _Uncopied(weakref.ref(tensor), tensor._version)
        return tensor.detach().clone()
    except Exception:  # no copy kernel for its dtype, no memory left: compared by identity
        return _Uncopied(weakref.ref(tensor), tensor._version)


def _transformed_snapshot(value: torch.Tensor) -> Any:
    """`snapshot` of a `torch.func` wrapper: a plain copy of what it stands for."""
    unwrapped = _unwrapped(value)
    if unwrapped is None or not (unwrapped[0].is_cpu or unwrapped[0].is_meta):
        return _identity(value)
    with torch._C._DisableFuncTorch():
        return unwrapped[0].clone()


def unchanged(old: Any, value: Any) -> bool:
    """Whether `value` still holds, bit for bit, what `snapshot` copied into `old`."""
    if isinstance(old, _Identity):
        return old == _identity(value)
    if isinstance(old, _Uncopied):
        alive = old.tensor()  # None once the tensor died
        return alive is value and alive is not None and alive._version == old.version
    if isinstance(value, torch.Tensor):
        if not isinstance(old, torch.Tensor):
            return False
        try:
            if is_distributed(value):
                value = _local_part(value)
            if is_transformed(value):
                unwrapped = _unwrapped(value)
                with torch._C._DisableFuncTorch():
                    return unwrapped is not None and same(old, unwrapped[0])
            return same(old, value.detach())
        except Exception:  # an op a tensor subclass lacks: a candidate, its copy guarded
            return False
    if type(value) in (list, tuple):
        return (
            type(old) is type(value)
            and len(old) == len(value)
            and all(unchanged(a, b) for a, b in zip(old, value, strict=True))
        )
    if type(value) is dict:
        return (
            type(old) is dict
            and list(old) == list(value)
            and all(unchanged(old[key], item) for key, item in value.items())
        )
    return same(old, value)
