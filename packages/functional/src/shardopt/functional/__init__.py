"""shardopt.functional: stateless ZeRO-1 and ZeRO-2 sharded updates over torch.distributed."""

from shardopt.functional._checkpoint import load_sharded_state_dict, sharded_state_dict
from shardopt.functional._collectives import (
    Algorithm,
    Pending,
    all_gather_params,
    reduce_scatter_grads,
)
from shardopt.functional._dcp import load_checkpoint, save_checkpoint
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
from shardopt.functional._torch_format import (
    consolidate_state_dict,
    load_torch_state_dict,
    torch_hyperparams,
)

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
    "consolidate_state_dict",
    "load_checkpoint",
    "load_sharded_state_dict",
    "load_torch_state_dict",
    "local_sgd_step",
    "reduce_scatter_grads",
    "register_grad_hooks",
    "save_checkpoint",
    "shard",
    "sharded_state_dict",
    "torch_hyperparams",
]
