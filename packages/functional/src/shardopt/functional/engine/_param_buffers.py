"""The engine: flat buffers in buckets, and the collectives that move them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Plan
from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._buckets import BucketKey, BucketMap
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    ProcessGroup,
    resolve_algorithm,
)
from shardopt.functional.engine._storage import ParamStorage, StagedStorage, ViewStorage

__all__ = ["BucketKey", "ParamBuffers", "build_param_buffers"]

# [Note: engine]
# One ParamBuffers per sharded optimizer owns what moves parameters: the flat parameter buffer of
# each plan group (the parameters are views of it, see [Note: buffer storage]), the buckets the
# plan cut it into, and the parameter gathers in flight. The gradient half (this rank's gradient
# shards, their staging, the bucket reductions and readiness) is ``GradShards`` ([Note: gradient
# shards] in _reduction.py), owned by the gradient reducer; it reads the parameter buffers' buckets
# and options. Everything else maps ranges of them: the update reads and writes piece views,
# checkpoints read the shards. Every collective is per bucket and never leaves the bucket's
# memory:
#
# - parameter sync (``start_param_sync`` / ``finish_param_syncs``, ``wait_params`` for some
#   buckets): the bucket's region of the buffer is all-gathered in place, each rank's input being
#   its own shard of it (bucket-major layout, [Note: plan layout] in shardopt.core). No staging,
#   no copy. The caller's loop runs them in bucket order (``sync_params`` is that loop with
#   nothing between buckets; the update's loop writes each bucket's pieces just before).
# - gradient reduction: ``GradShards.start_reduce`` / ``finish_reduce``.
#
# Where the parameters live is the storage of the ParamBuffers, chosen when it is built ([Note:
# parameter storage] in _storage.py): views of the flat buffers, or their own storage synced through
# staging rows.
#
# Collectives must be entered in the same order on every rank. Parameter syncs run in bucket
# order (the next forward needs the first buckets first); gradient reductions in reverse bucket
# order (backward produces the last gradients first), each launched as soon as its bucket and
# every later one are ready (see [Note: overlap with backward] in _hooks.py).
#
# [Note: buffer storage]
# ``build_param_buffers`` copies each parameter into its place in its group's buffer and sets
# ``p.data`` to the view of that place, so the module, autograd and the optimizer all see the
# same memory.
# A rank's shard of a group is its shards of the group's buckets; in the parameter buffer they
# are apart (one per bucket), so the optimizer state, master weights and gradient shards store
# them end to end instead ("compact" shards, ``shard_numels[rank]`` elements, piece ``k`` at
# ``pieces[k].offset``), and the update reads and writes the parameter buffer through one view
# per piece.
#
# [Note: deferred parameter sync]
# ``step`` ends by launching each bucket's all-gather as soon as the bucket's pieces are updated,
# and by default waits for them all. With ``register_param_hooks`` it updates every piece first,
# then launches the gathers in bucket order and returns at once ([Note: update and gather
# pipeline]); the gathers run while the caller starts the next forward: each module's forward
# pre-hook waits for the buckets holding its parameters (and, in order, those before them: see
# [Note: compiled forward] in _param_hooks.py), so compute on a bucket starts when it has arrived.
# Until then the parameters hold a mix of old and new values, so everything that reads them
# outside a forward waits first: the next ``step`` (its update writes the shards the
# gathers are sending), ``sharded_state_dict``, ``consolidate_state_dict``, ``save_checkpoint``,
# the drop-in's ``state_dict``, and the public ``wait_params(state)`` for the caller's own reads
# (evaluation, logging, the end of training). A rank waits only on its own handles, so this
# needs no collective and cannot hang.


class ParamBuffers(BucketMap):
    """The flat parameter buffers of a plan on one rank, and their bucketed gathers.

    See [Note: engine]. ``buffers[g]`` is the parameter buffer of ``plan.groups[g]``,
    ``pieces`` is ``plan.pieces(rank)``. The gradient options (``reduce_dtype``,
    ``comm_dtype``, ``replicate``) are read by its ``GradShards``.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        buffers: Sequence[torch.Tensor],
        *,
        group: ProcessGroup = None,
        algorithm: Algorithm | str = Algorithm.AUTO,
        reduce_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
        replicate: ProcessGroup | None = None,
        storage: ParamStorage | None = None,
    ) -> None:
        if storage is None:  # (a staged storage serves parameter syncs only: no buffers)
            _check_buffers(plan, buffers)
        self.group = group
        # AUTO made concrete once, for the buffers' device (every group's, where they share it):
        # the collectives then read no process-group fact to choose their calls
        devices = {b.device for b in buffers}
        self.algorithm = Algorithm(algorithm)
        if len(devices) == 1 and dist.is_initialized():
            self.algorithm = resolve_algorithm(self.algorithm, group, devices.pop())
        self.replicate = replicate  # the other replicas' group ([Note: hybrid sharding])
        self._tensor_parallel: Any = None  # see [Note: tensor-parallel norms]
        self._global_places: Any = None  # see [Note: tensor-parallel checkpoints]
        self.reduce_dtype = reduce_dtype
        self.comm_dtype = comm_dtype  # gradients on the wire ([Note: wire dtype])
        super().__init__(plan, rank, buffers)
        self._storage = storage or ViewStorage(
            plan, self.buffers, group=group, algorithm=self.algorithm
        )
        self.scope: Any = None  # the update's core Scope, set by shard's init
        self._params: dict[BucketKey, Pending] = {}
        self._order = {key: i for i, key in enumerate(self.keys)}
        # The buckets keys[:synced] have no parameter sync in flight (the sync frontier).
        self.synced = len(self.keys)
        self._deferring = 0  # registered param hooks: step leaves its gathers in flight

    def set_places(self, tensor_parallel: Any, global_places: Any) -> None:
        """Where the tensors lie beyond this group (``shard``'s init sets them once): their
        tensor-parallel split and their places in the global tensors."""
        self._tensor_parallel, self._global_places = tensor_parallel, global_places

    @property
    def tensor_parallel(self) -> Any:
        """The tensor-parallel split of the tensors, or None (see [Note: tensor-parallel norms])."""
        return self._tensor_parallel

    @property
    def global_places(self) -> Any:
        """Each tensor's place in its global tensor, or None (see [Note: tensor-parallel
        checkpoints])."""
        return self._global_places

    def defer_param_syncs(self, defer: bool) -> None:
        """Counts the registered param hooks up (``defer``) or down: while any is registered,
        ``step`` leaves its gathers in flight ([Note: deferred parameter sync])."""
        self._deferring += 1 if defer else -1

    @property
    def deferred(self) -> bool:
        """Whether ``step`` leaves its parameter gathers in flight (param hooks registered)."""
        return self._deferring > 0

    # -- parameter sync ------------------------------------------------------------------------

    def start_param_sync(self, key: BucketKey) -> None:
        """Launches bucket ``key``'s sync in this storage (see [Note: deferred parameter sync])."""
        self.wait_params((key,))
        self._params[key] = self._storage.gather(key)
        self.synced = min(self.synced, self._order[key])

    def wait_params(self, keys: Iterable[BucketKey] | None = None) -> None:
        """Waits for the parameter syncs in flight of buckets ``keys`` (None: all)."""
        if self._params:
            for key in list(self._params) if keys is None else keys:
                pending = self._params.pop(key, None)
                if pending is not None:
                    pending.wait()
        while self.synced < len(self.keys) and self.keys[self.synced] not in self._params:
            self.synced += 1

    def wait_params_through(self, end: int) -> None:
        """Waits, in bucket order, for the parameter syncs in flight of the first ``end``
        buckets of ``keys``; then ``synced >= end`` (see [Note: compiled forward] in
        _param_hooks.py)."""
        self.wait_params(self.keys[self.synced : end])

    @property
    def params_pending(self) -> bool:
        """Whether some parameter sync is still in flight."""
        return bool(self._params)

    def finish_param_syncs(self) -> None:
        """Waits for every parameter sync in flight, unless param hooks defer them ([Note:
        deferred parameter sync]): the end of a loop of ``start_param_sync`` in bucket order."""
        if not self.deferred:
            self.wait_params()

    def sync_params(self) -> None:
        """Every bucket's parameter sync, in bucket order, then ``finish_param_syncs``."""
        for key in self.keys:
            self.start_param_sync(key)
        self.finish_param_syncs()

    def start_tensor_sync(self, tensors: Sequence[int]) -> list[Pending]:
        """Launches the sync of whole plan ``tensors`` (greedy plan) from their owners, outside
        the bucket order (the DDP comm hooks'); every rank passes the same ``tensors``. Returns
        the handles, whose ``wait()`` completes them."""
        return self._storage.send_tensors(tensors)


