"""The wire format of a gather: a rank's chunk packed into one flat `uint8` buffer (a pickled
header, the tags, the bytes of small records) plus the large records as messages of their
own, and rank 0's decoding of what each rank sent back into [`Trace`][vartrace.Trace]s.

How the pieces travel is `vartrace.distributed.gathers`'s job; this module only packs and
unpacks.  Example:

```python
packed = pack(chunk, facts)          # on every rank
buffer = packed_buffer(packed)       # the bytes sent to rank 0
sites = merge(parts_by_rank)         # on rank 0, once every rank's parts are decoded
```
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vartrace.trace import Trace, join_traces

#: What a rank knows about a site beside its records: `(kind, site, fact)`.
Fact = tuple[str, str, Any]

_ALIGN = 64
_DIRECT_BYTES = 1 << 18

_TENSOR = "t"
_NUMPY = "n"
_OBJECT = "o"


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class Packed:
    """One rank's chunk: a header, small byte views laid out after it, large ones apart."""

    header: bytes
    data_start: int
    pieces: list[tuple[int, torch.Tensor]]
    direct: list[torch.Tensor]
    nbytes: int


@dataclass
class Part:
    """One rank's records of one site, decoded (or taken as-is on rank 0)."""

    stacked: bool
    values: Any
    iterations: Any
    ranks: Any
    order: Any
    shapes: list[tuple[int, ...]] | None

    def __len__(self) -> int:
        return len(self.iterations)


