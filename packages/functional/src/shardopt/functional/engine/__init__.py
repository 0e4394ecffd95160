"""The engine: buffers, buckets, collectives and hooks; public for code that builds sharded
optimizers on it.

``shardopt.functional`` exports what a training loop calls (``shard``, the hooks, checkpoints);
this package exports what an optimizer built on the engine needs besides (``shardopt.optim``'s
ZeroRedundancyOptimizer and model averagers use nothing else): the parameter buffers and their
syncs, the groups of a device mesh ([Note: hybrid sharding]), the cross-rank agreement
([Note: cross-rank validation]), the fields of a sharded state and per-piece views of it
(``shaped``: in their tensors' shapes where the plan owns them whole), and the local-SGD
schedule and averaging helpers. The engine imports nothing above it: ``checkpoint/`` and the
functional face build on it, and name a state's entries for torch (``shardopt.functional.
checkpoint``).

[Note: engine glossary]
The index spaces, each named once (the plan's arithmetic is shardopt.core's ``Plan``):

- tensor ``t``: a parameter, by its position in the plan (``plan.tensors[t]``, the order of the
  ``params`` given to ``init``).
- group ``g``: the tensors of one dtype and device, in plan order; one parameter buffer each.
- bucket ``b`` of group ``g`` (a ``BucketKey`` ``(g, b)``): a run of whole, adjacent tensors of
  the group, cut into one shard per rank (bucket-major); the unit of every collective.
- offset: where tensor ``t`` starts in its group's buffer, in elements (``plan.locate(t)``).
- shard: rank ``r``'s contiguous slice of one bucket; a rank's compact shard of a group is its
  shards of the group's buckets end to end (``shard_numels[r]`` elements).
- pieces, ranks and buckets are mapped once per ParamBuffers (``BucketMap`` in _buckets.py: each
  bucket's tensors, pieces, packing and place in the compact shard).
- piece ``k``: the part of one tensor inside this rank's shards (``param_buffers.pieces[k]``: its
  tensor, group, ``start:stop`` within the tensor and ``offset`` within the compact shard); the
  update and the optimizer state are per piece.

The buffers, each owned by one object: the parameter buffers by ``ParamBuffers`` ([Note: engine]
in _param_buffers.py), the gradient shards and the staging by ``GradShards`` ([Note: gradient
shards] in _reduction.py), the optimizer state and master weights by the sharded state:

- parameter buffer: one per group, every rank's full copy; the parameters are views of it
  ([Note: buffer storage]). Parameter syncs all-gather a bucket's region of it in place. A
  ParamBuffers with the staged storage has none: its parameters keep their own ([Note: parameter
  storage]).
- gradient shards: one compact shard per group, where reductions land (stage 2 keeps nothing
  else of the gradients).
- staging: two buffers per group of the largest bucket's size, used in turn to pack a bucket's
  gradients for its reduce-scatter ([Note: gradient staging]); in ``comm_dtype`` on a narrower
  wire, with a scratch for the all-to-all ([Note: wire dtype]); the staged parameter storage of
  parameters outside the buffers uses its own two ([Note: staged parameter sync]).
- optimizer state and master weights: compact shards, per piece, held by the sharded state;
  master weights as float32 or as 16-bit remainders of bfloat16 parameters ([Note: master
  weights], [Note: master remainders]).

The strategies, chosen once per sharded state: the parameter storage (views or staged), the
gradient reduction (plain or on a wire: ``Reduction`` in _reduction_strategy.py), and each
group's master weights (``Masters`` in _masters.py). Each bucket's update is prepared on its
first step, over the bucket or over its pieces (``BucketUpdates`` in _bucket_update.py, [Note:
prepared bucket updates]): a step then costs a few operators per bucket, whatever its tensors.

The folders: ``engine/`` holds what moves and updates memory (parameter buffers, collectives,
hooks, the update pipeline, the sharded state and its fields, the cross-rank checks, the local-SGD
averaging); ``checkpoint/`` holds the formats (sharded state dicts, torch.optim's consolidated
form, torch.distributed.checkpoint) and imports the engine; ``shard`` and the cost model sit at
the top.
"""

from shardopt.functional.engine._collectives import ProcessGroup, comm_device
from shardopt.functional.engine._failure import RankFailedError, fails_together
from shardopt.functional.engine._local_sgd import (
    average_flat,
    check_averageable,
    check_schedule,
    in_group,
    resolve_group,
)
from shardopt.functional.engine._mesh import MeshGroups, mesh_groups
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.functional.engine._renamed import renamed_keyword, warn_renamed
from shardopt.functional.engine._rooted import (
    broadcast_from,
    gather_object_to,
    gather_to,
    irecv_from,
    isend_to,
    reduce_to,
)
from shardopt.functional.engine._state import init_values, piece_slots, probe_fields
from shardopt.functional.engine._update import shaped
from shardopt.functional.engine._validate import (
    agree_across_ranks,
    describe,
    fingerprint,
    plan_fields,
    ranks_with,
)

__all__ = [
    "renamed_keyword",
    "warn_renamed",
    "reduce_to",
    "isend_to",
    "irecv_from",
    "gather_to",
    "gather_object_to",
    "broadcast_from",
    "MeshGroups",
    "ProcessGroup",
    "RankFailedError",
    "agree_across_ranks",
    "average_flat",
    "build_param_buffers",
    "check_averageable",
    "check_schedule",
    "comm_device",
    "describe",
    "fails_together",
    "fingerprint",
    "in_group",
    "init_values",
    "mesh_groups",
    "piece_slots",
    "plan_fields",
    "probe_fields",
    "ranks_with",
    "resolve_group",
    "shaped",
]
