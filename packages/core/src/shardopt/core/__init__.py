"""shardopt.core: pure, JAX-style optimizers that match torch.optim, and partition planners."""

from shardopt.core._base import (
    EmptyState,
    Transformation,
    apply_updates,
    chain,
    identity,
    init_count,
)
from shardopt.core._schedules import (
    ScalarOrSchedule,
    Schedule,
    constant,
    cosine_decay,
    join_schedules,
    linear_warmup,
    resolve,
    warmup_cosine_decay,
)
from shardopt.core._transforms import (
    ScaleByScheduleState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
)
from shardopt.core._tree import PyTree, leafwise, tree_leaves, tree_map, tree_structure

__all__ = [
    "EmptyState",
    "PyTree",
    "ScalarOrSchedule",
    "ScaleByScheduleState",
    "Schedule",
    "Transformation",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "constant",
    "cosine_decay",
    "identity",
    "init_count",
    "join_schedules",
    "leafwise",
    "linear_warmup",
    "resolve",
    "scale",
    "scale_by_learning_rate",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "warmup_cosine_decay",
]
