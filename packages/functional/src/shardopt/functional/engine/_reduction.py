"""The gradient side of the engine: this rank's gradient shards, the staging their buckets are
packed in, the reduce-scatters that fill them, and each bucket's readiness (``GradShards``);
the reduction strategy chosen once: sums in the staging's dtype, or a narrower wire with wider
sums."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from shardopt.core import Bucket
from shardopt.functional.engine._buckets import BucketKey
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    PendingQueue,
    ProcessGroup,
    all_gather_rows,
    average_across,
    reduce_scatter_bucket,
    scratch_of,
)
from shardopt.functional.engine._failure import completed
from shardopt.functional.engine._staging import GradStaging

if TYPE_CHECKING:
    from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["GradShards", "PlainReduction", "Reduction", "WireReduction", "replica_chunks"]

# [Note: gradient shards]
# The gradient half of the engine, apart from the parameter half (``ParamBuffers``) and owned by
# the one that reduces: ``GradReducer`` in _hooks.py (a sharded state that reduces gradients
# has one; stage 1 with ``grads_averaged`` has none). It reads the parameter buffers' buckets and
# options (group, algorithm, ``reduce_dtype``, ``comm_dtype``, ``replicate``) and never calls back:
#
# - ``start_reduce(key, grads)`` / ``finish_reduce()``: a bucket's tensors are whole and
#   adjacent, so their local gradients are packed end to end into a staging buffer of the
#   bucket's size (zeros for padding and for missing gradients), reduce-scattered in place, and
#   the rank's shard of the sum, divided by W, lands in its gradient shard (copied, or added to
#   accumulate). See [Note: gradient staging] in _staging.py.
# - readiness (``expect`` / ``mark_ready`` / ``unstarted``): during backward it counts the
#   gradients each bucket still waits for; ``mark_ready(t)`` returns the buckets that tensor
#   ``t``'s gradient makes ready to launch, in reverse bucket order, and the reducer launches
#   them itself ([Note: overlap with backward] in _hooks.py).

# [Note: wire dtype]
# ``shard(..., comm_dtype=torch.bfloat16)`` puts gradients on the wire in bfloat16 but sums them
# in float32 (in ``reduce_dtype`` where given; in the group's dtype where it is wider): a
# reduce-scatter or all-reduce in bfloat16 rounds the partial sum at every hop of its ring (DDP's
# ``bf16_compress_hook``, FSDP2's ``reduce_dtype=bfloat16``), so each element of the result
# carries up to W - 1 roundings of growing partial sums. Here each local gradient is rounded once,
# when it is packed into the (bfloat16) staging; one ``all_to_all_single`` sends block r of the
# packed bucket to rank r (split sizes: the bucket's shards, so greedy buckets of unequal shards
# go the same way), and each owner sums the W copies of its shard in float32, in rank order
# (received into a scratch of W times the largest shard, beside the staging), divides by W and
# stores the result in its gradient shard's dtype. The bytes on the wire are half of float32's;
# the bytes per rank equal a reduce-scatter's ((W - 1) / W of the bucket).
# On a hybrid mesh the replicas' step goes the same way: each replica's averaged shard part is
# rounded once more into bfloat16 and split into R chunks (``replica_chunks``); one all-to-all
# sends chunk j to replica j, which sums the R copies in float32 (rank order), and one
# all-gather in the gradient shard's dtype (no rounding there for a float32 shard) gives every
# replica the whole part. Two roundings per element in all, one per level of the mesh; per rank
# (R - 1) / R of the part in bfloat16 plus (R - 1) / R in the shard's dtype, against
# 2 (R - 1) / R in the shard's dtype for the all-reduce (0.75 of it for float32 shards).
# Whatever ``algorithm`` says for parameters, these reductions use these calls; the cost model
# prices them with the same rules (``reduce_scratch_numel``, ``bucket_calls`` with ``widened``,
# ``replica_chunks``). The ParamBuffers picks its Reduction once, at construction (``WireReduction``
# with a ``comm_dtype``, ``PlainReduction`` without).


class PlainReduction:
    """Sums in the staging's dtype by the calls ``algorithm`` says ([Note: collective
    algorithms]); replicas by one all-reduce. Like every Reduction: ``bucket`` launches the
    average of a bucket's packed ``staging`` into this rank's shard ``out`` (added, with
    ``accumulate``), ``across`` then averages a replica's ``part`` over the replicas into
    ``out``; ``g`` is the plan group."""

    widened = False

    def __init__(
        self, group: ProcessGroup, replicate: ProcessGroup | None, algorithm: Algorithm
    ) -> None:
        self.group, self.replicate, self.algorithm = group, replicate, algorithm

    def bucket(
        self,
        g: int,
        staging: torch.Tensor,
        bucket: Bucket,
        out: torch.Tensor,
        *,
        accumulate: bool,
        scratch: torch.Tensor | None,
    ) -> Pending:
        return reduce_scatter_bucket(
            staging,
            bucket,
            out,
            accumulate=accumulate,
            group=self.group,
            async_op=True,
            algorithm=self.algorithm,
            scratch=scratch,
        )

    def across(
        self, g: int, pending: Pending, part: torch.Tensor, out: torch.Tensor, *, accumulate: bool
    ) -> Pending:
        return average_across(pending, part, out, accumulate=accumulate, group=self.replicate)


class WireReduction:
    """Gradients on the wire in the staging's dtype, summed in ``sums[g]`` ([Note: wire
    dtype])."""

    widened = True

    def __init__(
        self,
        group: ProcessGroup,
        replicate: ProcessGroup | None,
        wire: torch.dtype,
        sums: tuple[torch.dtype, ...],
    ) -> None:
        self.group, self.replicate, self.wire, self.sums = group, replicate, wire, sums

    def bucket(
        self,
        g: int,
        staging: torch.Tensor,
        bucket: Bucket,
        out: torch.Tensor,
        *,
        accumulate: bool,
        scratch: torch.Tensor | None,
    ) -> Pending:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        n = bucket.shards[rank]
        work: Any = None
        if world > 1 and bucket.numel:
            received = scratch_of(scratch, staging, world * n)
            work = dist.all_to_all_single(
                received, staging, [n] * world, list(bucket.shards), group=self.group, async_op=True
            )
        else:
            lo = bucket.shard_start(rank) - bucket.start
            received = staging[lo : lo + n]
        total = self.sums[g]
        return Pending(work, lambda: _store(received.view(world, n), total, out, accumulate))

    def across(
        self, g: int, pending: Pending, part: torch.Tensor, out: torch.Tensor, *, accumulate: bool
    ) -> Pending:
        def finish() -> None:
            replicas = dist.get_world_size(self.replicate)
            sizes = replica_chunks(part.numel(), replicas)
            j = dist.get_rank(self.replicate)
            received = part.new_empty(replicas * sizes[j], dtype=self.wire)
            completed(
                dist.all_to_all_single(
                    received,
                    part.to(self.wire),
                    [sizes[j]] * replicas,
                    sizes,
                    group=self.replicate,
                    async_op=True,
                )
            )
            mine = out.new_zeros(sizes[0])  # every chunk padded to the first, the largest
            _store(received.view(replicas, sizes[j]), self.sums[g], mine[: sizes[j]], False)
            rows = all_gather_rows(mine, group=self.replicate)
            whole = torch.cat([row[:n] for row, n in zip(rows, sizes)])
            if accumulate:
                out.add_(whole)
            else:
                out.copy_(whole)

        return Pending([pending], finish)


Reduction: TypeAlias = PlainReduction | WireReduction
LocalGrads: TypeAlias = Mapping[int, "torch.Tensor | None"] | Sequence["torch.Tensor | None"]


def _reduction_for(param_buffers: ParamBuffers) -> Reduction:
    """The gradient reduction (chosen once): on a ``comm_dtype`` wire, summed in
    ``reduce_dtype`` or the wider of float32 and each group's dtype; else plain."""
    if param_buffers.comm_dtype is None:
        return PlainReduction(param_buffers.group, param_buffers.replicate, param_buffers.algorithm)
    dtypes = [getattr(torch, g.dtype) for g in param_buffers.plan.groups]
    sums = tuple(
        param_buffers.reduce_dtype or torch.promote_types(torch.float32, d) for d in dtypes
    )
    return WireReduction(
        param_buffers.group, param_buffers.replicate, param_buffers.comm_dtype, sums
    )


