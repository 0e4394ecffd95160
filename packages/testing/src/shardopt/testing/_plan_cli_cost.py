"""Exact per-rank memory and per-step traffic of DDP and shardopt stages 1 and 2, from shapes."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardopt.core import Plan, TensorSpec, plan_partition

__all__ = [
    "ParamSpec",
    "Prediction",
    "RankBytes",
    "Setup",
    "Traffic",
    "predict",
    "ring_bytes",
]

# [Note: what plan predicts]
# The optimizer is Adam/AdamW over the trainable parameters: two moments of the parameter's
# shape plus a float32 0-d step count per tensor (torch.optim.AdamW's state, and shardopt core's
# per-parameter counts). Frozen parameters are held whole by every rank and have no gradient and
# no state. Bytes are those of the tensors each rank holds between steps, exactly:
#
# - stage 0 (DDP + torch.optim.AdamW): every rank holds everything. DDP is assumed to run with
#   ``gradient_as_bucket_view=True`` (its buckets are the gradients; the default keeps one more
#   gradient-sized copy).
# - stages 1 and 2 (shardopt.functional.shard): the trainable parameters are views into one flat
#   buffer per (dtype, device) group, ``padded_numel`` long. Each rank holds two moments of
#   ``shard_numel`` elements per group (a rank owning nothing still holds zeros), one float32
#   count per piece it owns, and, with a master dtype, ``shard_numel`` master weights of each
#   lower-precision group, whose moments are then in the master dtype. Stage 1 holds the full
#   gradients (``.grad``, what DDP averaged); stage 2 holds its ``shard_numel`` gradient shard
#   per group (gradient hooks free the full gradients during backward). Buffers are the
#   collectives' staging. A group whose flat buffer exceeds ``bucket_numel`` (elements of one
#   collective, all ranks together) is cut into chunks of ``bucket_numel // world_size``
#   elements per rank, rounded down to a multiple of the plan's align (at least align), and has
#   two staging buffers of ``world_size`` chunks unless the rooted calls gather it in place
#   (stage 1); in stage 2 every group packs its gradients for the reduction, so a group of one
#   chunk has one staging buffer as large as its flat buffer.
#
# Transients (activations, a gradient alive between its computation and its reduction, the
# temporary of a bucketed copy) are not counted: they depend on the model's forward, not on the
# partition.

# [Note: traffic model]
# Per step and rank, the collectives are: stage 0, an all-reduce of every gradient (DDP's
# buckets); stage 1, the same all-reduce, then a gather of the flat parameter buffers; stage 2,
# a reduction of the flat gradient buffers into each rank's shard, then the gather. shardopt
# carries a gather as one all-gather per chunk ("collective") or one broadcast per rank and
# chunk ("rooted", its default for CPU tensors on gloo), a reduction as one reduce-scatter per
# chunk or one reduce per rank and chunk; either way the buffers handed over add up to the
# padded flat buffers. ``Traffic`` holds those bytes (exact: the test counts them in real
# runs). On the wire we assume ring algorithms: an all-reduce of n bytes makes each rank send
# and receive 2 (W - 1) n / W bytes (exact when the buffer splits into W equal chunks, rounded
# here), a reduce-scatter of an n-byte input or an all-gather into an n-byte output
# (W - 1) n / W, exact since flat buffers are padded to a multiple of W. The rooted calls move
# the same volume per rank on average. A world of one rank calls no gather or reduction.


class Setup(enum.Enum):
    """What holds the optimizer: DDP with torch.optim (stage 0), or shardopt stage 1 or 2."""

    DDP = 0
    STAGE1 = 1
    STAGE2 = 2


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A parameter by name, shape and dtype, trainable or frozen."""

    name: str
    spec: TensorSpec
    trainable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.spec, TensorSpec):
            raise TypeError(f"ParamSpec: expected a TensorSpec, got {self.spec!r}")


