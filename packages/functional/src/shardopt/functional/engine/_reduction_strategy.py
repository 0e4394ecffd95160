"""How a bucket's packed gradients are averaged into a rank's gradient shard, chosen once per
sharded state: sums in the staging's dtype (``PlainReduction``), or a narrower wire with wider
sums (``WireReduction``, [Note: wire dtype])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from shardopt.core import Bucket
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    ProcessGroup,
    all_gather_rows,
    average_across,
    reduce_scatter_bucket,
    scratch_of,
)
from shardopt.functional.engine._failure import completed

if TYPE_CHECKING:
    from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["PlainReduction", "Reduction", "WireReduction", "reduction_for", "replica_chunks"]

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


def reduction_for(param_buffers: ParamBuffers) -> Reduction:
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