_SHARD = ("gradient shard",)
DIRECT_NUMEL = (
    1 << 16
)  # [Note: one rank's gradients]  # the tag of views of the gradient shards themselves

# [Note: one rank's gradients]
# In a world of one rank (and no replicas, no wire dtype) the average of the local gradients is
# the gradients. Stage 1 without hooks and without the health check then steps on them as they
# are, where the tensors are large (DIRECT_NUMEL elements or more on average): no
# copy, the update over each bucket's pieces ([Note: prepared bucket updates]). Elsewhere a
# bucket is packed straight into its part of the gradient shard (at W = 1 the rank's shard of a
# bucket is the whole bucket, laid out alike), with no staging and no collective: one foreach
# copy, after which the bucket can be updated as one tensor, cheaper than a list of many small
# pieces. Accumulation (a second backward pass before the step, with hooks) still goes through
# the staging, whose reduction adds.


class GradShards:
    """This rank's compact gradient shard of each group of ``param_buffers``, and the bucket
    reductions that fill them (see [Note: gradient shards])."""

    def __init__(self, param_buffers: ParamBuffers) -> None:
        self.param_buffers = param_buffers
        self.reduction = _reduction_for(param_buffers)  # [Note: wire dtype]
        self._shards: tuple[torch.Tensor, ...] = ()
        self._staging: GradStaging | None = None
        self._queue = PendingQueue()
        # (staging tag, bucket) -> each tensor's view of that staging row, and its padding's
        self._views: dict[tuple[Hashable, BucketKey], Any] = {}
        # one rank, no replicas, gradients in the shards' dtype: [Note: one rank's gradients]
        self._alone: bool | None = None  # (known at first use: it needs the group)
        self._direct: bool | None = None
        self.order = tuple(reversed(param_buffers.keys))  # the launch order: the last bucket first
        # each plan tensor's bucket, by its position in the launch order
        where = {key: i for i, key in enumerate(self.order)}
        self.position = tuple(
            where[param_buffers.touching[t]] for t in range(len(param_buffers.plan.tensors))
        )
        self.left = [0] * len(self.order)  # gradients each bucket (in launch order) waits for
        self.next_position = 0  # the next bucket of order to launch

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """The gradient shards (allocated, zero, on first use)."""
        if not self._shards:
            param_buffers = self.param_buffers
            self._shards = tuple(
                torch.zeros(
                    grp.shard_numels[param_buffers.rank],
                    dtype=param_buffers.reduce_dtype or param_buffers.buffers[g].dtype,
                    device=param_buffers.buffers[g].device,
                )
                for g, grp in enumerate(param_buffers.plan.groups)
            )
        return self._shards

    @property
    def allocated_shards(self) -> tuple[torch.Tensor, ...]:
        """The gradient shards if allocated (none before the first reduction)."""
        return self._shards

    @property
    def staging(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers allocated so far (see :func:`staging_numel`)."""
        return () if self._staging is None else self._staging.allocated

    def _staging_for(self, key: BucketKey) -> tuple[torch.Tensor, torch.Tensor, Hashable]:
        """Bucket ``key``'s staging, its reduction's scratch (maybe empty) and their tag."""
        if self._staging is None:
            param_buffers, groups = self.param_buffers, range(len(self.param_buffers.plan.groups))
            dtypes = tuple(
                param_buffers.comm_dtype
                or param_buffers.reduce_dtype
                or param_buffers.buffers[g].dtype
                for g in groups
            )
            devices = tuple(param_buffers.buffers[g].device for g in groups)
            self._staging = GradStaging(
                param_buffers.plan,
                dtypes,
                devices,
                param_buffers.algorithm,
                param_buffers.group,
                widened=self.reduction.widened,
            )
        return self._staging.take(key, self._queue)

    def start_reduce(self, key: BucketKey, grads: LocalGrads, *, accumulate: bool) -> None:
        """Packs bucket ``key``'s local gradients (``grads[t]`` per plan tensor ``t`` of it:
        a list over the plan, or a dict over the bucket) and launches their average into this
        rank's gradient shard (added to it with ``accumulate``)."""
        param_buffers, shards = self.param_buffers, self.shards
        out = param_buffers.compact(shards, key)
        if self.alone and not accumulate:  # [Note: one rank's gradients]
            self._pack(key, out, _SHARD, grads)
            return
        staging, scratch, tag = self._staging_for(key)
        self._pack(key, staging, tag, grads)
        part = out if param_buffers.replicate is None else torch.empty_like(out)
        g = key[0]
        pending = self.reduction.bucket(
            g,
            staging,
            param_buffers.bucket(key),
            part,
            accumulate=accumulate and part is out,
            scratch=scratch,
        )
        if part is not out:
            pending = self.reduction.across(g, pending, part, out, accumulate=accumulate)
        self._queue.push(tag, pending)

    @property
    def alone(self) -> bool:
        """One rank, no replicas, no wire dtype: the average of the local gradients is the
        gradients ([Note: one rank's gradients])."""
        if self._alone is None:
            pb = self.param_buffers
            one = dist.get_world_size(pb.group) == 1
            self._alone = one and pb.replicate is None and pb.comm_dtype is None
        return self._alone

    @property
    def direct(self) -> bool:
        """Whether a step without hooks may take the caller's gradients as they are, not
        reduced (alone, with large tensors: [Note: one rank's gradients])."""
        if self._direct is None:  # (once: step asks every step)
            specs = self.param_buffers.plan.tensors
            large = sum(t.numel for t in specs) >= DIRECT_NUMEL * max(1, len(specs))
            self._direct = self.alone and large
        return self._direct

    def _pack(
        self, key: BucketKey, staging: torch.Tensor, tag: Hashable, grads: LocalGrads
    ) -> None:
        """Copies bucket ``key``'s gradients into ``staging`` by one foreach copy, and zeros
        its padding and the places of missing gradients by one foreach zero (see [Note:
        gradient staging]): two operators per bucket, whatever its tensors."""
        views = self._views.get((tag, key))
        if views is None:
            views = self._staging_views(key, staging)
            if tag is _SHARD or key[1] not in self._staging.oversized[key[0]]:  # type: ignore[union-attr]
                self._views[(tag, key)] = views  # a persistent row: the same views next time
        dsts, zeros = views
        srcs = [grads[t] for t in self.param_buffers.bucket_tensors[key]]
        if not all(map(operator.is_not, srcs, repeat(None))):
            zeros = zeros + [d for d, g in zip(dsts, srcs) if g is None]
            dsts = [d for d, g in zip(dsts, srcs) if g is not None]
            srcs = [g for g in srcs if g is not None]
        if zeros:
            torch._foreach_zero_(zeros)
        if srcs:
            torch._foreach_copy_(dsts, srcs)  # type: ignore[arg-type]  # any layout and dtype

    def _staging_views(
        self, key: BucketKey, staging: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each tensor's place in bucket ``key``'s ``staging``, in its shape, and the padding."""
        specs = self.param_buffers.plan.tensors
        dsts = [
            staging[lo : lo + n].view(specs[t].shape)
            for t, lo, n in self.param_buffers.packing[key]
        ]
        return dsts, [staging[lo:hi] for lo, hi in self.param_buffers.gaps[key]]

    @property
    def pending(self) -> bool:
        """Whether some bucket's reduction is still in flight."""
        return len(self._queue) > 0

    def finish_reduce(self) -> None:
        """Waits for every reduction in flight (the shards are then complete)."""
        self._queue.wait_all()

    def expect(self, trainable: Sequence[bool]) -> None:
        """Starts counting a backward pass: each bucket waits for the gradients of its tensors
        ``t`` with ``trainable[t]`` (``left``, by launch position, updated in place)."""
        buckets = self.param_buffers.bucket_tensors
        self.left[:] = [sum([trainable[t] for t in buckets[key]]) for key in self.order]
        self.next_position = 0

    def mark_ready(self, t: int) -> list[BucketKey]:
        """Counts plan tensor ``t``'s gradient ready; returns the buckets to launch now, in
        order: each has all its gradients and every bucket after it is launched. (The gradient
        hooks do the count themselves, then :meth:`take_ready`.)"""
        self.left[self.position[t]] -= 1
        return self.take_ready()

    def take_ready(self) -> list[BucketKey]:
        """The buckets to launch now, in order, counted as launched: from the next one, each
        with all its gradients."""
        start = self.next_position
        while self.next_position < len(self.order) and not self.left[self.next_position]:
            self.next_position += 1
        return list(self.order[start : self.next_position])

    def unstarted(self) -> list[BucketKey]:
        """The buckets not launched in this pass, in launch order (the end of a backward pass,
        where some tensors had no gradient); they count as launched from here."""
        start, self.next_position = self.next_position, len(self.order)
        return list(self.order[start:])


def replica_chunks(numel: int, replicas: int) -> list[int]:
    """How the replicas' step splits a shard part of ``numel`` elements: R nearly equal
    chunks, the larger first ([Note: wire dtype])."""
    base, extra = divmod(numel, replicas)
    return [base + (1 if i < extra else 0) for i in range(replicas)]


def _store(rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, accumulate: bool) -> None:
    """The mean of ``rows`` (one per rank) summed in ``dtype`` in rank order, copied or added
    into ``out``. (Row by row: ``rows.sum(0, dtype=...)`` was slower on the CPU; measured:
    docs/performance.md.)"""
    total = rows[0].to(dtype, copy=True)
    for row in rows[1:]:
        total.add_(row)
    if rows.shape[0] > 1:
        total.div_(rows.shape[0])
    if accumulate:
        out.add_(total)
    else:
        out.copy_(total)
