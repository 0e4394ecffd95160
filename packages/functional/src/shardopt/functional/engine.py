"""The engine's building blocks, public for code that builds sharded optimizers on it.

``shardopt.functional`` exports what a training loop calls (``shard``, the hooks, checkpoints);
this module exports what an optimizer built on the engine needs besides (``shardopt.optim``'s
ZeroRedundancyOptimizer and model averagers use nothing else): the layout and its parameter
syncs, the groups of a device mesh ([Note: hybrid sharding]), the cross-rank agreement
([Note: cross-rank validation]), the torch names and per-piece views of a sharded state
(``shaped``: in their tensors' shapes where the plan owns them whole), and the local-SGD
schedule and averaging helpers.
"""

from shardopt.functional._checkpoint_keys import field_keys, has_state, piece_value
from shardopt.functional._collectives import ProcessGroup, comm_device
from shardopt.functional._layout import build_layout
from shardopt.functional._local_sgd import (
    average_flat,
    check_averageable,
    check_schedule,
    in_group,
    resolve_group,
)
from shardopt.functional._mesh import MeshGroups, mesh_groups
from shardopt.functional._param_sync import StagedSync, broadcast_tensors
from shardopt.functional._rooted import (
    broadcast_from,
    gather_object_to,
    gather_to,
    irecv_from,
    isend_to,
    reduce_to,
)
from shardopt.functional._state import init_values, piece_slots, probe_fields
from shardopt.functional._update import shaped
from shardopt.functional._validate import agree_across_ranks, describe, fingerprint

__all__ = [
    "reduce_to",
    "isend_to",
    "irecv_from",
    "gather_to",
    "gather_object_to",
    "broadcast_from",
    "MeshGroups",
    "ProcessGroup",
    "StagedSync",
    "agree_across_ranks",
    "average_flat",
    "broadcast_tensors",
    "build_layout",
    "check_averageable",
    "check_schedule",
    "comm_device",
    "describe",
    "field_keys",
    "fingerprint",
    "has_state",
    "in_group",
    "init_values",
    "mesh_groups",
    "piece_slots",
    "piece_value",
    "probe_fields",
    "resolve_group",
    "shaped",
]
