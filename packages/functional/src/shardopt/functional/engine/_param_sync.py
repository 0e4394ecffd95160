"""Parameter syncs by the plan's buckets for parameters outside flat buffers, and of subsets."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardopt.core import Bucket, Plan
from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    PendingQueue,
    ProcessGroup,
    all_gather_bucket,
)
from shardopt.functional.engine._rooted import broadcast_from

__all__ = ["StagedSync", "broadcast_tensors"]

# [Note: staged parameter sync]
# torch's ZeroRedundancyOptimizer without bucket views leaves the parameters in their own
# storage. They are synced by the same buckets as the flat buffers ([Note: engine]): for each
# bucket, in bucket order, the owners copy their tensors into their shard of a staging buffer of
# the bucket's size, the bucket is gathered in place there (all_gather_bucket: the same calls as
# in the flat buffers), and every rank copies the other shards out into its parameters. Two
# staging buffers per group are used in turn, so unpacking one bucket overlaps the collective of
# the next; they hold two of the group's largest buckets, never a second copy of the model. A
# bucket of one tensor (a tensor larger than ``bucket_numel`` is one) is broadcast from its owner
# straight from the parameter: no staging at all.


def _read(p: torch.Tensor) -> torch.Tensor:
    return p.detach().reshape(-1)


def _write(p: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        p.detach().copy_(src.view(p.shape))


class StagedSync:
    """Syncs parameters that keep their own storage from their owners (greedy or flat plans).

    See [Note: staged parameter sync]. ``params`` are the plan's tensors in its order.
    """

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.Tensor],
        rank: int,
        *,
        group: ProcessGroup = None,
        algorithm: Algorithm | str = Algorithm.AUTO,
    ) -> None:
        self.plan, self.rank = plan, rank
        self.params = [local_tensor(p) for p in params]  # see [Note: DTensor parameters]
        self.group, self.algorithm = group, Algorithm(algorithm)
        self._staging: dict[int, torch.Tensor] = {}
        self.world = dist.get_world_size(group)

    def _slots(self, g: int) -> torch.Tensor:
        if g not in self._staging:
            grp = self.plan.groups[g]
            packed = [b for b in grp.buckets if self._direct(g, b) is None]
            largest = max((b.numel for b in packed), default=0)
            slots = 2 if len(packed) > 1 else 1
            p = self.params[grp.tensors[0]]
            self._staging[g] = p.new_empty((slots, largest))
        return self._staging[g]

    def _direct(self, g: int, bucket: Bucket) -> int | None:
        """The tensor of a one-tensor bucket (broadcast in place), else None."""
        grp = self.plan.groups[g]
        inside = [t for t, o in zip(grp.tensors, grp.offsets) if bucket.start <= o < bucket.stop]
        return inside[0] if len(inside) == 1 and self.plan.is_whole(inside[0]) else None

    def sync(self) -> None:
        """Every parameter from its owner; returns when all have arrived."""
        if self.world == 1:
            return
        queue = PendingQueue()
        for g, grp in enumerate(self.plan.groups):
            slot = 0
            for bucket in grp.buckets:
                t = self._direct(g, bucket)
                if t is not None:
                    queue.push(("direct", g), self._broadcast_whole(t))
                    continue
                slots = self._slots(g)
                queue.release((g, slot))
                staging = slots[slot, : bucket.numel]
                queue.push((g, slot), self._gather(g, bucket, staging))
                slot = (slot + 1) % slots.shape[0]
        queue.wait_all()

    def _spans(self, g: int, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(tensor, its position in the bucket, its numel) of each tensor of ``bucket``."""
        grp = self.plan.groups[g]
        return [
            (t, o - bucket.start, self.plan.tensors[t].numel)
            for t, o in zip(grp.tensors, grp.offsets)
            if bucket.start <= o < bucket.stop
        ]

    def _gather(self, g: int, bucket: Bucket, staging: torch.Tensor) -> Pending:
        local = Bucket(0, bucket.shards)
        lo = bucket.shard_start(self.rank) - bucket.start
        hi = lo + bucket.shards[self.rank]
        spans = self._spans(g, bucket)
        with torch.no_grad():
            for t, pos, n in spans:
                a, b = max(pos, lo), min(pos + n, hi)
                if a < b:
                    staging[a:b].copy_(_read(self.params[t])[a - pos : b - pos])
        pending = all_gather_bucket(
            staging, local, group=self.group, async_op=True, algorithm=self.algorithm
        )
        return Pending([pending], functools.partial(self._unpack, spans, staging, lo, hi))

    def _unpack(
        self, spans: list[tuple[int, int, int]], staging: torch.Tensor, lo: int, hi: int
    ) -> None:
        for t, pos, n in spans:
            if lo <= pos and pos + n <= hi:
                continue  # wholly this rank's: already there
            _write(self.params[t], staging[pos : pos + n])

    def _broadcast_whole(self, t: int) -> Pending:
        assert self.plan.owners is not None
        owner, p = self.plan.owners[t], self.params[t].detach()
        if p.is_contiguous():
            return Pending(broadcast_from(p, owner, group=self.group, async_op=True))
        tmp = p.contiguous()
        work = broadcast_from(tmp, owner, group=self.group, async_op=True)

        def finish() -> None:
            p.copy_(tmp)

        return Pending(work, None if owner == self.rank else finish)


