"""Records held back from the gathers, kept in a file of this rank's until they can travel.

While a gather would collide with the training's own communication (see
`vartrace.distributed.collisions`), the tracer cannot gather; holding its records in
memory until it can would grow without bound over a long pipeline run or a long
`Join`.  Each held-back chunk is instead packed as a gather would send it
(`vartrace.distributed.wire`: the records' exact bytes, their tags, the pickled
non-tensor leaves) and appended to an unnamed temporary file of this process (in
`tempfile`'s directory: ``TMPDIR``), which the system deletes when it is closed or
the process ends.  Memory then holds one gathering interval's records at most.
The final gathers read the chunks back one at a time, in the order they were held,
and send each as a gather of its own (`final_gathers(held=...)`).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator

import torch

from vartrace.distributed.wire import Decoder, merge, pack, packed_buffer
from vartrace.trace import Trace

__all__ = ["Spill"]


class Spill:
    """Chunks written to a temporary file, read back in order, one at a time.

    Reads and writes name their offsets (`os.pwrite`, `os.preadv`), so a process forked
    from this one shares the file without moving this one's place in it.

    Example:
        ```python
        spill = Spill()
        spill.put(chunk)  # packed and written; the chunk's records can be freed
        for held in spill.chunks():  # the same records, bit for bit
            ...
        ```
    """

    def __init__(self) -> None:
        self._fd = -1  # the file's descriptor, -1 before the first chunk
        self._end = 0
        self._held: list[tuple[int, int, list[int]]] = []  # (offset, buffer bytes, large ones)
        self._closer: weakref.finalize | None = None  # closes the file with this object

    def put(self, chunk: dict[str, Trace]) -> None:
        """Append `chunk` to the file.

        Raises:
            Exception: whatever packing raised (an opaque record that cannot be
                pickled) or writing did (`OSError`: a full disk); the file is as before.
        """
        packed = pack(chunk, [])
        buffer = packed_buffer(packed)
        if self._fd < 0:
            self._fd, path = tempfile.mkstemp(prefix="vartrace-held-")
            os.unlink(path)  # the system frees it when the descriptor closes
            self._closer = weakref.finalize(self, os.close, self._fd)
        fd, offset = self._fd, self._end
        try:
            for flat in [buffer, *packed.direct]:
                offset += _write(fd, flat, offset)
        except BaseException:
            os.ftruncate(fd, self._end)
            raise
        self._held.append((self._end, buffer.numel(), [flat.numel() for flat in packed.direct]))
        self._end = offset

    def chunks(self) -> Iterator[dict[str, Trace]]:
        """The held chunks, oldest first, each read when asked for; the file is closed
        once the last was read."""
        while self._held:
            offset, size, large = self._held[0]
            fd = self._fd
            buffer = torch.empty(size, dtype=torch.uint8)
            _read(fd, buffer, offset)
            decoder = Decoder(buffer)
            parts = decoder.parts()
            offset += size
            for target, nbytes in zip(decoder.targets, large, strict=True):
                _read(fd, target, offset)
                offset += nbytes
            self._held.pop(0)
            yield merge([parts])
        self.close()

    def close(self) -> None:
        """Close (and so delete) the file, and forget what it held."""
        if self._closer is not None:
            self._closer()
        self._fd, self._end, self._held, self._closer = -1, 0, [], None


def _write(fd: int, flat: torch.Tensor, offset: int) -> int:
    """Write the `uint8` tensor `flat` at `offset`; its size."""
    view = flat.detach().cpu().contiguous().numpy().data
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return len(view)


def _read(fd: int, flat: torch.Tensor, offset: int) -> None:
    """Fill the `uint8` tensor `flat` from the file at `offset`."""
    view = flat.numpy().data
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"vartrace: the file of held records ended at byte {offset + done}")
        done += got
