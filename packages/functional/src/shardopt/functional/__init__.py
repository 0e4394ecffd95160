"""shardopt.functional: stateless ZeRO-1 and ZeRO-2 sharded updates over torch.distributed."""

from shardopt.functional._cost import RankBytes, Traffic, layout_cost, replica_traffic
from shardopt.functional._options import ShardOptions, Stage
from shardopt.functional._shard import ShardedTransformation, shard
from shardopt.functional.checkpoint._checkpoint import load_sharded_state_dict, sharded_state_dict
from shardopt.functional.checkpoint._dcp import load_checkpoint, save_checkpoint
from shardopt.functional.checkpoint._errors import CheckpointError
from shardopt.functional.checkpoint._torch_format import (
    consolidate_state_dict,
    load_torch_state_dict,
    torch_hyperparams,
)
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    all_gather_bucket,
    reduce_scatter_bucket,
)
from shardopt.functional.engine._failure import RankFailedError
from shardopt.functional.engine._hooks import (
    GradHooks,
    ParamHooks,
    register_grad_hooks,
    register_param_hooks,
    wait_params,
)
from shardopt.functional.engine._local_sgd import average_params, averaging_due, local_sgd_step
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._state import FieldKind, ShardedState, StateField, StepStats

FlatLayout = ParamBuffers  # the name before issue 39 split the gradient half out (docs/glossary.md)

__all__ = [
    "Algorithm",
    "CheckpointError",
    "FieldKind",
    "FlatLayout",
    "GradHooks",
    "ParamBuffers",
    "ParamHooks",
    "Pending",
    "RankBytes",
    "RankFailedError",
    "ShardOptions",
    "ShardedState",
    "ShardedTransformation",
    "Stage",
    "StateField",
    "StepStats",
    "Traffic",
    "all_gather_bucket",
    "average_params",
    "averaging_due",
    "consolidate_state_dict",
    "layout_cost",
    "load_checkpoint",
    "load_sharded_state_dict",
    "load_torch_state_dict",
    "local_sgd_step",
    "reduce_scatter_bucket",
    "replica_traffic",
    "register_grad_hooks",
    "register_param_hooks",
    "save_checkpoint",
    "shard",
    "sharded_state_dict",
    "torch_hyperparams",
    "wait_params",
]