def broadcast_tensors(
    plan: Plan,
    params: Sequence[torch.Tensor],
    tensors: Sequence[int],
    rank: int,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    group: ProcessGroup = None,
) -> list[Pending]:
    """Starts sending plan tensors ``tensors`` (greedy plan) from their owners to every rank.

    One broadcast per (group, owner) and run of adjacent tensors in the flat ``buffers`` (the
    parameters are views of them), or, without ``buffers``, one per (group, owner) through a
    packed temporary. Every rank passes the same ``tensors`` in the same order. Returns handles
    whose ``wait()`` completes them (the unpacking included).
    """
    assert plan.owners is not None
    by_owner: dict[tuple[int, int], list[int]] = {}
    for t in tensors:
        g, _, _ = plan.locate(t)
        by_owner.setdefault((g, plan.owners[t]), []).append(t)
    out: list[Pending] = []
    if dist.get_world_size(group) == 1:
        return out
    for (g, owner), mine in sorted(by_owner.items()):
        mine = sorted(set(mine), key=lambda t: plan.locate(t)[2])
        if buffers is not None:
            for lo, hi in _runs(plan, mine):
                view = buffers[g][lo:hi]
                work = broadcast_from(view, owner, group=group, async_op=True)
                out.append(Pending(work))
        else:
            out.append(_broadcast_packed([params[t] for t in mine], owner, rank, group))
    return out


def _runs(plan: Plan, tensors: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs ``[lo, hi)`` of adjacent tensors' elements in their group's buffer."""
    runs: list[tuple[int, int]] = []
    for t in tensors:
        lo = plan.locate(t)[2]
        hi = lo + plan.tensors[t].numel
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        elif hi > lo:
            runs.append((lo, hi))
    return runs


def _broadcast_packed(
    params: Sequence[torch.Tensor], owner: int, rank: int, group: ProcessGroup
) -> Pending:
    params = [local_tensor(p) for p in params]
    sizes = [p.numel() for p in params]
    tmp = params[0].new_empty(sum(sizes))
    pieces = list(tmp.split(sizes))
    if rank == owner:
        with torch.no_grad():
            for piece, p in zip(pieces, params):
                piece.copy_(_read(p))
    work = broadcast_from(tmp, owner, group=group, async_op=True)

    def finish() -> None:
        for piece, p in zip(pieces, params):
            _write(p, piece)

    return Pending(work, None if rank == owner else finish)
