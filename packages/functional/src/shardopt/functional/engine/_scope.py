"""The scope a sharded update runs in: which plan tensor each piece is of, and the collective that
makes core's reduction blocks whole (core's [Note: reductions across shards])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core.blocks import PyTree, Scope, tree_map
from shardopt.functional.engine._collectives import ProcessGroup, all_reduce_op, comm_device

__all__ = ["LocalReducer", "ShardReducer", "meta_tree", "shard_scope"]


class ShardReducer:
    """Sums or maxes per-tensor partials over the ranks of ``group`` (the shard group: replicas of
    a hybrid mesh hold the same pieces and are not counted twice). One all-reduce per call, of
    one float32 per plan tensor plus one for the whole tree; ``calls`` counts them."""

    def __init__(self, group: ProcessGroup, n_tensors: int, device: torch.device | None) -> None:
        self.group, self.n = group, n_tensors
        self.device = comm_device(group, device)
        self.calls = 0

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
    ) -> torch.Tensor:
        """Each leaf's value over its whole tensor (id -1: the whole tree); ``parts`` keeps
        the values of several trees apart (slots ``part * (n + 1) + id``)."""
        if op == "rows":  # already one slot per row of every tensor: summed as it is
            vector = values.to(self.device, torch.float32).clone()
            if dist.get_world_size(self.group) > 1:
                all_reduce_op(vector, dist.ReduceOp.SUM, group=self.group)
            self.calls += 1
            return vector
        width = self.n + 1
        count = trees  # the same on every rank (not read off this rank's leaves)
        offsets = parts if parts else [0] * len(ids)
        slots_list = [k * width + (self.n if i < 0 else i) for i, k in zip(ids, offsets)]
        slots = torch.tensor(slots_list, dtype=torch.int64).to(self.device)
        vector = torch.zeros(count * width, dtype=torch.float32, device=self.device)
        values = values.to(self.device, torch.float32)
        if op == "sum":
            vector.index_add_(0, slots, values)
            reduce_op = dist.ReduceOp.SUM
        elif op == "max":
            vector.scatter_reduce_(0, slots, values, reduce="amax", include_self=True)
            reduce_op = dist.ReduceOp.MAX
        else:
            raise ValueError(f"shard: expected a reduction 'sum' or 'max', got {op!r}")
        if dist.get_world_size(self.group) > 1:
            all_reduce_op(vector, reduce_op, group=self.group)
        self.calls += 1
        return vector[slots]


class LocalReducer:
    """The reducer of shard's local probes at init: no collective (each value is its own)."""

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
    ) -> torch.Tensor:
        del ids, op, parts, trees
        return values


def meta_tree(params: PyTree) -> PyTree:
    """The whole parameters as meta tensors of their (global) shapes and dtypes, in the user's
    structure: what masks and labels are resolved on under ``shard``."""

    def meta(p: Any) -> Any:
        return None if p is None else torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")

    return tree_map(meta, params)


def shard_scope(
    tree: PyTree, n_tensors: int, of_leaf: Sequence[int], starts: Sequence[int], reducer: Any
) -> Scope:
    """The scope of an update of the pieces whose plan tensors are ``of_leaf`` and whose first
    elements in them are ``starts``."""
    return Scope(tree, tuple(range(n_tensors)), tuple(of_leaf), reducer, {}, tuple(starts))
