"""Owner assignment and flat-buffer layout of partition plans, on plain integers."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from shardopt.core._plan_spec import Bucket, BufferGroup, TensorSpec, short

Shards = tuple[int, ...]

__all__ = [
    "assign_greedy",
    "assign_owners",
    "cut_buckets",
    "group_keys",
    "layout_flat",
    "layout_greedy",
    "layout_mixed",
]

# [Note: plan layout]
# Every strategy produces the same thing: one flat buffer per (dtype, device) group, in order of
# first appearance, cut into buckets, and each bucket into one shard per rank ("bucket-major"):
# rank r owns shard r of every bucket. A bucket is a run of whole tensors, formed walking the
# group's tensors from the last (the first whose gradients backward produces) and closed once it
# holds ``bucket_numel`` elements or more; a tensor that large is a bucket of its own, and
# ``bucket_numel=None`` makes one bucket per group. So a bucket's gradients are all ready at one
# point of backward, and its collective can start then (see [Note: engine] in
# shardopt.functional). Inside a bucket the strategies differ:
# - FLAT lays the bucket's tensors end to end in their given order and pads the end to a multiple
#   of ``world_size * align``; every shard has ``ceil(n / (world_size * align)) * align``
#   elements, so a rank's state is 1/W of the bucket plus less than ``align`` elements, and
#   tensors may straddle ranks (their pieces are views of one tensor).
# - GREEDY first picks an owner per tensor (see [Note: greedy matches torch]), then lays out the
#   bucket's tensors owner by owner (rank 0's first, each rank's in their given order); shard r
#   holds exactly rank r's tensors (rounded up to ``align``, 1 by default): no tensor straddles
#   ranks and nothing is padded to the largest rank.
# - MIXED owns some tensors whole (``owners[i]``, a rank) and cuts the others (``owners[i] ==
#   -1``) like FLAT: for optimizers that need whole matrices (Muon) beside elementwise ones (AdamW
#   for embeddings, norms and biases). The bucket is laid out rank by rank: rank r's whole tensors,
#   then cut tensors, in their given order, until the shard holds ``max(its whole tensors, L)``
#   elements, L the water level at which the bucket's elements fill every shard so
#   (``_water_level``); shard r ends there, inside the last cut tensor placed (which so
#   straddles ranks r and r + 1), or where its whole tensors end if they alone pass the mark. Each
#   whole tensor lies inside its owner's shard, each cut tensor is contiguous, and the shards are
#   as equal as the whole tensors allow. No alignment (align is 1) and no padding.
# The layout is a pure function of (tensors, world_size, align, bucket_numel, owners), which is
# how a Plan validates itself (see [Note: plan validation]). All of it is O(n log n) in the
# number of tensors plus O(world_size) per bucket: no per-element work.

# [Note: greedy matches torch]
# torch's ZeroRedundancyOptimizer assigns whole parameters: for each param group in order, it
# sorts the group's parameters by numel, largest first (a stable sort, so equal sizes keep their
# order), and gives each one to the rank with the smallest running total, the lowest rank on
# ties; the totals carry over from one param group to the next and count every parameter
# whatever its dtype or device. A heap of (total, rank) pops exactly that rank, in O(log W)
# instead of torch's O(W) scan. test_plan.py compares with torch's own ``_partition_parameters``.


# [Note: balancing a cost]
# ``plan_partition(..., strategy="greedy", cost=...)`` assigns by another measure than torch's
# element counts: the tensors of every param group together, largest cost first, each to the rank
# with the least cost so far (the lowest on ties): the LPT rule, within 4/3 of the best
# assignment's largest load. For Muon, whose update orthogonalises each matrix on its owner, the
# cost is ``newton_schulz_flops``, which grows faster than the element count (m m n): on GPT-2
# small's 48 hidden matrices at W = 8 it gives every rank the same work and the same state
# (test_plan.py measures both).


def group_keys(tensors: Sequence[TensorSpec]) -> tuple[list[tuple[str, str]], list[int]]:
    """The (dtype, device) keys in order of first appearance, and the group index of each tensor."""
    index: dict[tuple[str, str], int] = {}
    group_of = [index.setdefault((t.dtype, t.device), len(index)) for t in tensors]
    return list(index), group_of


def assign_greedy(
    numels: Sequence[float], param_groups: Sequence[int], world_size: int
) -> tuple[int, ...]:
    """The owning rank of each tensor under torch's rule (see [Note: greedy matches torch]).

    ``param_groups`` (one index per tensor, non-decreasing) splits the tensors into param groups.

    Example:
        >>> assign_greedy([5, 7, 5, 2], [0, 0, 0, 1], 3)
        (1, 0, 2, 1)
    """
    heap: list[tuple[float, int]] = [(0, rank) for rank in range(world_size)]  # a heap
    owners = [0] * len(numels)
    for _, run in itertools.groupby(range(len(numels)), key=param_groups.__getitem__):
        for i in sorted(run, key=lambda i: -numels[i]):
            total, rank = heap[0]
            owners[i] = rank
            heapq.heapreplace(heap, (total + numels[i], rank))
    return tuple(owners)


def assign_owners(
    api: str,
    specs: Sequence[TensorSpec],
    owned: list[bool],
    world_size: int,
    cost: Callable[[TensorSpec], float] | None,
) -> tuple[int, ...]:
    """The owner of each tensor ``owned`` says is whole (-1 for the others): torch's rule by
    element counts, or the LPT rule by ``cost`` ([Note: balancing a cost])."""
    picked = [i for i, o in enumerate(owned) if o]
    if cost is None and all(owned):
        numels = [t.numel for t in specs]
        return assign_greedy(numels, [t.param_group for t in specs], world_size)
    measure = cost or (lambda t: t.numel)
    costs = [float(measure(specs[i])) for i in picked]
    if not all(math.isfinite(c) and c >= 0 for c in costs):
        raise ValueError(f"{api}: expected finite costs >= 0, got {short(costs)}")
    owners = [-1] * len(specs)
    for i, rank in zip(picked, assign_greedy(costs, [0] * len(picked), world_size)):
        owners[i] = rank
    return tuple(owners)


def _members(group_of: Sequence[int], num_groups: int) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i, g in enumerate(group_of):
        members[g].append(i)
    return members


def cut_buckets(
    idx: Sequence[int], numels: Sequence[int], bucket_numel: int | None
) -> list[list[int]]:
    """``idx`` cut into runs of whole tensors, closed walking back from the last tensor once a
    run holds ``bucket_numel`` elements (None: one run), in forward order; a tensor of
    ``bucket_numel`` elements or more is a run of its own.

    Example:
        >>> cut_buckets([0, 1, 2, 3], [5, 1, 1, 6], 6)
        [[0, 1, 2], [3]]
        >>> cut_buckets([0, 1, 2], [40, 3, 2], 8)
        [[0], [1, 2]]
    """
    if bucket_numel is None or not idx:
        return [list(idx)]
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i in reversed(idx):
        if run and numels[i] >= bucket_numel:  # a large tensor is a bucket of its own
            runs.append(run[::-1])
            run, total = [], 0
        run.append(i)
        total += numels[i]
        if total >= bucket_numel:
            runs.append(run[::-1])
            run, total = [], 0
    if run:
        runs.append(run[::-1])
    return runs[::-1]


def layout_flat(
    tensors: Sequence[TensorSpec],
    numels: Sequence[int],
    world_size: int,
    align: int,
    bucket_numel: int | None,
) -> tuple[BufferGroup, ...]:
    """The FLAT groups of ``tensors``, whose sizes are ``numels`` (see [Note: plan layout]).

    Example:
        >>> specs = [TensorSpec((3,), "float32", "cpu"), TensorSpec((6,), "float32", "cpu")]
        >>> g = layout_flat(specs, [3, 6], 2, 4, None)[0]
        >>> g.offsets, g.buckets
        ((0, 3), (Bucket(start=0, shards=(8, 8)),))
    """
    unit = world_size * align

    def bucket(run: Sequence[int], start: int, order: list[int], offsets: list[int]) -> Shards:
        order.extend(run)
        offsets.extend(itertools.accumulate((numels[i] for i in run[:-1]), initial=start))
        return (-(-sum(numels[i] for i in run) // unit) * align,) * world_size

    return _layout(tensors, numels, world_size, bucket_numel, bucket)


def layout_greedy(
    tensors: Sequence[TensorSpec],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    align: int,
    bucket_numel: int | None,
) -> tuple[BufferGroup, ...]:
    """The GREEDY groups of ``tensors`` (sizes ``numels``) owned by ``owners``.

    See [Note: plan layout].

    Example:
        >>> specs = [TensorSpec((3,), "float32", "cpu"), TensorSpec((6,), "float32", "cpu")]
        >>> g = layout_greedy(specs, [3, 6], (1, 0), 2, 1, None)[0]
        >>> g.tensors, g.offsets, g.buckets
        ((1, 0), (0, 6), (Bucket(start=0, shards=(6, 3)),))
    """

    def bucket(run: Sequence[int], start: int, order: list[int], offsets: list[int]) -> Shards:
        shards = []
        pos = start
        for rank in range(world_size):
            mine = [i for i in run if owners[i] == rank]
            order.extend(mine)
            if mine:
                sizes = (numels[i] for i in mine[:-1])
                offsets.extend(itertools.accumulate(sizes, initial=pos))
            shard = -(-sum(numels[i] for i in mine) // align) * align
            shards.append(shard)
            pos += shard
        return tuple(shards)

    return _layout(tensors, numels, world_size, bucket_numel, bucket)


def layout_mixed(
    tensors: Sequence[TensorSpec],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    bucket_numel: int | None,
) -> tuple[BufferGroup, ...]:
    """The MIXED groups of ``tensors`` (sizes ``numels``): ``owners[i]`` owns tensor i whole, or
    it is cut where the shards fall if -1 (see [Note: plan layout]).

    Example:
        >>> specs = [TensorSpec((2, 3), "float32", "cpu"), TensorSpec((4,), "float32", "cpu")]
        >>> g = layout_mixed(specs, [6, 4], (1, -1), 2, None)[0]
        >>> g.tensors, g.offsets, g.buckets
        ((1, 0), (0, 4), (Bucket(start=0, shards=(4, 6)),))
    """

    def bucket(run: Sequence[int], start: int, order: list[int], offsets: list[int]) -> Shards:
        return _mixed_bucket(run, numels, owners, world_size, start, order, offsets)

    return _layout(tensors, numels, world_size, bucket_numel, bucket)


def _layout(
    tensors: Sequence[TensorSpec],
    numels: Sequence[int],
    world_size: int,
    bucket_numel: int | None,
    bucket: Callable[[Sequence[int], int, list[int], list[int]], Shards],
) -> tuple[BufferGroup, ...]:
    """One group per (dtype, device), each cut into buckets of whole tensors (``cut_buckets``);
    ``bucket(run, start, order, offsets)`` lays out one at ``start`` (appending its tensors to
    ``order`` and their offsets to ``offsets``) and returns its shard sizes: the part of
    [Note: plan layout] that differs by strategy."""
    keys, group_of = group_keys(tensors)
    groups = []
    for (dtype, device), idx in zip(keys, _members(group_of, len(keys))):
        order: list[int] = []
        offsets: list[int] = []
        buckets: list[Bucket] = []
        start = 0
        for run in cut_buckets(idx, numels, bucket_numel):
            shards = bucket(run, start, order, offsets)
            buckets.append(Bucket(start, shards))
            start += sum(shards)
        groups.append(
            BufferGroup(dtype, device, tuple(order), tuple(offsets), tuple(buckets), world_size)
        )
    return tuple(groups)


def _mixed_bucket(
    run: Sequence[int],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    start: int,
    order: list[int],
    offsets: list[int],
) -> tuple[int, ...]:
    """Lays out one MIXED bucket (appending to ``order`` and ``offsets``); its shard sizes."""
    cut = [i for i in run if owners[i] < 0]
    mine = [[i for i in run if owners[i] == rank] for rank in range(world_size)]
    wholes = [sum(numels[i] for i in m) for m in mine]
    level = _water_level(wholes, sum(numels[i] for i in run))
    pos, bound, j = start, start, 0
    shards = []
    for rank in range(world_size):
        floor = bound  # the shard must hold the rank's whole tensors
        for i in mine[rank]:
            order.append(i)
            offsets.append(pos)
            pos += numels[i]
            floor = pos
        mark = bound + max(wholes[rank], level)
        while j < len(cut) and (pos < mark or rank == world_size - 1):
            order.append(cut[j])
            offsets.append(pos)
            pos += numels[cut[j]]
            j += 1
        end = pos if rank == world_size - 1 else min(max(mark, floor), pos)
        shards.append(end - bound)
        bound = end
    return tuple(shards)


def _water_level(wholes: Sequence[int], total: int) -> int:
    """The shard size L that ``total`` elements fill when each rank holds ``max(wholes[r], L)``:
    ranks whose whole tensors pass the level keep just those, the others share the rest.

    Example:
        >>> _water_level([128, 128, 0, 0], 395), _water_level([0, 0], 7)
        (70, 4)
    """
    rest, ranks = total, len(wholes)
    for w in sorted(wholes, reverse=True):
        if w * ranks <= rest:
            break
        rest, ranks = rest - w, ranks - 1
    return -(-rest // ranks) if ranks else 0