@dataclass(frozen=True, slots=True)
class RankBytes:
    """Bytes one rank holds between steps (see [Note: what plan predicts])."""

    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int

    @property
    def total(self) -> int:
        """All of the above."""
        return self.params + self.grads + self.optimizer + self.master + self.buffers


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes of the buffers one rank hands to each kind of collective per step.

    ``all_reduce``: input (= output) bytes; ``reduce_scatter``: reduce-scatter inputs, or the
    blocks of rooted reduces; ``all_gather``: all-gather outputs, or the blocks of rooted
    broadcasts. ``collectives`` counts the calls of the last two kinds (DDP's bucket count
    depends on its bucket cap and is left out). See [Note: traffic model].
    """

    all_reduce: int
    reduce_scatter: int
    all_gather: int
    collectives: int

    def sent(self, world_size: int) -> int:
        """Bytes each rank sends (= receives) per step with ring algorithms ([Note: traffic
        model])."""
        return ring_bytes(world_size, self.all_reduce, self.reduce_scatter, self.all_gather)


def ring_bytes(world_size: int, all_reduce: int, reduce_scatter: int, all_gather: int) -> int:
    """Bytes each rank sends and receives for these buffers with ring algorithms.

    Example:
        >>> ring_bytes(4, all_reduce=400, reduce_scatter=0, all_gather=400)
        900
    """
    w = world_size
    return round(2 * (w - 1) * all_reduce / w) + (w - 1) * (reduce_scatter + all_gather) // w


@dataclass(frozen=True, slots=True)
class Prediction:
    """Per-rank bytes and per-step traffic of one setup at one world size."""

    setup: Setup
    strategy: str | None
    world_size: int
    ranks: tuple[RankBytes, ...]
    traffic: Traffic
    imbalance: float

    @property
    def label(self) -> str:
        """``"DDP"`` or e.g. ``"stage 1 flat"``."""
        if self.setup is Setup.DDP:
            return "DDP"
        return f"stage {self.setup.value} {self.strategy}"

    def max_rank(self) -> RankBytes:
        """Each field's maximum over the ranks."""
        fields = ("params", "grads", "optimizer", "master", "buffers")
        return RankBytes(*(max(getattr(r, f) for r in self.ranks) for f in fields))


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _master_size(dtype: str, master: torch.dtype | None) -> int | None:
    """The master dtype's itemsize if ``dtype`` gets master weights, else None."""
    if master is None or not getattr(torch, dtype).is_floating_point:
        return None
    return master.itemsize if master.itemsize > _itemsize(dtype) else None


def _predict_ddp(
    params: Sequence[ParamSpec], world_size: int, master: torch.dtype | None
) -> Prediction:
    trainable = [p.spec for p in params if p.trainable]
    grads = sum(s.nbytes for s in trainable)
    state = master_bytes = 0
    for s in trainable:
        m = _master_size(s.dtype, master)
        state += 2 * s.numel * (m or _itemsize(s.dtype)) + 4
        master_bytes += s.numel * (m or 0)
    rank = RankBytes(sum(p.spec.nbytes for p in params), grads, state, master_bytes, 0)
    return Prediction(
        Setup.DDP, None, world_size, (rank,) * world_size, Traffic(grads, 0, 0, 0), 1.0
    )


