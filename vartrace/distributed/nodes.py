"""Which ranks share a node, and one gloo process group per node (`gather="node"`).

With `ModelTracer(gather="node")` the ranks of each node gather to the node's first
rank, which writes the node's shard; no record travels to another node.  The
tracer calls `node_of_this_rank` once, when it starts, on every rank: one
`all_gather_object` of each rank's node key, then `new_subgroups_by_enumeration`
(every rank creates every node's group, in the same order).

A rank's node is the launcher's node rank when every rank has one (torchrun's
`GROUP_RANK`, the `--node-rank` of its agent; `NODE_RANK` as Lightning and
accelerate set it), else its host name.  Nodes are numbered by that node rank, or,
by host, in the order of their lowest global rank.  Within a node, ranks are in
global order: torchrun numbers them so, and the first is the node's `LOCAL_RANK` 0.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from vartrace.distributed.gathers import new_host_subgroups

__all__ = ["Node", "node_of_this_rank", "nodes_of"]

#: The launchers' node rank, first found first.
_NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK")


@dataclass(frozen=True)
class Node:
    """This rank's node: its number, how many nodes there are, its ranks, its group.

    Attributes:
        index: the node's number, 0 to `count - 1` (the shard `run.node<index>.h5`).
        count: the number of nodes of the run.
        ranks: the global ranks on this node, ascending; `ranks[0]` gathers and writes.
        world_size: the number of ranks of the run.
        group: the node's gloo process group (its rank 0 is `ranks[0]`).
    """

    index: int
    count: int
    ranks: tuple[int, ...]
    world_size: int
    group: Any


def _key() -> tuple[int | None, str]:
    """This rank's node rank from the launcher's environment (`None`: not set), and host."""
    for name in _NODE_VARIABLES:
        text = os.environ.get(name, "").strip()
        if text.isdigit():
            return int(text), socket.gethostname()
    return None, socket.gethostname()


def nodes_of(keys: list[tuple[int | None, str]]) -> list[list[int]]:
    """The ranks of each node, nodes in their order, from every rank's `(node rank, host)`.

    By the launcher's node rank when every rank has one, else by host (nodes in the
    order of their lowest rank).  Example:

    ```python
    nodes_of([(0, "a"), (0, "a"), (1, "b"), (1, "b")])  # [[0, 1], [2, 3]]
    nodes_of([(None, "b"), (None, "a"), (None, "b")])   # [[0, 2], [1]]
    ```
    """
    launched = all(number is not None for number, _ in keys)
    members: dict[Any, list[int]] = {}
    for rank, (number, host) in enumerate(keys):
        members.setdefault(number if launched else host, []).append(rank)
    order = sorted(members) if launched else list(members)
    return [members[key] for key in order]


def node_of_this_rank() -> Node:
    """This rank's `Node`, its group made: a collective call, on every rank at the same
    point (the tracer's start), with an initialised process group of several ranks.

    Example:
        ```python
        node = node_of_this_rank()
        merged = gather_chunk(chunk, node.group)  # on each node's first rank: its records
        ```
    """
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, _key())
    nodes = nodes_of(keys)
    group = new_host_subgroups(nodes)
    me = dist.get_rank()
    index = next(i for i, ranks in enumerate(nodes) if me in ranks)
    return Node(index, len(nodes), tuple(nodes[index]), len(keys), group)
