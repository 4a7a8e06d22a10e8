"""One rank of ``tests/gathers/test_node_gather.py``'s runs, started by ``torchrun``.

Usage: ``torchrun ... tests/_node_worker.py OUT_DIR GATHER`` (``GATHER``: ``node`` or
``true``).  The rank joins a gloo process group, counts every point-to-point
message it sends or receives (a wrapper around ``torch.distributed``'s
``batch_isend_irecv``, ``send`` and ``recv``, installed here, nothing in vartrace
patched), traces a small model whose values depend on the rank and the iteration
(ranks run different numbers of iterations; one site's records are large enough to
travel as messages of their own) and writes ``OUT_DIR/run.h5`` through the saver
(``run.node<k>.h5`` with ``gather="node"``).  It then writes what it counted, its
node and the environment torchrun gave it to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import vartrace

_MESSAGES: list[dict[str, Any]] = []  # every point-to-point message of this rank


def _counted_batch(batch: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(batch)
    def counted(ops: list[dist.P2POp]) -> Any:
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            _MESSAGES.append({"kind": kind, "peer": op.peer, "bytes": op.tensor.nbytes})
        return batch(ops)

    return counted


def _counted(kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
        _MESSAGES.append({"kind": kind, "peer": peer, "bytes": tensor.nbytes})
        return call(tensor, *args, **kwargs)

    return counted


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        h = self.layer(x).relu()
        wide = big * 2
        return h.sum() + wide.mean()


def main(out: Path, gather: bool | str) -> None:
    torch.set_num_threads(1)
    dist.batch_isend_irecv = _counted_batch(dist.batch_isend_irecv)
    dist.send = _counted("send", dist.send)
    dist.recv = _counted("recv", dist.recv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    saver = vartrace.H5PYSaverCallback(out / "run.h5", metadata=False)
    steps = 5 if rank % 2 else 3  # the ranks of a node run different numbers of iterations
    with vartrace.ModelTracer(
        model,
        ["forward.x", "forward.h", "forward.wide", "layer"],
        post_gather_callbacks=[saver],
        gathering_interval=2,
        gather=gather,
    ):
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(3 + rank, 8, generator=gen)  # ragged across ranks
            big = torch.full((300, 256), float(rank * 10 + step))  # 300 KiB: a direct message
            model(x, big)
    saver.close()
    node = int(os.environ["GROUP_RANK"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "node": node,
                "node_ranks": list(range(node * local, (node + 1) * local)),
                "local_rank": int(os.environ["LOCAL_RANK"]),
                "messages": _MESSAGES,
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), {"node": "node", "true": True}[sys.argv[2]])
