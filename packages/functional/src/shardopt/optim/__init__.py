"""shardopt.optim: drop-in replacements for torch.distributed.optim."""

from shardopt.optim._averagers import (
    HierarchicalModelAverager,
    ModelAverager,
    PeriodicModelAverager,
)
from shardopt.optim._averaging import average_parameters
from shardopt.optim._ddp_hooks import hook_with_zero_step, hook_with_zero_step_interleaved
from shardopt.optim._frameworks import ConsolidateOnSave
from shardopt.optim._local_gradients import local_gradients_hook
from shardopt.optim._post_local_sgd import PostLocalSGDOptimizer
from shardopt.optim._rpc_optimizer import DistributedOptimizer
from shardopt.optim.zero import ZeroRedundancyOptimizer

__all__ = [
    "ConsolidateOnSave",
    "DistributedOptimizer",
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "ZeroRedundancyOptimizer",
    "average_parameters",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "local_gradients_hook",
]
