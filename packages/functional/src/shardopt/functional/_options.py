"""The options of shard(), validated once: the stage, precision and reduction choices."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from shardopt.functional.engine._collectives import Algorithm

__all__ = ["ShardOptions", "Stage"]

# [Note: stage 1 averages]
# ``step`` is given each rank's gradients. In stage 1 they are by default the rank's LOCAL
# gradients, as in stage 2: ``step`` averages them by reduce-scatter (bucket by bucket, into a
# gradient shard of 1/W) and the update reads the shard; the full ``.grad`` tensors are left as
# they were. A reduce-scatter and an all-gather move the bytes of one all-reduce, so this costs
# what DDP's gradient all-reduce costs, and never trains on one rank's gradient by mistake. A
# caller whose gradients are already averaged (behind DDP, or after its own all-reduce) says so
# with ``grads_averaged=True``: nothing is reduced and the update reads its pieces of the full
# gradients in place. Stage 2 always reduces (its point is to free full gradients), so
# ``grads_averaged=True`` there is an error.


class Stage(enum.IntEnum):
    """What is sharded: the optimizer state (ZeRO-1), or the gradients as well (ZeRO-2)."""

    OPTIMIZER_STATE = 1
    GRADIENTS = 2


@dataclass(frozen=True, slots=True)
class ShardOptions:
    """The validated options of :func:`shard` (see its docstring)."""

    stage: Stage | int = Stage.OPTIMIZER_STATE
    grads_averaged: bool = False
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    max_norm: float | None = None
    skip_nonfinite: bool = False
    algorithm: Algorithm | str = Algorithm.AUTO
    comm_dtype: torch.dtype | None = None
    master_remainders: bool = False
    compile: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"shard: expected stage 1 or 2, got {self.stage!r}")
        object.__setattr__(self, "stage", Stage(self.stage))
        if type(self.grads_averaged) is not bool:
            raise ValueError(f"shard: expected grads_averaged a bool, got {self.grads_averaged!r}")
        if self.grads_averaged and self.stage is Stage.GRADIENTS:
            raise ValueError(
                "shard: expected grads_averaged=False with stage=2 (stage 2 reduce-scatters local "
                "gradients itself), got grads_averaged=True"
            )
        for name in ("master_dtype", "reduce_dtype", "comm_dtype"):
            m = getattr(self, name)
            if m is not None and (not isinstance(m, torch.dtype) or not m.is_floating_point):
                raise ValueError(f"shard: expected {name} None or a float dtype, got {m!r}")
        for name in ("reduce_dtype", "comm_dtype"):
            if getattr(self, name) is not None and self.grads_averaged:
                raise ValueError(
                    f"shard: expected {name}=None with grads_averaged=True (nothing is "
                    f"reduced), got {getattr(self, name)!r}"
                )
        self._check_remainders()
        if self.compile not in (True, False, "auto") or type(self.compile) not in (bool, str):
            raise ValueError(f"shard: expected compile True, False or 'auto', got {self.compile!r}")
        c = self.max_norm
        if c is not None and not (isinstance(c, (int, float)) and c > 0):
            raise ValueError(f"shard: expected max_norm None or > 0, got {c!r}")
        names = tuple(a.value for a in Algorithm)
        if self.algorithm not in names:
            raise ValueError(f"shard: expected algorithm in {names}, got {self.algorithm!r}")
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))

    def _check_remainders(self) -> None:
        if type(self.master_remainders) is not bool:
            raise ValueError(
                f"shard: expected master_remainders a bool, got {self.master_remainders!r}"
            )
        if self.master_remainders and self.master_dtype is not torch.float32:
            raise ValueError(
                "shard: expected master_dtype=torch.float32 with master_remainders=True (a "
                "remainder completes a bfloat16 parameter to its float32 master), got "
                f"master_dtype={self.master_dtype!r}"
            )

    @property
    def reduces(self) -> bool:
        """Whether ``step`` averages local gradients (see [Note: stage 1 averages])."""
        return not self.grads_averaged

    @property
    def needs_health(self) -> bool:
        """Whether each step has its small all-reduce (see [Note: one small all-reduce])."""
        return self.max_norm is not None or self.skip_nonfinite

    def master_for(self, dtype: torch.dtype) -> torch.dtype | None:
        """The master dtype of a group of ``dtype``: ``master_dtype`` if more precise, else None."""
        m = self.master_dtype
        if m is None or not dtype.is_floating_point or m.itemsize <= dtype.itemsize:
            return None
        return m