def pieces_per_rank(plan: Plan) -> list[int]:
    """How many pieces each rank owns (one float32 count each), in O(tensors + pieces).

    Example:
        >>> plan = plan_partition([((3, 2), "float32"), ((4,), "float32")], 2, align=1)
        >>> pieces_per_rank(plan)
        [1, 2]
    """
    counts = [0] * plan.world_size
    for group in plan.groups:
        shard = group.shard_numel
        for t, begin in zip(group.tensors, group.offsets):
            end = begin + plan.tensors[t].numel
            if end > begin:
                for rank in range(begin // shard, (end - 1) // shard + 1):
                    counts[rank] += 1
    return counts


def _chunks(plan: Plan, shard_numel: int, bucket_numel: int | None) -> tuple[int, int]:
    """(number of chunks, widest chunk) of a group's slice (shardopt.functional's rule)."""
    if shard_numel == 0:
        return 0, 0
    width = shard_numel
    if bucket_numel is not None and plan.world_size * shard_numel > bucket_numel:
        width = max(plan.align, bucket_numel // plan.world_size // plan.align * plan.align)
    width = min(width, shard_numel)
    return -(-shard_numel // width), width


def _predict_sharded(
    params: Sequence[ParamSpec],
    plan: Plan,
    stage: Setup,
    master: torch.dtype | None,
    bucket_numel: int | None,
    rooted: bool,
) -> Prediction:
    w = plan.world_size
    frozen = sum(p.spec.nbytes for p in params if not p.trainable)
    flat = state = master_bytes = shards = staging = chunks = 0
    for g in plan.groups:
        size, m = _itemsize(g.dtype), _master_size(g.dtype, master)
        flat += g.padded_numel * size
        shards += g.shard_numel * size
        state += 2 * g.shard_numel * (m or size)
        master_bytes += g.shard_numel * (m or 0)
        n, width = _chunks(plan, g.shard_numel, bucket_numel)
        chunks += n
        if (n > 1 and not rooted) or (n and stage is Setup.STAGE2):
            staging += (2 if n > 1 else 1) * w * width * size
    full_grads = sum(p.spec.nbytes for p in params if p.trainable)
    grads = shards if stage is Setup.STAGE2 else full_grads
    ranks = tuple(
        RankBytes(flat + frozen, grads, state + 4 * pieces, master_bytes, staging)
        for pieces in pieces_per_rank(plan)
    )
    padded = flat  # the bytes of the flat buffers: gathered, and (stage 2) reduce-scattered
    if w == 1:
        padded = chunks = 0
    chunks *= w if rooted else 1
    if stage is Setup.STAGE2:
        traffic = Traffic(0, padded, padded, 2 * chunks)
    else:
        traffic = Traffic(full_grads, 0, padded, chunks)
    return Prediction(stage, plan.strategy.value, w, ranks, traffic, plan.imbalance())


def predict(
    params: Sequence[ParamSpec],
    world_size: int,
    setup: Setup,
    *,
    strategy: str = "flat",
    master_dtype: torch.dtype | None = None,
    bucket_numel: int | None = None,
    align: int | None = None,
    algorithm: str = "collective",
) -> Prediction:
    """The exact per-rank bytes and per-step traffic of ``setup`` (see [Note: what plan
    predicts] and [Note: traffic model]).

    ``strategy``, ``align`` and ``bucket_numel`` are those given to ``plan_partition`` and
    ``shard`` (ignored for DDP), ``master_dtype`` and ``algorithm`` (``"collective"`` or
    ``"rooted"``, not ``"auto"``) as ``shard``'s.

    Example:
        >>> params = [ParamSpec("w", TensorSpec((10, 10), "float32", "cpu"))]
        >>> p = predict(params, 4, Setup.STAGE2)
        >>> p.ranks[0], p.traffic.sent(4)
        (RankBytes(params=512, grads=128, optimizer=260, master=0, buffers=512), 768)
    """
    if algorithm not in ("collective", "rooted"):
        raise ValueError(f"plan: expected algorithm collective or rooted, got {algorithm!r}")
    if not any(p.trainable for p in params):
        raise ValueError("plan: expected at least one trainable parameter, got none")
    if setup is Setup.DDP:
        return _predict_ddp(params, world_size, master_dtype)
    trainable = [p.spec for p in params if p.trainable]
    plan = plan_partition(trainable, world_size, strategy=strategy, align=align)
    rooted = algorithm == "rooted"
    return _predict_sharded(params, plan, setup, master_dtype, bucket_numel, rooted)
