"""shardopt.functional: stateless ZeRO-1 and ZeRO-2 sharded updates over torch.distributed."""

from typing import Any

from shardopt.functional._cost import RankBytes, Traffic, replica_traffic, shard_cost
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
from shardopt.functional.engine._hooks import GradHooks, register_grad_hooks
from shardopt.functional.engine._local_sgd import average_params, averaging_due, local_sgd_step
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._param_hooks import ParamHooks, register_param_hooks, wait_params
from shardopt.functional.engine._renamed import warn_renamed
from shardopt.functional.engine._state import FieldGranularity, ShardedState, StateField, StepStats

__all__ = [
    "Algorithm",
    "CheckpointError",
    "FieldGranularity",
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
    "shard_cost",
    "sharded_state_dict",
    "torch_hyperparams",
    "wait_params",
]


# Old names, each with a FutureWarning ([Note: renamed names] in engine/_renamed.py):
_RENAMED = {
    "FlatLayout": "ParamBuffers",
    "FieldKind": "FieldGranularity",
    "layout_cost": "shard_cost",
}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_renamed(f"shardopt.functional.{name}", f"shardopt.functional.{new}")
    return globals()[new]
