"""The predictions of ``shardopt plan``: DDP's, and shardopt's from the engine's own cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardopt.core import TensorSpec, plan_partition
from shardopt.functional import RankBytes, Traffic, replica_traffic, shard_cost

__all__ = ["DDP", "ParamSpec", "Prediction", "predict"]

# [Note: what plan predicts]
# shardopt's rows come from ``shardopt.functional.shard_cost`` over the plan that
# ``plan_partition`` makes of the trainable parameters (see [Note: cost of a sharded optimizer]
# there); the frozen ones are held whole by every rank and have no gradient and no state. DDP's row
# is DDP + torch.optim.AdamW: every rank holds everything (DDP with
# ``gradient_as_bucket_view=True``: its buckets are the gradients) and all-reduces every gradient.
# Transients (activations, a gradient alive between its computation and its reduction) are not
# counted: they depend on the model's forward, not on the partition.


# A prediction's ``stage`` is the CLI's ``--stage``: 0 is DDP with torch.optim (nothing
# sharded), 1 and 2 are shardopt.functional's Stage.
DDP = 0


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
class Prediction:
    """Per-rank bytes and per-step traffic of one stage (and strategy) at one world size."""

    stage: int
    strategy: str | None
    world_size: int
    ranks: tuple[RankBytes, ...]
    traffic: Traffic
    imbalance: float
    replicas: int = 1  # hybrid sharding: world_size is the "shard" dim, replicas the other
    replica_sent: int = 0  # bytes each rank sends to the other replicas per step

    @property
    def section(self) -> tuple[int, int]:
        """(replicas, ranks per replica): the world or mesh this prediction belongs to."""
        if self.stage == DDP:
            return self.replicas, self.world_size // self.replicas
        return self.replicas, self.world_size

    @property
    def label(self) -> str:
        """``"DDP"`` or e.g. ``"stage 1 flat"``."""
        if self.stage == DDP:
            return "DDP"
        return f"stage {self.stage} {self.strategy}"

    def max_rank(self) -> RankBytes:
        """Each field's maximum over the ranks."""
        fields = ("params", "grads", "optimizer", "master", "buffers")
        return RankBytes(*(max(getattr(r, f) for r in self.ranks) for f in fields))


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _predict_ddp(
    params: Sequence[ParamSpec], world_size: int, master: torch.dtype | None
) -> Prediction:
    trainable = [p.spec for p in params if p.trainable]
    grads = sum(s.nbytes for s in trainable)
    state = master_bytes = 0
    for s in trainable:
        size = _itemsize(s.dtype)
        m = master.itemsize if master is not None and master.itemsize > size else None
        state += 2 * s.numel * (m or size) + 4
        master_bytes += s.numel * (m or 0)
    rank = RankBytes(sum(p.spec.nbytes for p in params), grads, state, master_bytes, 0)
    return Prediction(DDP, None, world_size, (rank,) * world_size, Traffic(grads, 0, 0, 0), 1.0)


def predict(
    params: Sequence[ParamSpec],
    world_size: int,
    stage: int,
    *,
    strategy: str = "flat",
    master_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype | None = None,
    bucket_numel: int | None = None,
    align: int | None = None,
    algorithm: str = "collective",
    grads_averaged: bool = False,
    replicas: int = 1,
    comm_dtype: torch.dtype | None = None,
    master_remainders: bool = False,
) -> Prediction:
    """The exact per-rank bytes and per-step traffic of ``stage`` (0: DDP; see [Note: what plan
    predicts]).

    ``strategy``, ``align`` and ``bucket_numel`` are ``plan_partition``'s (ignored for DDP);
    ``master_dtype``, ``grads_averaged``, ``comm_dtype``, ``master_remainders`` and
    ``algorithm`` (``"collective"`` or ``"exchange"``, not ``"auto"``) ``shard``'s;
    ``state_dtype`` that of the moments under core's ``with_state_dtype`` (sharded rows only:
    DDP's torch.optim keeps them in the parameters' or master dtype, and DDP's all-reduce is
    in the gradients' dtype). ``replicas > 1``: hybrid sharding over a mesh of ``replicas`` x
    ``world_size`` ranks (shardopt.functional's [Note: hybrid sharding]); ``traffic`` is then
    that of the "shard" groups and ``replica_sent`` what a rank sends to the other replicas:
    a ring all-reduce of its gradient shards, 2 (R - 1) / R of them, or with a ``comm_dtype``
    an all-to-all of them in that dtype and an all-gather in theirs, (R - 1) / R each.

    Example:
        >>> params = [ParamSpec("w", TensorSpec((10, 10), "float32", "cpu"))]
        >>> p = predict(params, 4, 2)
        >>> p.ranks[0], p.traffic.sent(4)
        (RankBytes(params=512, grads=128, optimizer=260, master=0, buffers=512), 768)

        Across R replicas of those 4 ranks, a rank's 128 bytes of gradient shard are
        all-reduced (2 (R - 1) / R of them sent), or sent as 64 bytes of bfloat16 and gathered
        back as float32 ((R - 1) / R of each): 0.75 of the bytes at every R:

        >>> [[predict(params, 4, 2, replicas=r, comm_dtype=c).replica_sent
        ...   for c in (None, torch.bfloat16)] for r in (2, 4, 8)]
        [[128, 96], [192, 144], [224, 168]]
    """
    if algorithm not in ("collective", "exchange"):
        raise ValueError(f"plan: expected algorithm collective or exchange, got {algorithm!r}")
    if not any(p.trainable for p in params):
        raise ValueError("plan: expected at least one trainable parameter, got none")
    if stage not in (DDP, 1, 2):
        raise ValueError(f"plan: expected stage 0 (DDP), 1 or 2, got {stage!r}")
    if stage == DDP:  # over all ranks, the mesh's too
        return dataclasses.replace(
            _predict_ddp(params, world_size, master_dtype), replicas=replicas
        )
    trainable = [p.spec for p in params if p.trainable]
    plan = plan_partition(
        trainable, world_size, strategy=strategy, align=align, bucket_numel=bucket_numel
    )
    ranks, traffic = shard_cost(
        plan,
        stage=stage,
        grads_averaged=grads_averaged,
        master_dtype=master_dtype,
        state_dtype=state_dtype,
        algorithm=algorithm,
        frozen_bytes=sum(p.spec.nbytes for p in params if not p.trainable),
        comm_dtype=comm_dtype,
        master_remainders=master_remainders,
    )
    if grads_averaged:  # DDP's all-reduce, before a stage 1 step that takes its gradients
        traffic = dataclasses.replace(traffic, all_reduce=sum(s.nbytes for s in trainable))
    across = 0
    if replicas > 1 and not grads_averaged:  # the busiest rank's ring bytes
        across = max(
            replica_traffic(plan, r, replicas, comm_dtype=comm_dtype).sent(replicas)
            for r in range(world_size)
        )
    return Prediction(
        stage, plan.strategy.value, world_size, ranks, traffic, plan.imbalance(), replicas, across
    )
