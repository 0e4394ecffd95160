"""What a sharded optimizer costs, from shapes: the bytes each rank holds and moves per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardopt.core import Plan
from shardopt.functional.engine._collectives import Algorithm, bucket_calls
from shardopt.functional.engine._reduction_strategy import replica_chunks
from shardopt.functional.engine._staging import staging_numel

__all__ = ["RankBytes", "Traffic", "shard_cost", "replica_traffic", "ring_bytes"]

# [Note: cost of a sharded optimizer]
# ``shard_cost`` reads the plan the engine runs on and the engine's own rules (staging_numel,
# bucket_calls), so a prediction and a run cannot drift apart; a test compares both byte for byte
# at W = 2, 3 and 4. A world of one rank is not modelled: there the engine packs no staging and
# takes large tensors' gradients as they are, and gives small ones a gradient shard even with
# ``grads_averaged`` ([Note: one rank's gradients]). The optimizer is Adam/AdamW over the plan's
# (trainable) tensors. Per rank, between steps:
# - params: the flat buffers of every group (padding included) plus the frozen parameters, held
#   whole;
# - grads: the full local ``.grad`` of every trainable parameter where they are kept (stage 1),
#   plus the compact gradient shards (``shard_numels[rank]`` elements per group, in
#   ``reduce_dtype`` or the group's dtype, whatever ``comm_dtype``) where gradients are reduced
#   (stage 2; stage 1 unless ``grads_averaged``);
# - optimizer: two moments per compact shard element (in ``state_dtype`` where set, core's
#   ``with_state_dtype``; else in the master dtype where set) and one float32 count per piece;
# - master: the compact master shards of the lower-precision groups; with ``master_remainders``
#   a bfloat16 group under a float32 master keeps an int16 remainder per owned element, 2 bytes
#   instead of 4 (float16 groups keep float32 masters; [Note: master remainders]);
# - buffers: the gradient staging (``staging_numel`` per group, the all-to-all's scratch
#   included under EXCHANGE) where gradients are reduced, in ``comm_dtype``, else in
#   ``reduce_dtype`` or the group's dtype. With a ``comm_dtype`` the staging is ``widened``
#   ([Note: wire dtype]): each slot holds a bucket and a scratch of W times its largest shard.
# Per step each bucket is reduced (where gradients are reduced) and gathered once: the bytes
# handed to the calls are the bucket's bytes whatever the calls (in ``comm_dtype`` where set,
# else in ``reduce_dtype`` or the group's dtype), and the number of calls is ``bucket_calls``
# (one all-gather, reduce-scatter or all-to-all, or one broadcast or reduce per owner; with a
# ``comm_dtype`` one all-to-all per bucket, whatever the algorithm and the shards).
# On a hybrid mesh the replicas' step moves each rank's gradient shard once per step
# (``replica_traffic``): an all-reduce of each bucket's part (counted by its input), or with a
# ``comm_dtype`` an all-to-all of it in that dtype and an all-gather of its R chunks in the
# shard's dtype (counted by its output; [Note: wire dtype]).


@dataclass(frozen=True, slots=True)
class RankBytes:
    """Bytes one rank holds between steps (see [Note: cost of a sharded optimizer])."""

    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int

    @property
    def total(self) -> int:
        """All of the above."""
        return self.params + self.grads + self.optimizer + self.master + self.buffers


def ring_bytes(world_size: int, all_reduce: int, reduce_scatter: int, all_gather: int) -> int:
    """Bytes each rank sends and receives for these buffers with ring algorithms: an all-reduce
    of n bytes 2 (W - 1) n / W, a reduce-scatter or all-gather of n bytes (W - 1) n / W.

    Example:
        >>> ring_bytes(4, all_reduce=400, reduce_scatter=0, all_gather=400)
        900
    """
    w = world_size
    return round(2 * (w - 1) * all_reduce / w) + (w - 1) * (reduce_scatter + all_gather) // w


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes one rank hands to each kind of collective per step, and the calls.

    ``reduce_scatter`` counts reduce-scatter and all-to-all inputs or per-owner reduces' blocks,
    ``all_gather`` all-gather outputs or broadcasts' blocks; ``collectives`` the calls of those
    two kinds.
    """

    all_reduce: int
    reduce_scatter: int
    all_gather: int
    collectives: int

    def sent(self, world_size: int) -> int:
        """Bytes each rank sends (= receives) per step with ring algorithms."""
        return ring_bytes(world_size, self.all_reduce, self.reduce_scatter, self.all_gather)


