"""Collectives with a root (broadcast, reduce, gather, send and receive), the root named by its
rank in the group, on every supported torch.

torch >= 2.6 takes such a rank as ``group_src`` / ``group_dst``; older releases take only the
root's global rank (``src`` / ``dst``), which these functions look up once per call. Everything in
shardopt that has a root goes through here, so the engine speaks group ranks only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from shardopt.functional.engine._failure import completed

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group

__all__ = [
    "ProcessGroup",
    "broadcast_from",
    "gather_object_to",
    "gather_to",
    "irecv_from",
    "isend_to",
    "reduce_to",
]

_ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "gather_object": "dst"}
_ROOTED |= {"isend": "dst", "irecv": "src"}
# The functions of this torch that name their root by group rank (torch >= 2.6: all of them).
GROUP_RANKS = frozenset(
    name
    for name, kind in _ROOTED.items()
    if f"group_{kind}" in inspect.signature(getattr(dist, name)).parameters
)
# Each function's root keyword in this torch: "group_src" where it takes a group rank, else "src".
_KEYWORD = {n: f"group_{k}" if n in GROUP_RANKS else k for n, k in _ROOTED.items()}


def _global(group: ProcessGroup, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (the default group's ranks are global)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _root(name: str, group: ProcessGroup, rank: int) -> dict[str, Any]:
    """The root keyword of ``dist.<name>``: ``group_src=rank`` or ``src=<its global rank>``."""
    return {_KEYWORD[name]: rank if name in GROUP_RANKS else _global(group, rank)}


def broadcast_from(
    tensor: torch.Tensor, src: int, *, group: ProcessGroup = None, async_op: bool = False
) -> Any:
    """``dist.broadcast`` from rank ``src`` of ``group``."""
    work = dist.broadcast(tensor, group=group, async_op=True, **_root("broadcast", group, src))
    return work if async_op else completed(work)


def reduce_to(
    tensor: torch.Tensor,
    dst: int,
    *,
    op: Any = dist.ReduceOp.SUM,
    group: ProcessGroup = None,
    async_op: bool = False,
) -> Any:
    """``dist.reduce`` into rank ``dst`` of ``group``."""
    work = dist.reduce(tensor, op=op, group=group, async_op=True, **_root("reduce", group, dst))
    return work if async_op else completed(work)


def gather_to(
    tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, *, group: ProcessGroup
) -> Any:
    """``dist.gather`` into ``gather_list`` on rank ``dst`` of ``group`` (None elsewhere)."""
    root = _root("gather", group, dst)
    return completed(dist.gather(tensor, gather_list, group=group, async_op=True, **root))


def gather_object_to(obj: Any, out: list[Any] | None, dst: int, *, group: ProcessGroup) -> None:
    """``dist.gather_object`` into ``out`` on rank ``dst`` of ``group`` (None elsewhere)."""
    dist.gather_object(obj, out, group=group, **_root("gather_object", group, dst))


def isend_to(tensor: torch.Tensor, dst: int, *, group: ProcessGroup) -> Any:
    """``dist.isend`` to rank ``dst`` of ``group``."""
    return dist.isend(tensor, group=group, **_root("isend", group, dst))


def irecv_from(tensor: torch.Tensor, src: int, *, group: ProcessGroup) -> Any:
    """``dist.irecv`` from rank ``src`` of ``group``."""
    return dist.irecv(tensor, group=group, **_root("irecv", group, src))