class _Layout:
    """Decides where each byte view travels.

    Views smaller than `_DIRECT_BYTES` get an aligned offset (>= 0) in the
    packed buffer; larger ones travel as messages of their own, straight from
    their storage, and get the location `-1 - index`.
    """

    def __init__(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.direct: list[torch.Tensor] = []
        self.size = 0

    def add(self, flat: torch.Tensor, *, direct: bool = True) -> int:
        if direct and flat.numel() >= _DIRECT_BYTES:
            self.direct.append(flat)
            return -len(self.direct)
        offset = self.size
        self.pieces.append((offset, flat))
        self.size = _align(offset + flat.numel())
        return offset


def _tensor_bytes(value: torch.Tensor) -> torch.Tensor | None:
    """`value`'s elements as a flat `uint8` tensor, or None when it has no plain storage."""
    if value.layout != torch.strided or value.is_quantized or value.is_nested or value.is_meta:
        return None
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    flat = value.detach().resolve_conj().resolve_neg().reshape(-1)
    try:
        return flat.view(torch.uint8)
    except RuntimeError:
        return None


def _numpy_bytes(value: np.ndarray) -> torch.Tensor | None:
    """`value`'s elements as a flat `uint8` tensor, or None for object/zero-size dtypes."""
    if value.dtype.hasobject or value.dtype.itemsize == 0:
        return None
    flat = np.ascontiguousarray(value).reshape(-1)
    if not flat.flags.writeable:
        flat = flat.copy()
    return torch.from_numpy(flat.view(np.uint8))


def _encode_record(value: Any, layout: _Layout) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        flat = _tensor_bytes(value)
        if flat is not None:
            return (_TENSOR, value.dtype, tuple(value.shape), layout.add(flat))
    elif isinstance(value, np.ndarray):
        flat = _numpy_bytes(value)
        if flat is not None:
            return (_NUMPY, value.dtype, value.shape, layout.add(flat))
    return (_OBJECT, value)


def _tags_tensor(trace: Trace) -> torch.Tensor:
    """The `iterations`, `ranks` and `order` tags as one `(3, n)` int64 tensor."""
    rows = []
    for tags in (trace.iterations, trace.ranks, trace.order):
        if isinstance(tags, torch.Tensor):
            rows.append(tags.detach().to("cpu", torch.int64).reshape(-1))
        else:
            rows.append(torch.as_tensor(np.asarray(tags, dtype=np.int64).reshape(-1)))
    return torch.stack(rows)


def pack(chunk: dict[str, Trace], facts: list[Fact]) -> Packed:
    layout = _Layout()
    sites = []
    for name, trace in chunk.items():
        trace.check_lengths()
        tags = _tags_tensor(trace)
        tag_offset = layout.add(tags.reshape(-1).view(torch.uint8), direct=False)
        values = trace.values
        stacked = _tensor_bytes(values) if isinstance(values, torch.Tensor) else None
        if stacked is not None:
            shapes = None if trace.shapes is None else [tuple(s) for s in trace.shapes]
            payload: Any = (values.dtype, tuple(values.shape), layout.add(stacked), shapes)
        else:
            payload = [_encode_record(value, layout) for value in values]
        sites.append((name, stacked is not None, len(trace), tag_offset, payload))
    header = pickle.dumps((sites, facts), protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(8 * (2 + len(layout.direct)) + len(header))
    return Packed(header, data_start, layout.pieces, layout.direct, data_start + layout.size)


def packed_buffer(packed: Packed) -> torch.Tensor:
    """The packed buffer: the prefix, the header, then the small byte views.

    The prefix (int64s) holds the header's length, the number of separate
    messages and their sizes, so rank 0 can receive them even if the header
    itself fails to unpickle there.
    """
    sizes = [flat.numel() for flat in packed.direct]
    prefix = torch.tensor([len(packed.header), len(sizes), *sizes], dtype=torch.int64)
    header = torch.frombuffer(bytearray(packed.header), dtype=torch.uint8)
    head = torch.cat([prefix.view(torch.uint8), header])
    out = torch.zeros(packed.nbytes, dtype=torch.uint8)
    out[: head.numel()].copy_(head)
    for offset, flat in packed.pieces:
        start = packed.data_start + offset
        out[start : start + flat.numel()].copy_(flat)
    return out


class Decoder:
    """Rebuilds one rank's records from its packed buffer.

    Records that travel as their own messages are allocated here with their
    final dtype and shape; `targets` lists their bytes, in message order,
    for the receiving side (`gathers`) to fill in place (no copy after the transfer).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        header_len, count = buffer[:16].view(torch.int64).tolist()
        self.sizes = buffer[16 : 16 + 8 * count].view(torch.int64).tolist()
        self.header = buffer[16 + 8 * count : 16 + 8 * count + header_len]
        self.data = buffer[_align(16 + 8 * count + header_len) :]
        self.direct: dict[int, torch.Tensor] = {}
        self.facts: list[Fact] = []

    @property
    def targets(self) -> list[torch.Tensor]:
        """Where each separate message lands (scratch space for any not decoded)."""
        return [
            self.direct.get(i, torch.empty(size, dtype=torch.uint8))
            for i, size in enumerate(self.sizes)
        ]

    def _tensor(self, location: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if location >= 0:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            raw = self.data[location : location + nbytes]
            return raw.view(dtype).reshape(shape).clone()
        value = torch.empty(shape, dtype=dtype)
        self.direct[-1 - location] = value.reshape(-1).view(torch.uint8)
        return value

    def _record(self, entry: tuple[Any, ...]) -> Any:
        kind = entry[0]
        if kind == _TENSOR:
            _, dtype, shape, location = entry
            return self._tensor(location, dtype, shape)
        if kind == _NUMPY:
            _, dtype, shape, location = entry
            raw = self._tensor(location, torch.uint8, (int(np.prod(shape)) * dtype.itemsize,))
            return raw.numpy().view(dtype).reshape(shape)
        return entry[1]

    def parts(self) -> dict[str, Part]:
        parts = {}
        entries, self.facts = pickle.loads(self.header.numpy().tobytes())
        for name, stacked, count, tag_offset, payload in entries:
            raw = self.data[tag_offset : tag_offset + 3 * count * 8]
            tags = raw.view(torch.int64).reshape(3, count).clone()
            if stacked:
                dtype, shape, location, shapes = payload
                values = self._tensor(location, dtype, shape)
                parts[name] = Part(True, values, tags[0], tags[1], tags[2], shapes)
            else:
                records = [self._record(entry) for entry in payload]
                iterations, ranks, order = tags.tolist()
                parts[name] = Part(False, records, iterations, ranks, order, None)
        return parts


def parts_of_chunk(chunk: dict[str, Trace]) -> dict[str, Part]:
    """Rank 0's own chunk in the merge's terms, without copying any value."""
    parts = {}
    for name, trace in chunk.items():
        trace.check_lengths()
        stacked = isinstance(trace.values, torch.Tensor)
        if stacked:
            tags = _tags_tensor(trace)
            parts[name] = Part(True, trace.values, tags[0], tags[1], tags[2], trace.shapes)
        else:
            parts[name] = Part(
                False,
                list(trace.values),
                _int_list(trace.iterations),
                _int_list(trace.ranks),
                _int_list(trace.order),
                None,
            )
    return parts


def _int_list(tags: Any) -> list[int]:
    return tags.tolist() if isinstance(tags, torch.Tensor) else [int(t) for t in tags]


def merge(parts_by_rank: list[dict[str, Part]]) -> dict[str, Trace]:
    names: dict[str, None] = {}
    for parts in parts_by_rank:
        names.update(dict.fromkeys(parts))
    return {
        name: _merge_site([parts[name] for parts in parts_by_rank if name in parts])
        for name in names
    }


def _merge_site(parts: list[Part]) -> Trace:
    filled = [part for part in parts if len(part)]
    if not filled:
        first = parts[0]
        if first.stacked:
            empty = torch.zeros(0, dtype=torch.int64)
            return Trace(first.values, empty, empty.clone(), empty.clone(), first.shapes)
        return Trace()
    return join_traces([Trace(p.values, p.iterations, p.ranks, p.order, p.shapes) for p in filled])