def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named ``dtype``."""
    return getattr(torch, dtype).itemsize


def _master_dtype(dtype: str, master: torch.dtype | None) -> torch.dtype | None:
    """``master`` if it is more precise than the float ``dtype``, else None (as shard does)."""
    t = getattr(torch, dtype)
    if master is None or not t.is_floating_point or master.itemsize <= t.itemsize:
        return None
    return master


def _pieces_per_rank(plan: Plan) -> list[list[int]]:
    """``out[g][r]``: how many pieces rank ``r`` owns in group ``g``, in O(tensors + pieces)."""
    out = [[0] * plan.world_size for _ in plan.groups]
    for t, spec in enumerate(plan.tensors):
        if spec.numel:
            g, _, _ = plan.locate(t)
            for rank, _ in plan.tensor_pieces(t):
                out[g][rank] += 1
    return out


def shard_cost(
    plan: Plan,
    *,
    stage: int = 1,
    grads_averaged: bool = False,
    master_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype | None = None,
    algorithm: Algorithm | str = Algorithm.COLLECTIVE,
    frozen_bytes: int = 0,
    comm_dtype: torch.dtype | None = None,
    master_remainders: bool = False,
) -> tuple[tuple[RankBytes, ...], Traffic]:
    """Per rank, the bytes held by ``shard(adam, plan, stage=..., ...)``; per step, its traffic.

    ``algorithm`` is the concrete one (``"collective"`` or ``"exchange"``, as ``"auto"``
    resolves on the ranks' backend); ``state_dtype`` that of Adam's moments under core's
    ``with_state_dtype`` (None: the master's, else the parameters'); ``comm_dtype`` and
    ``master_remainders`` are ``shard``'s. See [Note: cost of a sharded optimizer].

    Example:
        >>> from shardopt.core import plan_partition
        >>> plan = plan_partition([((10, 10), "float32")], 4)
        >>> ranks, traffic = shard_cost(plan, stage=2)
        >>> ranks[0], traffic.sent(4)
        (RankBytes(params=512, grads=128, optimizer=260, master=0, buffers=512), 768)

        In bfloat16 on the wire, the staging (128 elements and a scratch of 4 x 32) is 512
        bytes, and half the gradient bytes travel; a bfloat16 group's remainders cost 2 bytes
        per owned element:

        >>> ranks, traffic = shard_cost(plan, stage=2, comm_dtype=torch.bfloat16)
        >>> ranks[0].buffers, traffic.reduce_scatter, traffic.all_gather
        (512, 256, 512)
        >>> bf16 = plan_partition([((10, 10), "bfloat16")], 4)
        >>> [shard_cost(bf16, master_dtype=torch.float32, master_remainders=r)[0][0].master
        ...  for r in (False, True)]
        [128, 64]
    """
    algo = Algorithm(algorithm)
    if algo is Algorithm.AUTO:
        raise ValueError("shard_cost: expected algorithm 'collective' or 'exchange', got 'auto'")
    if stage not in (1, 2) or (stage == 2 and grads_averaged):
        raise ValueError(
            f"shard_cost: expected stage 1, or stage 2 without grads_averaged, got stage "
            f"{stage!r} with grads_averaged={grads_averaged!r}"
        )
    if comm_dtype is not None and grads_averaged:
        raise ValueError(
            f"shard_cost: expected comm_dtype=None with grads_averaged=True (nothing is "
            f"reduced), got {comm_dtype!r}"
        )
    if master_remainders and master_dtype is not torch.float32:
        raise ValueError(
            "shard_cost: expected master_dtype=torch.float32 with master_remainders=True, got "
            f"master_dtype={master_dtype!r}"
        )
    reduces, widened = not grads_averaged, comm_dtype is not None
    pieces = _pieces_per_rank(plan)
    held = (frozen_bytes, sum(t.nbytes for t in plan.tensors) if stage == 1 else 0)
    staging = None
    if reduces:
        staging = [staging_numel(plan, g, algo, widened=widened) for g in range(len(plan.groups))]
    dtypes = _Dtypes(master_dtype, reduce_dtype, state_dtype, comm_dtype, master_remainders)
    ranks = tuple(
        _rank_bytes(plan, r, pieces, staging, dtypes, held) for r in range(plan.world_size)
    )
    return ranks, _traffic(plan, reduces, dtypes, algo)


@dataclass(frozen=True, slots=True)
class _Dtypes:
    """The dtypes (and the remainders option) of a sharded optimizer's cost: ``shard_cost``'s."""

    master: torch.dtype | None
    reduce: torch.dtype | None
    state: torch.dtype | None
    comm: torch.dtype | None
    remainders: bool

    def master_itemsize(self, dtype: str) -> int:
        """Bytes per owned element of the master of a group of ``dtype`` (0: none)."""
        m = _master_dtype(dtype, self.master)
        if m is None:
            return 0
        if self.remainders and m is torch.float32 and dtype == "bfloat16":
            return torch.int16.itemsize  # the parameter plus this remainder is the master
        return m.itemsize

    def reduce_itemsize(self, dtype: str) -> int:
        """Bytes per element of a group of ``dtype``'s gradient shards."""
        return self.reduce.itemsize if self.reduce is not None else itemsize(dtype)

    def wire_itemsize(self, dtype: str) -> int:
        """Bytes per element of a group of ``dtype``'s gradient staging (and wire)."""
        return self.comm.itemsize if self.comm is not None else self.reduce_itemsize(dtype)


def _rank_bytes(
    plan: Plan,
    rank: int,
    pieces: list[list[int]],
    staging: list[int] | None,
    dtypes: _Dtypes,
    held: tuple[int, int],
) -> RankBytes:
    """``held``: the frozen parameters' bytes and the full gradients' (stage 1)."""
    (params, grads), optimizer, master, buffers = held, 0, 0, 0
    for g, group in enumerate(plan.groups):
        size = itemsize(group.dtype)
        shard = group.shard_numels[rank]
        m = _master_dtype(group.dtype, dtypes.master)
        moment = dtypes.state or m or getattr(torch, group.dtype)
        params += group.numel * size
        optimizer += 2 * shard * moment.itemsize + 4 * pieces[g][rank]  # mu, nu; the counts
        master += shard * dtypes.master_itemsize(group.dtype)
        if staging is not None:  # gradients are reduced
            grads += shard * dtypes.reduce_itemsize(group.dtype)
            buffers += staging[g] * dtypes.wire_itemsize(group.dtype)
    return RankBytes(params, grads, optimizer, master, buffers)


def _traffic(plan: Plan, reduces: bool, dtypes: _Dtypes, algo: Algorithm) -> Traffic:
    if plan.world_size == 1:
        return Traffic(0, 0, 0, 0)
    gathered = reduced = calls = 0
    widened = dtypes.comm is not None
    for group in plan.groups:
        size = itemsize(group.dtype)
        wire = dtypes.wire_itemsize(group.dtype)
        for bucket in group.buckets:
            gathered += bucket.numel * size
            calls += bucket_calls(bucket, algo)
            if reduces:
                reduced += bucket.numel * wire
                calls += bucket_calls(bucket, algo, reduce=True, widened=widened)
    return Traffic(0, reduced, gathered, calls)


def replica_traffic(
    plan: Plan,
    rank: int,
    replicas: int,
    *,
    reduce_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
) -> Traffic:
    """What ``rank`` hands to the replicas' step per step under hybrid sharding over
    ``replicas`` replicas, where the plan is of the "shard" dim and gradients are reduced
    ([Note: hybrid sharding]): per bucket, an all-reduce of its gradient shard part (in
    ``reduce_dtype`` or the group's dtype); with a ``comm_dtype``, an all-to-all of the part in
    that dtype and an all-gather of R chunks of it in the shard's dtype (``replica_chunks``,
    [Note: wire dtype]), counted as ``count_collectives`` counts them.

    Example:
        >>> from shardopt.core import plan_partition
        >>> plan = plan_partition([((10, 10), "float32")], 4)  # 32 elements a rank (aligned)
        >>> replica_traffic(plan, 0, 2)
        Traffic(all_reduce=128, reduce_scatter=0, all_gather=0, collectives=0)
        >>> replica_traffic(plan, 0, 2, comm_dtype=torch.bfloat16)
        Traffic(all_reduce=0, reduce_scatter=64, all_gather=128, collectives=2)
    """
    reduced = scattered = gathered = calls = 0
    for group in plan.groups:
        size = reduce_dtype.itemsize if reduce_dtype is not None else itemsize(group.dtype)
        for bucket in group.buckets:
            n = bucket.shards[rank]
            if comm_dtype is None:
                reduced += n * size
            else:
                scattered += n * comm_dtype.itemsize
                gathered += replicas * replica_chunks(n, replicas)[0] * size
                calls += 2
    return Traffic(reduced, scattered, gathered, calls)
