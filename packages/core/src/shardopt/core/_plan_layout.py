"""Owner assignment and flat-buffer layout of partition plans, on plain integers."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from shardopt.core._plan_spec import FlatGroup, TensorSpec

__all__ = ["assign_greedy", "group_keys", "layout_flat", "layout_greedy"]

# [Note: plan layout]
# Both strategies produce the same thing: one flat buffer per (dtype, device) group, in order of
# first appearance, ``world_size * shard_numel`` elements long, rank r owning the slice
# ``[r * shard_numel, (r + 1) * shard_numel)``. They differ in where tensors go:
# - FLAT lays the group's tensors end to end in their given order from offset 0 and pads the end,
#   ``shard_numel = ceil(total / (world_size * align)) * align``: every slice is equal, contiguous
#   and aligned, and tensors may straddle ranks (their pieces are views of one tensor).
# - GREEDY first picks an owner per tensor (see [Note: greedy matches torch]), then puts rank r's
#   tensors of the group, in their given order, end to end from ``r * shard_numel``, with
#   ``shard_numel`` the largest per-rank total of the group rounded up to ``align``. No tensor
#   straddles ranks; the gaps are padding.
# The layout is a pure function of (tensors, world_size, align, owners), which is how a Plan
# validates itself (see [Note: plan validation]). All of it is O(n log n) in the number of
# tensors plus O(world_size) per group: no per-element work.

# [Note: greedy matches torch]
# torch's ZeroRedundancyOptimizer assigns whole parameters: for each param group in order, it
# sorts the group's parameters by numel, largest first (a stable sort, so equal sizes keep their
# order), and gives each one to the rank with the smallest running total, the lowest rank on
# ties; the totals carry over from one param group to the next and count every parameter
# whatever its dtype or device. A heap of (total, rank) pops exactly that rank, in O(log W)
# instead of torch's O(W) scan. test_plan.py compares with torch's own ``_partition_parameters``.


def group_keys(tensors: Sequence[TensorSpec]) -> tuple[list[tuple[str, str]], list[int]]:
    """The (dtype, device) keys in order of first appearance, and the group index of each tensor."""
    index: dict[tuple[str, str], int] = {}
    group_of = [index.setdefault((t.dtype, t.device), len(index)) for t in tensors]
    return list(index), group_of


def assign_greedy(
    numels: Sequence[int], param_groups: Sequence[int], world_size: int
) -> tuple[int, ...]:
    """The owning rank of each tensor under torch's rule (see [Note: greedy matches torch]).

    ``param_groups`` (one index per tensor, non-decreasing) splits the tensors into param groups.

    Example:
        >>> assign_greedy([5, 7, 5, 2], [0, 0, 0, 1], 3)
        (1, 0, 2, 1)
    """
    heap = [(0, rank) for rank in range(world_size)]  # sorted, hence already a heap
    owners = [0] * len(numels)
    for _, run in itertools.groupby(range(len(numels)), key=param_groups.__getitem__):
        for i in sorted(run, key=lambda i: -numels[i]):
            total, rank = heap[0]
            owners[i] = rank
            heapq.heapreplace(heap, (total + numels[i], rank))
    return tuple(owners)


def _members(group_of: Sequence[int], num_groups: int) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i, g in enumerate(group_of):
        members[g].append(i)
    return members


def layout_flat(
    tensors: Sequence[TensorSpec], numels: Sequence[int], world_size: int, align: int
) -> tuple[FlatGroup, ...]:
    """The FLAT groups of ``tensors``, whose sizes are ``numels`` (see [Note: plan layout]).

    Example:
        >>> specs = [TensorSpec((3,), "float32", "cpu"), TensorSpec((6,), "float32", "cpu")]
        >>> g = layout_flat(specs, [3, 6], 2, 4)[0]
        >>> g.offsets, g.shard_numel
        ((0, 3), 8)
    """
    keys, group_of = group_keys(tensors)
    groups = []
    for (dtype, device), idx in zip(keys, _members(group_of, len(keys))):
        offsets = list(itertools.accumulate((numels[i] for i in idx), initial=0))
        total = offsets.pop()
        shard = -(-total // (world_size * align)) * align
        groups.append(FlatGroup(dtype, device, tuple(idx), tuple(offsets), shard, world_size))
    return tuple(groups)


def layout_greedy(
    tensors: Sequence[TensorSpec],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    align: int,
) -> tuple[FlatGroup, ...]:
    """The GREEDY groups of ``tensors`` (sizes ``numels``) owned by ``owners``.

    See [Note: plan layout].

    Example:
        >>> specs = [TensorSpec((3,), "float32", "cpu"), TensorSpec((6,), "float32", "cpu")]
        >>> g = layout_greedy(specs, [3, 6], (1, 0), 2, 4)[0]
        >>> g.tensors, g.offsets, g.shard_numel
        ((1, 0), (0, 8), 8)
    """
    keys, group_of = group_keys(tensors)
    groups = []
    for (dtype, device), idx in zip(keys, _members(group_of, len(keys))):
        per_rank: list[list[int]] = [[] for _ in range(world_size)]
        for i in idx:
            per_rank[owners[i]].append(i)
        totals = [sum(numels[i] for i in mine) for mine in per_rank]
        shard = -(-max(totals) // align) * align
        order: list[int] = []
        offsets: list[int] = []
        for rank, mine in enumerate(per_rank):
            order.extend(mine)
            starts = itertools.accumulate((numels[i] for i in mine), initial=rank * shard)
            offsets.extend(itertools.islice(starts, len(mine)))
        groups.append(FlatGroup(dtype, device, tuple(order), tuple(offsets), shard, world_size))
    return tuple(groups)
