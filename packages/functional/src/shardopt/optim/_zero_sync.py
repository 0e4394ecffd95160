"""The parameter sync of a greedy partition: every owner's updated parameters to every rank."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Plan
from shardopt.functional._collectives import (
    Algorithm,
    Pending,
    PendingQueue,
    ProcessGroup,
    all_gather_into,
    resolve_algorithm,
)

__all__ = ["STAGING_NUMEL", "ParamSync"]

# Elements of the two staging buffers of one plan group together (16 MiB of float32).
STAGING_NUMEL = 1 << 22
# Parameters of at least this many elements are broadcast in place when staged (1 MiB float32).
DIRECT_NUMEL = 1 << 18

# [Note: greedy parameter sync]
# After the local step, rank r holds the new values of the parameters the plan gives it; in plan
# group g (one dtype and device) they lie end to end from position 0 of r's slice of S_g
# elements (see [Note: plan layout]). The sync sends every slice to every rank, per plan group:
# - views (parameters_as_bucket_view=True): the parameters are views of one flat buffer per plan
#   group, rank r's tensors end to end in block r, the blocks end to end: as shardopt.functional's
#   flat storage (see [Note: flat storage]) but compact. A greedy plan's slices are padded to the
#   largest rank's share, which for a model with a dominant tensor (an embedding) would cost up
#   to W times its size (2.9x the parameters of GPT-2 shapes at W = 8); torch's buckets are
#   exact, and so are ours. Each block is broadcast from its rank, in place (W calls); under
#   COLLECTIVE (NCCL) with equal blocks the buffer is all-gathered in place instead (one call).
# - staged (False): the parameters keep their own storage, as torch's do. Under ROOTED, a
#   parameter of DIRECT_NUMEL elements or more is its own bucket: broadcast in place from its
#   owner, no copy. The other parameters of each rank are packed end to end and cut into chunks;
#   for each chunk the owner copies its elements into its block of a staging buffer of W blocks,
#   the blocks are broadcast (ROOTED) or all-gathered (COLLECTIVE, which packs every parameter:
#   an all-gather takes equal blocks), and the other ranks copy them out into their parameters.
#   Two staging buffers alternate so that unpacking a chunk overlaps the collective of the next;
#   together they hold STAGING_NUMEL elements whatever the model's size, so there is never a
#   second full-size copy of the parameters.
# Either way a sync costs one collective per rank and bucket (ROOTED) or one per bucket
# (COLLECTIVE), never one per small parameter. Frozen parameters are synced with the others, as
# torch does without bucket views (their values do not change, so neither do the results).


@dataclass(frozen=True, slots=True)
class Span:
    """Tensor ``tensor`` of the plan lies at ``pos`` in its owner's slice of its plan group."""

    tensor: int
    pos: int
    numel: int

    @property
    def stop(self) -> int:
        """The position after its last element."""
        return self.pos + self.numel


def _spans(plan: Plan) -> list[list[list[Span]]]:
    """``spans[g][r]``: the tensors rank ``r`` owns in plan group ``g``, by position."""
    assert plan.owners is not None
    out = []
    for group in plan.groups:
        per_rank: list[list[Span]] = [[] for _ in range(plan.world_size)]
        for t, offset in zip(group.tensors, group.offsets):
            r = plan.owners[t]
            per_rank[r].append(Span(t, offset - r * group.shard_numel, plan.tensors[t].numel))
        out.append([sorted(s, key=lambda x: x.pos) for s in per_rank])
    return out


