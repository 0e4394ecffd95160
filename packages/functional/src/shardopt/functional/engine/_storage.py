"""Where the parameters live, and how a bucket of them is synced: the two storages."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

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
from shardopt.functional.engine._staging import Slots

__all__ = ["ViewStorage", "ParamStorage", "StagedStorage"]

# [Note: parameter storage]
# The parameter syncs of a ParamBuffers go through one storage, chosen when the ParamBuffers is
# built and never branched on afterwards (``build_param_buffers(..., storage=)``):
# - "views" (ViewStorage): the parameters are views of the parameter buffers ([Note: buffer
#   storage]); a bucket's sync all-gathers its region of the buffer in place.
# - "staged" (StagedStorage): the parameters keep their own storage, as torch's
#   ZeroRedundancyOptimizer's do without bucket views ([Note: staged parameter sync]); the
#   ParamBuffers has no parameter buffers, and serves parameter syncs only.
# Either answers ``gather(key)`` (bucket ``key``'s sync, launched) and ``send_tensors(tensors)``
# (some whole tensors of a greedy plan from their owners: the DDP comm hooks sync the parameters
# of one DDP bucket at a time, one broadcast per owner and run of adjacent tensors). The
# ParamBuffers keeps the syncs in flight and their order (``start_param_sync``, ``wait_params``,
# ``sync_params``) for both.
#
# [Note: staged parameter sync]
# For each bucket, in bucket order, the owners copy their tensors into their shard of a staging
# row of the bucket's size, the row is gathered in place (all_gather_bucket: the same calls as in
# the flat buffers), and every rank copies the other shards out into its parameters when the
# sync is waited for. Two rows per group are used in turn (``Slots``, as the gradient staging's),
# so unpacking one bucket overlaps the collective of the next; they hold two of the group's
# largest buckets, never a second copy of the model. A bucket of one whole tensor (a tensor
# larger than ``bucket_numel`` is one) is broadcast from its owner straight from the parameter.


class ParamStorage(Protocol):
    """How the parameters of a ParamBuffers are synced (see [Note: parameter storage])."""

    def gather(self, key: tuple[int, int]) -> Pending:
        """Launches bucket ``key``'s sync; the Pending completes it."""

    def send_tensors(self, tensors: Sequence[int]) -> list[Pending]:
        """Launches the sync of whole plan ``tensors`` (greedy plan) from their owners."""


