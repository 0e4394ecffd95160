"""shardopt.functional: stateless ZeRO-1 and ZeRO-2 sharded updates over torch.distributed."""

from shardopt.functional._collectives import (
    Algorithm,
    Pending,
    all_gather_params,
    reduce_scatter_grads,
)
from shardopt.functional._hooks import GradHooks, register_grad_hooks
from shardopt.functional._layout import FlatLayout
from shardopt.functional._local_sgd import average_params, averaging_due, local_sgd_step
from shardopt.functional._shard import (
    DEFAULT_BUCKET_NUMEL,
    ShardedTransformation,
    ShardOptions,
    Stage,
    shard,
)
from shardopt.functional._state import FieldKind, ShardedState, StateField, StepStats

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "Algorithm",
    "FieldKind",
    "FlatLayout",
    "GradHooks",
    "Pending",
    "ShardOptions",
    "ShardedState",
    "ShardedTransformation",
    "Stage",
    "StateField",
    "StepStats",
    "all_gather_params",
    "average_params",
    "averaging_due",
    "local_sgd_step",
    "reduce_scatter_grads",
    "register_grad_hooks",
    "shard",
]