def _check_buffers(plan: Plan, buffers: Sequence[torch.Tensor]) -> None:
    if len(buffers) != len(plan.groups):
        raise ValueError(f"ParamBuffers: expected {len(plan.groups)} buffers, got {len(buffers)}")
    for g, (buf, grp) in enumerate(zip(buffers, plan.groups)):
        if buf.dim() != 1 or buf.numel() != grp.numel:
            raise ValueError(
                f"ParamBuffers: expected buffers[{g}] 1-D of {grp.numel} elements, "
                f"got shape {tuple(buf.shape)}"
            )


def build_param_buffers(
    plan: Plan,
    params: Sequence[torch.Tensor],
    rank: int,
    *,
    group: ProcessGroup = None,
    algorithm: Algorithm | str = Algorithm.AUTO,
    reduce_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    replicate: ProcessGroup | None = None,
    storage: str = "views",
) -> ParamBuffers:
    """Allocates the parameter buffers, copies ``params`` in and re-points them as views.

    See [Note: buffer storage]. ``params`` must match ``plan.tensors`` (checked by the caller).
    With ``storage="staged"`` the parameters keep their storage, and the ParamBuffers serves their
    syncs only ([Note: parameter storage]).

    Example:
        >>> from shardopt.core import plan_partition
        >>> params = [torch.ones(2, 2), torch.zeros(3)]
        >>> buffers = build_param_buffers(plan_partition(params, 1, align=8), params, 0)
        >>> params[0].data_ptr() == buffers.buffers[0].data_ptr(), buffers.buffers[0].numel()
        (True, 8)
    """
    if storage == "staged":
        algo = Algorithm(algorithm)
        staged = StagedStorage(plan, params, rank, group=group, algorithm=algo)
        return ParamBuffers(plan, rank, (), group=group, algorithm=algo, storage=staged)
    buffers = []
    with torch.no_grad():
        for grp in plan.groups:
            device = params[grp.tensors[0]].device if grp.tensors else torch.device("cpu")
            dtype = plan.tensors[grp.tensors[0]].torch_dtype if grp.tensors else torch.float32
            buf = torch.zeros(grp.numel, dtype=dtype, device=device)
            for t, offset in zip(grp.tensors, grp.offsets):
                p = local_tensor(params[t])  # see [Note: DTensor parameters]
                view = buf[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
            buffers.append(buf)
    return ParamBuffers(
        plan,
        rank,
        buffers,
        group=group,
        algorithm=algorithm,
        reduce_dtype=reduce_dtype,
        comm_dtype=comm_dtype,
        replicate=replicate,
    )
