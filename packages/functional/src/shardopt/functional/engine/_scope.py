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

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# [Note: reductions over tensor-parallel tensors]
# A DTensor parameter sharded by tensor parallelism ([Note: DTensor parameters]) is planned by its
# local tensor, so the pieces of the shard group cover only this tensor-parallel rank's part of
# it. Its per-tensor slot is therefore summed (or maxed) over the tensor-parallel group as well,
# in a second all-reduce of the slots of split tensors alone; a replicated tensor is whole on
# every tensor-parallel rank and is not counted again. A tree's value is taken over the per-tensor
# slots after both (``total``), so each tensor counts once. What cannot be told apart is refused,
# on every rank alike (all run the same update): a tree whose leaves are not the pieces in scope
# (its partial comes as one number), and row sums (``row_norm``), whose rows a split cuts.


def _named(group: ProcessGroup) -> ProcessGroup:
    """``group``, the default group named: a functional collective in a compiled update's graph
    takes no None, and dynamo falls back to eager for the whole function at one (measured at W=2:
    a global-norm chain ran as seven graphs, 1.7x built-in AdamW's step; docs/performance.md)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


class ShardReducer:
    """Sums or maxes per-tensor partials over the ranks of ``process_group`` (the shard group:
    replicas of a hybrid mesh hold the same pieces and are not counted twice), and over the
    tensor-parallel group for tensors it splits ([Note: reductions over tensor-parallel tensors]).
    One all-reduce per call (two with split tensors), of one float32 per plan tensor plus one for
    the whole tree; ``calls`` counts the calls."""

    def __init__(
        self, process_group: ProcessGroup, n_tensors: int, device: torch.device | None
    ) -> None:
        self.process_group, self.n = _named(process_group), n_tensors
        self.device = comm_device(process_group, device)
        self.calls = 0
        self.split: tuple[ProcessGroup, tuple[bool, ...]] | None = None
        self._masks: dict[int, torch.Tensor] = {}  # trees -> the split slots, made once

    def set_tensor_parallel(self, group: ProcessGroup, split: Sequence[bool]) -> None:
        """Tensors ``split`` (one flag per plan tensor) are parts over tensor-parallel ``group``."""
        self.split = (_named(group), tuple(split)) if any(split) else None
        self._masks = {}

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
        total: bool = False,
    ) -> torch.Tensor:
        """Each leaf's value over its whole tensor (id -1: the whole tree); ``parts`` keeps
        the values of several trees apart (slots ``part * (n + 1) + id``); with ``total``, one
        value: ``op`` over every tensor of the tree."""
        if op not in _OPS and op != "rows":
            raise ValueError(f"shard: expected a reduction 'sum', 'max' or 'rows', got {op!r}")
        if not torch.compiler.is_compiling():  # a count a graph would guard on: eager only
            self.calls += 1
        if op == "rows":  # already one slot per row of every tensor: summed as it is
            self._refuse_split("row sums (row_norm), whose rows tensor parallelism cuts")
            vector = values.to(self.device, torch.float32).clone()
            return self._all_reduce(vector, "sum", self.process_group)
        width = self.n + 1
        offsets = parts if parts else [0] * len(ids)
        slots_list = [k * width + (self.n if i < 0 else i) for i, k in zip(ids, offsets)]
        if any(i < 0 for i in ids):
            self._refuse_split("a reduction over a tree whose leaves are not the pieces updated")
        slots = torch.tensor(slots_list, dtype=torch.int64).to(self.device)
        vector = torch.zeros(trees * width, dtype=torch.float32, device=self.device)
        values = values.to(self.device, torch.float32)
        if op == "sum":
            vector.index_add_(0, slots, values)
        else:
            vector.scatter_reduce_(0, slots, values, reduce="amax", include_self=True)
        vector = self._all_reduce(vector, op, self.process_group)
        vector = self._over_tensor_parallel(vector, op, trees)
        return _total(vector, op) if total else vector[slots]

    def _all_reduce(self, vector: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        if dist.get_world_size(group) <= 1:
            return vector
        if torch.compiler.is_compiling():  # in a compiled update's graph: [Note: compiled updates]
            from torch.distributed import _functional_collectives as funcol

            return funcol.wait_tensor(funcol.all_reduce(vector, op, group))
        all_reduce_op(vector, _OPS[op], group=group)
        return vector

    def _over_tensor_parallel(self, vector: torch.Tensor, op: str, trees: int) -> torch.Tensor:
        """``vector`` with the slots of split tensors reduced over the tensor-parallel group."""
        if self.split is None:
            return vector
        group, split = self.split
        mask = self._masks.get(trees)
        if mask is None:
            mask = torch.tensor([*split, False] * trees, device=self.device)
            self._masks[trees] = mask
        fill = 0.0 if op == "sum" else float("-inf")
        across = self._all_reduce(torch.where(mask, vector, fill), op, group)
        return torch.where(mask, across, vector)

    def _refuse_split(self, what: str) -> None:
        if self.split is not None:
            raise ValueError(
                f"shard: expected reductions that tensor-parallel parts can be counted in, got "
                f"{what}, with tensors split by tensor parallelism (DTensor Shard placements)"
            )


class LocalReducer:
    """The reducer of shard's local probes at init: no collective (each value is its own; a
    tree's, this rank's)."""

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
        total: bool = False,
    ) -> torch.Tensor:
        del ids, parts, trees
        return _total(values, op) if total else values


def _total(values: torch.Tensor, op: str) -> torch.Tensor:
    """``op`` over every value, as a one-element tensor (0 where there is none)."""
    if values.numel() == 0:
        return values.new_zeros(1)
    return (values.sum() if op == "sum" else values.max()).reshape(1)


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