def _owner_runs(plan: Plan, tensors: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """(group, owner, its tensors in buffer order) for ``tensors``, in (group, owner) order."""
    assert plan.owners is not None
    by_owner: dict[tuple[int, int], set[int]] = {}
    for t in tensors:
        by_owner.setdefault((plan.locate(t)[0], plan.owners[t]), set()).add(t)
    return [
        (g, owner, sorted(mine, key=lambda t: plan.locate(t)[2]))
        for (g, owner), mine in sorted(by_owner.items())
    ]


class ViewStorage:
    """Parameters that are views of the parameter ``buffers``."""

    def __init__(
        self,
        plan: Plan,
        buffers: Sequence[torch.Tensor],
        *,
        group: ProcessGroup,
        algorithm: Algorithm,
    ) -> None:
        self.plan, self.buffers = plan, buffers
        self.group, self.algorithm = group, algorithm

    def gather(self, key: tuple[int, int]) -> Pending:
        """The bucket's region of its buffer, all-gathered in place."""
        bucket = self.plan.groups[key[0]].buckets[key[1]]
        return all_gather_bucket(
            self.buffers[key[0]], bucket, group=self.group, async_op=True, algorithm=self.algorithm
        )

    def send_tensors(self, tensors: Sequence[int]) -> list[Pending]:
        """One in-place broadcast per (group, owner) and run of adjacent tensors."""
        if dist.get_world_size(self.group) == 1:
            return []
        out = []
        for g, owner, mine in _owner_runs(self.plan, tensors):
            for lo, hi in _runs(self.plan, mine):
                view = self.buffers[g][lo:hi]
                out.append(Pending(broadcast_from(view, owner, group=self.group, async_op=True)))
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


def _read(p: torch.Tensor) -> torch.Tensor:
    return p.detach().reshape(-1)


def _write(p: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        p.detach().copy_(src.view(p.shape))


class _Packing:
    """One bucket's staged sync through one staging row: this rank's tensors copied in and the
    others' copied out by one foreach copy each, over views made once (a tensor cut by this
    rank's shard, in a flat plan, is copied by its own slice)."""

    def __init__(
        self,
        staging: torch.Tensor,
        spans: list[tuple[int, int, int]],
        lo: int,
        hi: int,
        params: Sequence[torch.Tensor],
    ) -> None:
        self.staging = staging
        Span = tuple[int, int, int]  # wholly this rank's, wholly others', cut by its shard
        mine: list[Span] = []
        others: list[Span] = []
        self.cut: list[Span] = []
        for span in spans:
            _, pos, n = span
            inside, outside = lo <= pos and pos + n <= hi, pos + n <= lo or pos >= hi
            (mine if inside else others if outside else self.cut).append(span)
        self.lo, self.hi, self.params = lo, hi, params
        self.ins = (
            [staging[p : p + n].view(params[t].shape) for t, p, n in mine],
            [params[t] for t, _, _ in mine],
        )
        self.outs = (
            [params[t] for t, _, _ in others],
            [staging[p : p + n].view(params[t].shape) for t, p, n in others],
        )

    @torch.no_grad()
    def pack(self) -> None:
        if self.ins[0]:
            torch._foreach_copy_(
                self.ins[0], self.ins[1]
            )  # (under no_grad: the leaves as they are)
        for t, pos, n in self.cut:
            a, b = max(pos, self.lo), min(pos + n, self.hi)
            if a < b:
                self.staging[a:b].copy_(_read(self.params[t])[a - pos : b - pos])

    @torch.no_grad()
    def unpack(self) -> None:
        if self.outs[0]:
            torch._foreach_copy_(self.outs[0], self.outs[1])
        for t, pos, n in self.cut:
            _write(self.params[t], self.staging[pos : pos + n])


class StagedStorage:
    """Parameters in their own storage, synced through staging rows (see [Note: staged parameter
    sync]). ``params`` are the plan's tensors in its order."""

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.Tensor],
        rank: int,
        *,
        group: ProcessGroup,
        algorithm: Algorithm,
    ) -> None:
        self.plan, self.rank = plan, rank
        self.params = [local_tensor(p) for p in params]  # see [Note: DTensor parameters]
        self.group, self.algorithm = group, algorithm
        self.world = dist.get_world_size(group)
        self.slots: dict[int, Slots] = {}
        self._queue = PendingQueue()  # the staged gathers in flight, by the row they use
        self._packings: dict[tuple[tuple[int, int], Hashable], _Packing] = {}

    def _slots(self, g: int) -> Slots:
        if g not in self.slots:
            grp = self.plan.groups[g]
            packed = [b for b in grp.buckets if self._direct(g, b) is None]
            largest = max((b.numel for b in packed), default=0)
            rows = 2 if len(packed) > 1 else 1
            self.slots[g] = Slots(g, rows, largest, self.params[grp.tensors[0]])
        return self.slots[g]

    def _spans(self, g: int, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(tensor, its position in the bucket, its numel) of each tensor of ``bucket``."""
        grp = self.plan.groups[g]
        return [
            (t, o - bucket.start, self.plan.tensors[t].numel)
            for t, o in zip(grp.tensors, grp.offsets)
            if bucket.start <= o < bucket.stop
        ]

    def _direct(self, g: int, bucket: Bucket) -> int | None:
        """The tensor of a one-tensor bucket (broadcast in place), else None."""
        spans = self._spans(g, bucket)
        t = spans[0][0] if len(spans) == 1 else None
        return t if t is not None and self.plan.is_whole(t) else None

    def gather(self, key: tuple[int, int]) -> Pending:
        """The bucket packed into a staging row, gathered there, unpacked when waited for."""
        if self.world == 1:
            return Pending([])
        g, bucket = key[0], self.plan.groups[key[0]].buckets[key[1]]
        t = self._direct(g, bucket)
        if t is not None:
            return self._broadcast_whole(t)
        row, tag = self._slots(g).take(self._queue)
        lo = bucket.shard_start(self.rank) - bucket.start
        hi = lo + bucket.shards[self.rank]
        packing = self._packings.get((key, tag))
        if packing is None:
            packing = self._packings[(key, tag)] = _Packing(
                row[: bucket.numel], self._spans(g, bucket), lo, hi, self.params
            )
        staging = packing.staging
        packing.pack()
        work = all_gather_bucket(
            staging,
            Bucket(0, bucket.shards),
            group=self.group,
            async_op=True,
            algorithm=self.algorithm,
        )
        pending = Pending([work], packing.unpack)
        self._queue.push(tag, pending)
        return pending

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

    def send_tensors(self, tensors: Sequence[int]) -> list[Pending]:
        """One broadcast per (group, owner) through a packed temporary."""
        if self.world == 1:
            return []
        return [
            self._broadcast_packed([self.params[t] for t in mine], owner)
            for _, owner, mine in _owner_runs(self.plan, tensors)
        ]

    def _broadcast_packed(self, params: Sequence[torch.Tensor], owner: int) -> Pending:
        sizes = [p.numel() for p in params]
        tmp = params[0].new_empty(sum(sizes))
        pieces = list(tmp.split(sizes))
        if self.rank == owner:
            with torch.no_grad():
                for piece, p in zip(pieces, params):
                    piece.copy_(_read(p))
        work = broadcast_from(tmp, owner, group=self.group, async_op=True)

        def finish() -> None:
            for piece, p in zip(pieces, params):
                _write(p, piece)

        return Pending(work, None if self.rank == owner else finish)
