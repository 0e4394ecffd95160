"""shardopt.core: pure, JAX-style optimizers that match torch.optim, and partition planners."""

from shardopt.core._base import (
    EmptyState,
    Transformation,
    apply_updates,
    chain,
    identity,
    init_count,
)
from shardopt.core._flat import FlatRule, flat_rule, update_flat_, with_flat_rule
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
    "FlatRule",
    "PyTree",
    "ScalarOrSchedule",
    "ScaleByScheduleState",
    "Schedule",
    "Transformation",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "constant",
    "flat_rule",
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
    "update_flat_",
    "warmup_cosine_decay",
    "with_flat_rule",
]

# [Note: provisional lazy exports]
# While the optimizer, transform and planner modules are being written, their public names are
# found through each module's ``__all__`` on first access. Replaced by explicit imports once the
# modules land.
_PENDING = (
    "_sgd", "_adam", "_adagrad", "_rmsprop", "_adamax", "_nadam", "_radam", "_adadelta",
    "_rprop", "_clipping", "_combinators", "_accumulate", "_plan",
)


def __getattr__(name: str):
    import importlib

    for mod_name in _PENDING:
        try:
            mod = importlib.import_module(f"shardopt.core.{mod_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"shardopt.core.{mod_name}":
                continue
            raise
        if name in getattr(mod, "__all__", ()):
            return getattr(mod, name)
    raise AttributeError(f"module 'shardopt.core' has no attribute {name!r}")