def _read(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return p.detach().reshape(-1)[lo:hi]


def _write(p: torch.Tensor, lo: int, hi: int, src: torch.Tensor) -> None:
    target = p.detach()
    if target.is_contiguous():
        target.view(-1)[lo:hi].copy_(src)
        return
    flat = target.reshape(-1).clone()
    flat[lo:hi].copy_(src)
    target.copy_(flat.view_as(target))


class ParamSync:
    """Syncs the parameters of a greedy plan from their owners (see [Note: greedy parameter sync]).

    With ``views`` the constructor re-points the parameters into flat buffers (``buffers``).
    ``staging_numel`` bounds the two staging buffers of a plan group (without ``views``), where
    parameters of ``direct_numel`` elements or more go in place under ROOTED; ``algorithm`` picks
    the collectives (see [Note: collective algorithms]).
    """

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.Tensor],
        rank: int,
        group: ProcessGroup,
        *,
        views: bool,
        staging_numel: int = STAGING_NUMEL,
        direct_numel: int = DIRECT_NUMEL,
        algorithm: Algorithm | str = Algorithm.AUTO,
    ) -> None:
        if plan.owners is None:
            raise ValueError(f"ParamSync: expected a greedy plan, got strategy {plan.strategy}")
        self.plan, self.params, self.rank, self.group = plan, list(params), rank, group
        self.algorithm = Algorithm(algorithm)
        self.world = plan.world_size
        self.spans = _spans(plan)
        self.used = [[sum(s.numel for s in mine) for mine in g] for g in self.spans]
        self.devices = [self.params[g.tensors[0]].device for g in plan.groups]
        self.where = {
            s.tensor: (g, r, s)
            for g, sg in enumerate(self.spans)
            for r, ss in enumerate(sg)
            for s in ss
        }
        self.starts = [[sum(used[:r]) for r in range(self.world)] for used in self.used]
        self.buffers: list[torch.Tensor] | None = self._view_buffers() if views else None
        self.direct: list[list[tuple[int, Span]]] = []
        self.packed: list[list[list[Span]]] = []
        for g in range(len(plan.groups)):
            rooted = self._algorithm(g) is Algorithm.ROOTED
            direct, packed = _split_staged(self.spans[g], direct_numel if rooted else None)
            self.direct.append(direct)
            self.packed.append(packed)
        self.packed_used = [[sum(s.numel for s in ss) for ss in g] for g in self.packed]
        self._chunk = [
            max(1, min(max(used), staging_numel // (2 * self.world))) for used in self.packed_used
        ]
        self._staging: list[torch.Tensor | None] = [None] * len(plan.groups)

    def _view_buffers(self) -> list[torch.Tensor]:
        """One compact buffer per plan group, the parameters re-pointed as views of it."""
        out = []
        with torch.no_grad():
            for g, group in enumerate(self.plan.groups):
                dtype = self.plan.tensors[group.tensors[0]].torch_dtype
                buf = torch.empty(sum(self.used[g]), dtype=dtype, device=self.devices[g])
                for r, spans in enumerate(self.spans[g]):
                    for s in spans:
                        p = self.params[s.tensor]
                        view = buf[self.starts[g][r] + s.pos : self.starts[g][r] + s.stop]
                        view.copy_(p.detach().reshape(-1))
                        p.data = view.view(p.shape)
                out.append(buf)
        return out

    def _algorithm(self, g: int) -> Algorithm:
        return resolve_algorithm(self.algorithm, self.group, self.devices[g])

    def sync(self) -> None:
        """Sends every owner's parameters to every rank; returns when all have arrived."""
        if self.world == 1:
            return
        queue = PendingQueue()
        for g in range(len(self.plan.groups)):
            if self.buffers is not None:
                queue.push(("views", g), self._sync_views(g))
            else:
                self._sync_staged(g, queue)
        queue.wait_all()

    def _sync_views(self, g: int) -> Pending:
        assert self.buffers is not None
        buf, used, starts = self.buffers[g], self.used[g], self.starts[g]
        if self._algorithm(g) is Algorithm.COLLECTIVE and len(set(used)) == 1:
            mine = buf[starts[self.rank] : starts[self.rank] + used[self.rank]]
            return Pending(all_gather_into(buf, mine, group=self.group, async_op=True))
        works = [
            dist.broadcast(
                buf[starts[r] : starts[r] + n], group_src=r, group=self.group, async_op=True
            )
            for r, n in enumerate(used)
            if n
        ]
        return Pending(works)

    def _staging_for(self, g: int) -> torch.Tensor:
        buf = self._staging[g]
        if buf is None:
            dtype = self.plan.tensors[self.plan.groups[g].tensors[0]].torch_dtype
            buf = torch.empty((2, self.world * self._chunk[g]), dtype=dtype, device=self.devices[g])
            self._staging[g] = buf
        return buf

    def _sync_staged(self, g: int, queue: PendingQueue) -> None:
        for r, span in self.direct[g]:
            queue.push(("direct", g), self._broadcast_whole(r, span))
        n, size = max(self.packed_used[g]), self._chunk[g]
        rooted = self._algorithm(g) is Algorithm.ROOTED
        for k, a in enumerate(range(0, n, size)):
            b = min(a + size, n)
            queue.release((g, k % 2))
            block = self._staging_for(g)[k % 2][: self.world * (b - a)].view(self.world, b - a)
            self._pack(g, a, b, block[self.rank])
            if rooted:
                counts = [min(max(used - a, 0), b - a) for used in self.packed_used[g]]
                works = [
                    dist.broadcast(block[r, :c], group_src=r, group=self.group, async_op=True)
                    for r, c in enumerate(counts)
                    if c
                ]
            else:
                mine = block[self.rank]
                works = [all_gather_into(block.view(-1), mine, group=self.group, async_op=True)]
            finish = functools.partial(self._unpack, g, a, b, block)
            queue.push((g, k % 2), Pending(works, finish))

    def _broadcast_whole(self, r: int, span: Span) -> Pending:
        p = self.params[span.tensor].detach()
        if p.is_contiguous():
            return Pending(dist.broadcast(p, group_src=r, group=self.group, async_op=True))
        tmp = p.contiguous()
        work = dist.broadcast(tmp, group_src=r, group=self.group, async_op=True)

        def finish() -> None:
            p.copy_(tmp)

        return Pending(work, None if r == self.rank else finish)

    def _pack(self, g: int, a: int, b: int, out: torch.Tensor) -> None:
        with torch.no_grad():
            for s in self.packed[g][self.rank]:
                lo, hi = max(s.pos, a), min(s.stop, b)
                if lo < hi:
                    out[lo - a : hi - a].copy_(_read(self.params[s.tensor], lo - s.pos, hi - s.pos))

    def _unpack(self, g: int, a: int, b: int, block: torch.Tensor) -> None:
        with torch.no_grad():
            for r, spans in enumerate(self.packed[g]):
                if r == self.rank:
                    continue
                for s in spans:
                    lo, hi = max(s.pos, a), min(s.stop, b)
                    if lo < hi:
                        p = self.params[s.tensor]
                        _write(p, lo - s.pos, hi - s.pos, block[r, lo - a : hi - a])

    def sync_of(self, params: Sequence[torch.Tensor], *, async_op: bool) -> list[Any]:
        """Starts the sync of just ``params`` from their owners: one broadcast per (plan group,
        owner) and contiguous run. Returns handles with ``wait()`` (collective works, or
        :class:`Pending` s that unpack staged values when waited on); waits first unless
        ``async_op``. Every rank must pass the same parameters in the same order."""
        index = {id(p): t for t, p in enumerate(self.params)}
        by_owner: dict[tuple[int, int], list[Span]] = {}
        for i, p in enumerate(params):
            t = index.get(id(p))
            if t is None:
                raise ValueError(
                    f"ZeroRedundancyOptimizer._sync_params_of: expected parameters of this "
                    f"optimizer, got params[{i}] of shape {tuple(p.shape)} that it does not hold"
                )
            g, r, span = self.where[t]
            by_owner.setdefault((g, r), []).append(span)
        handles: list[Any] = []
        if self.world > 1:
            for (g, r), spans in sorted(by_owner.items()):
                handles.extend(self._broadcast_spans(g, r, sorted(spans, key=lambda s: s.pos)))
        if not async_op:
            for handle in handles:
                handle.wait()
        return handles

    def _broadcast_spans(self, g: int, r: int, spans: list[Span]) -> list[Any]:
        if self.buffers is not None:
            base = self.starts[g][r]
            buf = self.buffers[g]
            return [
                dist.broadcast(
                    buf[base + lo : base + hi], group_src=r, group=self.group, async_op=True
                )
                for lo, hi in _runs(spans)
            ]
        total = sum(s.numel for s in spans)
        dtype = self.plan.tensors[spans[0].tensor].torch_dtype
        tmp = torch.empty(total, dtype=dtype, device=self.devices[g])
        offsets = [0]
        for s in spans:
            offsets.append(offsets[-1] + s.numel)
        if r == self.rank:
            with torch.no_grad():
                for s, o in zip(spans, offsets):
                    tmp[o : o + s.numel].copy_(_read(self.params[s.tensor], 0, s.numel))
        work = dist.broadcast(tmp, group_src=r, group=self.group, async_op=True)
        if r == self.rank:
            return [Pending(work)]

        def finish() -> None:
            with torch.no_grad():
                for s, o in zip(spans, offsets):
                    _write(self.params[s.tensor], 0, s.numel, tmp[o : o + s.numel])

        return [Pending(work, finish)]


def _split_staged(
    spans: list[list[Span]], direct_numel: int | None
) -> tuple[list[tuple[int, Span]], list[list[Span]]]:
    """A plan group's staged sync: the (owner, span) broadcast in place (``direct_numel``
    elements or more; None: none), and per rank the others, re-positioned end to end from 0
    (their places in the packed chunks). See [Note: greedy parameter sync]."""
    direct, packed = [], []
    for r, mine in enumerate(spans):
        pos, rest = 0, []
        for s in mine:
            if direct_numel is not None and s.numel >= direct_numel:
                direct.append((r, s))
            else:
                rest.append(Span(s.tensor, pos, s.numel))
                pos += s.numel
        packed.append(rest)
    return direct, packed


def _runs(spans: list[Span]) -> list[tuple[int, int]]:
    """The maximal runs ``[lo, hi)`` of adjacent spans (sorted by position)."""
    runs: list[tuple[int, int]] = []
    for s in spans:
        if runs and runs[-1][1] == s.pos:
            runs[-1] = (runs[-1][0], s.stop)
        elif s.numel:
            runs.append((s.pos, s.stop))
    return runs
