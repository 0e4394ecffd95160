"""shardopt.optim: drop-in replacements for torch.distributed.optim."""

from shardopt.optim._averagers import (
    HierarchicalModelAverager,
    ModelAverager,
    PeriodicModelAverager,
)
from shardopt.optim._averaging import average_parameters
from shardopt.optim._post_local_sgd import PostLocalSGDOptimizer
from shardopt.optim._rpc_optimizer import DistributedOptimizer

__all__ = [
    "DistributedOptimizer",
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "average_parameters",
]
