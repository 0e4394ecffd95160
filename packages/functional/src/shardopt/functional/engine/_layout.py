"""The engine: flat buffers in buckets, and the collectives that move them."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from shardopt.core import Plan
from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._buckets import BucketKey, BucketMap
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    PendingQueue,
    ProcessGroup,
)
from shardopt.functional.engine._reduction import PlainReduction, Reduction, WireReduction
from shardopt.functional.engine._staging import GradStaging
from shardopt.functional.engine._storage import FlatStorage, ParamStorage, StagedStorage

__all__ = ["BucketKey", "FlatLayout", "build_layout"]

# [Note: engine]
# One FlatLayout per sharded optimizer owns everything that moves parameters or gradients: the
# flat parameter buffer of each plan group (the parameters are views of it, see
# [Note: flat storage]), the buckets the plan cut it into, this rank's gradient shards, the
# staging of gradient reductions, and the collectives in flight. Everything else maps ranges of
# it: the update reads and writes piece views, the hooks say when a bucket is ready, checkpoints
# read the shards. Its collectives are per bucket and never leave the bucket's memory:
#
# - parameter sync (``start_param_sync`` / ``wait_params``): the bucket's region of the buffer
#   is all-gathered in place, each rank's input being its own shard of it (bucket-major layout,
#   [Note: plan layout] in shardopt.core). No staging, no copy.
# - gradient sync (``start_grad_sync`` / ``finish_grad_sync``): a bucket's tensors are whole and
#   adjacent, so their local gradients are packed end to end into a staging buffer of the
#   bucket's size (zeros for padding and for missing gradients), reduce-scattered in place, and
#   the rank's shard of the sum, divided by W, lands in its gradient shard (copied, or added to
#   accumulate). See [Note: gradient staging] in _staging.py.
# - readiness (``expect_grads`` / ``register_grad_ready``): during backward the layout counts the
#   gradients each bucket still waits for and launches each bucket's gradient sync as soon as it
#   and every later bucket are ready ([Note: overlap with backward] in _hooks.py).
#
# Where the parameters live is the layout's storage, chosen when it is built ([Note: parameter
# storage] in _storage.py): views of the flat buffers, or their own storage synced through
# staging rows.
#
# Collectives must be entered in the same order on every rank. Parameter syncs run in bucket
# order (the next forward needs the first buckets first); gradient syncs in reverse bucket order
# (backward produces the last gradients first), each launched as soon as its bucket and every
# later one are ready (see [Note: overlap with backward] in _hooks.py).
#
# [Note: flat storage]
# ``build_layout`` copies each parameter into its place in its group's buffer and sets ``p.data``
# to the view of that place, so the module, autograd and the optimizer all see the same memory.
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
# [Note: compiled forward] in _hooks.py), so compute on a bucket starts when it has arrived.
# Until then the parameters hold a mix of old and new values, so everything that reads them
# outside a forward waits first: the next ``step`` (its update writes the shards the
# gathers are sending), ``sharded_state_dict``, ``consolidate_state_dict``, ``save_checkpoint``,
# the drop-in's ``state_dict``, and the public ``wait_params(state)`` for the caller's own reads
# (evaluation, logging, the end of training). A rank waits only on its own handles, so this
# needs no collective and cannot hang.


class FlatLayout(BucketMap):
    """The flat buffers of a plan on one rank, and their bucketed collectives.

    See [Note: engine]. ``buffers[g]`` is the parameter buffer of ``plan.groups[g]``,
    ``pieces`` is ``plan.pieces(rank)``, ``grad_shards[g]`` this rank's compact gradient shard
    (None until a gradient sync needs it).
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
        self.group, self.algorithm = group, Algorithm(algorithm)
        self.replicate = replicate  # the other replicas' group ([Note: hybrid sharding])
        self._tensor_parallel: Any = None  # see [Note: tensor-parallel norms]
        self._global_places: Any = None  # see [Note: tensor-parallel checkpoints]
        self.reduce_dtype = reduce_dtype
        self.comm_dtype = comm_dtype  # gradients on the wire ([Note: wire dtype])
        super().__init__(plan, rank, buffers)
        self._storage = storage or FlatStorage(
            plan, self.buffers, group=group, algorithm=self.algorithm
        )
        self._reduction = self._reduction_for(comm_dtype)  # [Note: wire dtype]
        self.grad_shards: tuple[torch.Tensor | None, ...] = (None,) * len(plan.groups)
        self._grad_staging: GradStaging | None = None
        self._grads = PendingQueue()
        self._expected: dict[BucketKey, int] = {}  # gradients each bucket still waits for
        self.scope: Any = None  # the update's core Scope, set by shard's init
        self._next_grad = 0  # the next bucket to launch, in reverse bucket order
        self._params: dict[BucketKey, Pending] = {}
        self._order = {key: i for i, key in enumerate(self.keys)}
        # The buckets keys[:synced] have no parameter sync in flight (the sync frontier).
        self.synced = len(self.keys)
        self._deferring = 0  # registered param hooks: step leaves its gathers in flight

    def _reduction_for(self, comm_dtype: torch.dtype | None) -> Reduction:
        """The gradient reduction (chosen once): on a ``comm_dtype`` wire, summed in
        ``reduce_dtype`` or the wider of float32 and each group's dtype; else plain."""
        if comm_dtype is None:
            return PlainReduction(self.group, self.replicate, self.algorithm)
        dtypes = [getattr(torch, g.dtype) for g in self.plan.groups]
        sums = tuple(self.reduce_dtype or torch.promote_types(torch.float32, d) for d in dtypes)
        return WireReduction(self.group, self.replicate, comm_dtype, sums)

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
        """Launches bucket ``key``'s sync in the layout's storage (see [Note: deferred parameter
        sync])."""
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
        buckets of ``keys``; then ``synced >= end`` (see [Note: compiled forward] in _hooks.py)."""
        self.wait_params(self.keys[self.synced : end])

    @property
    def params_pending(self) -> bool:
        """Whether some parameter sync is still in flight."""
        return bool(self._params)

    def sync_params(self, prepare: Callable[[BucketKey], None] | None = None) -> None:
        """Every bucket's parameter sync, launched in bucket order (``prepare(key)`` just before
        bucket ``key``'s), and waited for unless param hooks defer it ([Note: deferred parameter
        sync]): the one loop of every parameter sync."""
        for key in self.keys:
            if prepare is not None:
                prepare(key)
            self.start_param_sync(key)
        if not self.deferred:
            self.wait_params()

    def start_tensor_sync(self, tensors: Sequence[int]) -> list[Pending]:
        """Launches the sync of whole plan ``tensors`` (greedy plan) from their owners, outside
        the bucket order (the DDP comm hooks'); every rank passes the same ``tensors``. Returns
        the handles, whose ``wait()`` completes them."""
        return self._storage.send_tensors(tensors)

    # -- gradient sync -------------------------------------------------------------------------

    def ensure_grad_shards(self) -> tuple[torch.Tensor, ...]:
        """The compact gradient shards (allocated, zero, on first use)."""
        if any(s is None for s in self.grad_shards):
            self.grad_shards = tuple(
                torch.zeros(
                    grp.shard_numels[self.rank],
                    dtype=self.reduce_dtype or self.buffers[g].dtype,
                    device=self.buffers[g].device,
                )
                for g, grp in enumerate(self.plan.groups)
            )
        return self.grad_shards  # type: ignore[return-value]

    @property
    def staging(self) -> tuple[torch.Tensor, ...]:
        """The gradient staging buffers allocated so far (see :func:`staging_numel`)."""
        return () if self._grad_staging is None else self._grad_staging.allocated

    def _staging_for(self, key: BucketKey) -> tuple[torch.Tensor, torch.Tensor, Hashable]:
        """Bucket ``key``'s staging, its reduction's scratch (maybe empty) and their tag."""
        if self._grad_staging is None:
            groups = range(len(self.plan.groups))
            dtypes = tuple(
                self.comm_dtype or self.reduce_dtype or self.buffers[g].dtype for g in groups
            )
            devices = tuple(self.buffers[g].device for g in groups)
            self._grad_staging = GradStaging(
                self.plan,
                dtypes,
                devices,
                self.algorithm,
                self.group,
                widened=self._reduction.widened,
            )
        return self._grad_staging.take(key, self._grads)

    def start_grad_sync(
        self, key: BucketKey, grad_of: Callable[[int], torch.Tensor | None], *, accumulate: bool
    ) -> None:
        """Packs bucket ``key``'s local gradients and launches their reduce-scatter into this
        rank's gradient shard (added to it with ``accumulate``). See [Note: engine]."""
        shards = self.ensure_grad_shards()
        bucket = self.bucket(key)
        staging, scratch, tag = self._staging_for(key)
        for lo, hi in self.gaps[key]:  # padding: zeros (touched only here, not the whole slot)
            staging[lo:hi].zero_()
        for t, lo, n in self.packing[key]:
            grad = grad_of(t)
            if grad is None:
                staging[lo : lo + n].zero_()
            else:
                staging[lo : lo + n].copy_(grad.reshape(-1))
        out = self.compact(shards, key)
        part = out if self.replicate is None else torch.empty_like(out)
        reduction, g = self._reduction, key[0]
        pending = reduction.bucket(
            g, staging, bucket, part, accumulate=accumulate and part is out, scratch=scratch
        )
        if part is not out:
            pending = reduction.across(g, pending, part, out, accumulate=accumulate)
        self._grads.push(tag, pending)

    @property
    def grads_pending(self) -> bool:
        """Whether some gradient sync is still in flight."""
        return len(self._grads) > 0

    def finish_grad_sync(self) -> None:
        """Waits for every gradient sync in flight (their shards are then complete)."""
        self._grads.wait_all()

    # -- readiness -----------------------------------------------------------------------------

    def expect_grads(self, trainable: Sequence[bool]) -> None:
        """Starts counting a backward pass: each bucket waits for the gradients of its tensors
        ``t`` with ``trainable[t]``."""
        self._expected = {
            key: sum(1 for t in self.bucket_tensors[key] if trainable[t]) for key in self.keys
        }
        self._next_grad = 0

    def register_grad_ready(
        self,
        t: int,
        grad_of: Callable[[int], torch.Tensor | None],
        *,
        accumulate: bool,
        started: Callable[[BucketKey], None],
    ) -> None:
        """Counts plan tensor ``t``'s gradient ready; starts, in reverse bucket order, the
        gradient sync of every bucket whose gradients are all ready and whose later buckets are
        started, calling ``started(key)`` after each."""
        self._expected[self.touching[t]] -= 1
        order = self.keys[::-1]
        while self._next_grad < len(order) and self._expected[order[self._next_grad]] == 0:
            self._start_next_grad_sync(grad_of, accumulate, started)

    def start_remaining_grad_syncs(
        self,
        grad_of: Callable[[int], torch.Tensor | None],
        *,
        accumulate: bool,
        started: Callable[[BucketKey], None],
    ) -> None:
        """Starts the gradient sync of every bucket not started in this pass (the end of a
        backward pass, where some tensors had no gradient)."""
        while self._next_grad < len(self.keys):
            self._start_next_grad_sync(grad_of, accumulate, started)

    def _start_next_grad_sync(
        self,
        grad_of: Callable[[int], torch.Tensor | None],
        accumulate: bool,
        started: Callable[[BucketKey], None],
    ) -> None:
        key = self.keys[len(self.keys) - 1 - self._next_grad]
        self._next_grad += 1
        self.start_grad_sync(key, grad_of, accumulate=accumulate)
        started(key)


def _check_buffers(plan: Plan, buffers: Sequence[torch.Tensor]) -> None:
    if len(buffers) != len(plan.groups):
        raise ValueError(f"FlatLayout: expected {len(plan.groups)} buffers, got {len(buffers)}")
    for g, (buf, grp) in enumerate(zip(buffers, plan.groups)):
        if buf.dim() != 1 or buf.numel() != grp.numel:
            raise ValueError(
                f"FlatLayout: expected buffers[{g}] 1-D of {grp.numel} elements, "
                f"got shape {tuple(buf.shape)}"
            )


def build_layout(
    plan: Plan,
    params: Sequence[torch.Tensor],
    rank: int,
    *,
    group: ProcessGroup = None,
    algorithm: Algorithm | str = Algorithm.AUTO,
    reduce_dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    replicate: ProcessGroup | None = None,
    storage: str = "flat",
) -> FlatLayout:
    """Allocates the flat buffers, copies ``params`` in and re-points them as views.

    See [Note: flat storage]. ``params`` must match ``plan.tensors`` (checked by the caller).
    With ``storage="staged"`` the parameters keep their storage, and the layout serves their
    syncs only ([Note: parameter storage]).

    Example:
        >>> from shardopt.core import plan_partition
        >>> params = [torch.ones(2, 2), torch.zeros(3)]
        >>> layout = build_layout(plan_partition(params, 1, align=8), params, 0)
        >>> params[0].data_ptr() == layout.buffers[0].data_ptr(), layout.buffers[0].numel()
        (True, 8)
    """
    if storage == "staged":
        algo = Algorithm(algorithm)
        staged = StagedStorage(plan, params, rank, group=group, algorithm=algo)
        return FlatLayout(plan, rank, (), group=group, algorithm=algo, storage=staged)
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
    return FlatLayout(
        plan,
        rank,
        buffers,
        group=group,
        algorithm=algorithm,
        reduce_dtype=reduce_dtype,
        comm_dtype=comm_dtype,
        replicate=replicate,
    )
