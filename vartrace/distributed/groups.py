"""The process group a tracer gathers within: the one it is given, or its model's.

A model may live on some ranks only (a pipeline stage, one of several
data-parallel replicas on `new_group`s): gathers on every rank would pair its
ranks' gathers with collectives of ranks that never trace, and one saver would
receive every group's records.  `gather_group` names the group instead: the
`group=` a user passes to `ModelTracer`, else the `process_group` of the
`DistributedDataParallel` wrapper it traces, else `None` (every rank).  The
tracer then gathers within the group, to the group's first rank, which runs the
post-gather callbacks (its saver writes the group's file).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["check_member", "gather_group", "group_ranks"]


def gather_group(model: nn.Module, group: Any) -> Any:
    """The group the gathers of a tracer of `model` use: `group` when given, else the
    `process_group` of a `DistributedDataParallel` `model` when it is not the default
    group, else `None` (every rank).

    Example:
        ```python
        ddp = DDP(model, process_group=dist.new_group([0, 1]))
        gather_group(ddp, None)  # the group of ranks 0 and 1
        ```

    Raises:
        TypeError: when `group` is neither `None` nor a `torch.distributed` process group.
    """
    if group is not None:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(
                "group must be a torch.distributed process group (dist.new_group(...)) "
                f"or None, not {type(group).__name__}"
            )
        return None if group is dist.group.WORLD else group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        found = getattr(model, "process_group", None)
        if isinstance(found, dist.ProcessGroup) and found is not dist.group.WORLD:
            return found
    return None


def group_ranks(group: Any) -> list[int]:
    """The global ranks of `group`, in the group's order (its first gathers).

    Example:
        ```python
        group_ranks(dist.new_group([2, 3]))  # [2, 3]
        ```
    """
    return dist.get_process_group_ranks(group)


def check_member(group: Any) -> None:
    """Raise `ValueError` unless this process is a rank of `group`.

    Example:
        ```python
        check_member(dist.new_group([0, 1]))  # ValueError on ranks 2 and 3
        ```
    """
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"ModelTracer(group=...): rank {dist.get_rank()} is not in the group of ranks "
            f"{group_ranks(group)}; trace the model only on the ranks of its group"
        )
