"""Where things are in a plan's buckets on one rank: the index arithmetic every collective reads."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core import Bucket, Plan
from shardopt.core.blocks import local_tensor

__all__ = ["BucketKey", "BucketMap"]

BucketKey = tuple[int, int]  # (plan group, bucket in the group)


class BucketMap:
    """The per-bucket tables of ``plan`` on ``rank``, derived once from the plan (the index
    spaces of [Note: engine glossary]): the bucket keys, each bucket's tensors, pieces and
    packing, where each bucket's shard sits in a compact shard, and views of the parameter
    ``buffers`` (one per plan group; none for a ParamBuffers of staged storage)."""

    def __init__(self, plan: Plan, rank: int, buffers: Sequence[torch.Tensor]) -> None:
        self.plan, self.rank, self.buffers = plan, rank, tuple(buffers)
        self.pieces = plan.pieces(rank)
        self._param_views: list[torch.Tensor] | None = None
        # step() asks for the same views every step: kept with the tensors they view
        self._shard_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # called with the parameters when some are out of place, before they are reported
        self.rebind: Callable[[Sequence[torch.Tensor]], None] | None = None
        self._view_places: tuple[list[int], list[int], list[Any] | None] | None = None
        self._piece_places: list[tuple[int, int, int, bool]] | None = None
        self._compact: dict[BucketKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._map_buckets()

    def _map_buckets(self) -> None:
        """The per-bucket tables every collective and update reads (derived from the plan)."""
        plan, rank = self.plan, self.rank
        self.keys: tuple[BucketKey, ...] = tuple(
            (g, b) for g, grp in enumerate(plan.groups) for b in range(len(grp.buckets))
        )
        self.bucket_tensors: dict[BucketKey, tuple[int, ...]] = {k: () for k in self.keys}
        for t in range(len(plan.tensors)):
            g, b, _ = plan.locate(t)
            self.bucket_tensors[(g, b)] += (t,)
        self._pickers = {key: _picker(tensors) for key, tensors in self.bucket_tensors.items()}
        self.piece_ranges = self._piece_ranges()
        # (tensor, its first element in the bucket, numel) of each bucket's tensors: the packing
        self.packing = {
            key: tuple(
                (t, plan.locate(t)[2] - self.bucket(key).start, plan.tensors[t].numel)
                for t in tensors
            )
            for key, tensors in self.bucket_tensors.items()
        }
        self.gaps = {
            key: _gaps(packing, self.bucket(key).numel) for key, packing in self.packing.items()
        }
        self.touching = tuple(self.bucket_of(t) for t in range(len(plan.tensors)))
        self.shard_offsets = {
            (g, b): sum(x.shards[rank] for x in grp.buckets[:b])
            for g, grp in enumerate(plan.groups)
            for b in range(len(grp.buckets))
        }

    def _piece_ranges(self) -> dict[BucketKey, tuple[int, int]]:
        """The pieces ``[lo, hi)`` of each bucket (pieces are in bucket order)."""
        out = {k: (0, 0) for k in self.keys}
        for key, run in itertools.groupby(
            range(len(self.pieces)), key=lambda i: self.bucket_of(self.pieces[i].tensor)
        ):
            idx = list(run)
            out[key] = (idx[0], idx[-1] + 1)
        return out

    def bucket_of(self, tensor: int) -> BucketKey:
        """The (group, bucket) that holds plan tensor ``tensor``."""
        g, b, _ = self.plan.locate(tensor)
        return g, b

    def bucket(self, key: BucketKey) -> Bucket:
        """The plan's bucket ``key``."""
        return self.plan.groups[key[0]].buckets[key[1]]

    def compact(self, shards: Sequence[torch.Tensor], key: BucketKey) -> torch.Tensor:
        """Bucket ``key``'s part of compact shards ``shards`` (one per group); the view is
        kept with its shard, for the shards that come back every step."""
        shard = shards[key[0]]
        cached = self._compact.get(key)
        if cached is not None and cached[0] is shard:
            return cached[1]
        off = self.shard_offsets[key]
        view = shard[off : off + self.bucket(key).shards[self.rank]]
        self._compact[key] = (shard, view)
        return view

    def piece_views(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's elements of compact shards ``shards`` (one per group), as 1-D views
        (made once per set of shard tensors: step() asks again for the same ones)."""
        cached = self._shard_views
        same = cached is not None and len(cached[0]) == len(shards)
        if same and all(a is b for a, b in zip(cached[0], shards)):  # type: ignore[index]
            return list(cached[1])  # type: ignore[index]
        views = [shards[p.group][p.offset : p.offset + p.numel] for p in self.pieces]
        self._shard_views = (list(shards), views)
        return list(views)

    def grad_views(
        self, grads: Sequence[torch.Tensor | None], *, shaped: bool = False
    ) -> list[torch.Tensor | None]:
        """Each piece's elements of full gradients ``grads`` (one per plan tensor), as 1-D views;
        with ``shaped``, a piece that is a whole tensor is its gradient as it is (no view: no
        operator per tensor, see [Note: prepared bucket updates])."""
        if self._piece_places is None:
            numels = [spec.numel for spec in self.plan.tensors]
            self._piece_places = [
                (p.tensor, p.start, p.stop, p.start == 0 and p.stop == numels[p.tensor])
                for p in self.pieces
            ]
        return [
            None
            if (g := grads[t]) is None
            else (g if shaped else g.view(-1))
            if whole
            else g.view(-1)[a:b]
            for t, a, b, whole in self._piece_places
        ]

    def bucket_shard(self, key: BucketKey) -> torch.Tensor:
        """This rank's shard of bucket ``key``, as a view of the parameter buffer."""
        bucket = self.bucket(key)
        start = bucket.shard_start(self.rank)
        return self.buffers[key[0]][start : start + bucket.shards[self.rank]]

    def copy_shard_out(self, g: int) -> torch.Tensor:
        """This rank's shard of group ``g``'s parameters, compact (a new tensor)."""
        parts = [self.bucket_shard(k) for k in self.keys if k[0] == g]
        return torch.cat(parts) if parts else self.buffers[g].new_zeros(0)

    def copy_shard_in(self, g: int, src: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Writes elements ``[lo, hi)`` of compact shard ``src`` of group ``g`` into the buffer."""
        hi = src.numel() if hi is None else hi
        with torch.no_grad():
            for key in (k for k in self.keys if k[0] == g):
                off = self.shard_offsets[key]
                a, b = max(lo, off), min(hi, off + self.bucket(key).shards[self.rank])
                if a < b:
                    self.bucket_shard(key)[a - off : b - off].copy_(src[a:b])

    def param_views(self) -> list[torch.Tensor]:
        """Each piece's elements of the parameter buffer, as 1-D views (made once)."""
        if self._param_views is None:
            out = []
            for p in self.pieces:
                start = self.plan.locate(p.tensor)[2] + p.start
                out.append(self.buffers[p.group][start : start + p.numel])
            self._param_views = out
        return list(self._param_views)

    def of_bucket(self, key: BucketKey, items: Sequence[Any]) -> list[Any]:
        """``items[t]`` (one per plan tensor) for each tensor ``t`` of bucket ``key``, in its
        order (a slice where they are consecutive, as in one dtype's plan; no Python per tensor
        either way)."""
        return self._pickers[key](items)

    def address_of(self, t: int) -> int:
        """Where plan tensor ``t``'s elements start in its group's buffer (a memory address)."""
        g, _, offset = self.plan.locate(t)
        return self.buffers[g].data_ptr() + offset * self.buffers[g].element_size()

    def _still_views(self, params: Sequence[torch.Tensor]) -> bool:
        """The fast path of check_views: every local tensor where it was, and as it was where
        its shape matters (see [Note: views still in place]); compared at C speed, no Python
        per tensor."""
        bases = [b.data_ptr() for b in self.buffers]
        if self._view_places is None or self._view_places[0] != bases:
            addresses = [self.address_of(t) for t in range(len(self.plan.tensors))]
            whole = any(map(self.plan.is_whole, range(len(self.plan.tensors))))
            shapes = [torch.Size(spec.shape) for spec in self.plan.tensors] if whole else None
            self._view_places = (bases, addresses, shapes)
        _, addresses, shapes = self._view_places
        # (an empty view of the buffer has its place's address too; any other mismatch goes
        # to check_views' slow path, which ignores the addresses of empty tensors)
        if list(map(_DATA_PTR, params)) != addresses:
            return False
        return shapes is None or list(map(_SHAPE, params)) == shapes

    def check_views(self, params: Sequence[torch.Tensor]) -> str | None:
        """None if ``params`` are still the views of the buffers made by ``init``, else why not."""
        if len(params) != len(self.plan.tensors):
            return f"{len(self.plan.tensors)} parameters (as in the plan), got {len(params)}"
        if self._fast_check(params):
            return None
        if self.rebind is not None:  # a strategy for moved parameters, set by the owner
            self.rebind(params)
            if self._fast_check(params):
                return None
        shapes_matter = self._view_places is None or self._view_places[2] is not None
        for t, p in enumerate(map(local_tensor, params)):
            moved = p.numel() > 0 and p.data_ptr() != self.address_of(t)
            if moved or (shapes_matter and tuple(p.shape) != self.plan.tensors[t].shape):
                return (
                    f"the parameters given to init (views of the flat buffers), got params[{t}] "
                    "elsewhere"
                )
        return None

    def _fast_check(self, params: Sequence[torch.Tensor]) -> bool:
        try:
            return self._still_views(params)
        except RuntimeError:  # a tensor without storage of its own (a DTensor): the slow path
            return False


_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")

# [Note: views still in place]
# Every step checks that the parameters are still the views of the buffers that ``init`` made:
# a ``p.data = ...`` (``module.half()``, a re-seat) would leave the update writing a buffer
# nobody reads. The check costs a read per tensor, so its fast path reads one thing per tensor:
# the address. That is enough wherever updates are elementwise over the buffer, which is every
# piece of a plan that cuts tensors: a parameter re-viewed at its own place in another shape is
# still updated exactly (its elements are the buffer's, in any order the update does not see).
# Where a plan owns tensors whole, the update may read them in their shapes (Muon, Adafactor:
# [Note: whole matrices]), so there the shapes are compared too. Anything else found goes to
# the slow path, which names the first parameter out of place.


def _picker(tensors: tuple[int, ...]) -> Any:
    """A function of a list returning its items at ``tensors``, as a list."""
    lo = tensors[0] if tensors else 0
    if tensors == tuple(range(lo, lo + len(tensors))):  # (any one tensor, and none)
        return lambda items: items[lo : lo + len(tensors)]
    get = operator.itemgetter(*tensors)  # two or more: a tuple
    return lambda items: list(get(items))


def _gaps(packing: Sequence[tuple[int, int, int]], numel: int) -> tuple[tuple[int, int], ...]:
    """The ranges of ``[0, numel)`` that no packed tensor covers (padding)."""
    out, end = [], 0
    for _, lo, n in sorted(packing, key=lambda x: x[1]):
        if lo > end:
            out.append((end, lo))
        end = max(end, lo + n)
    if end < numel:
        out.append((end, numel))
    return tuple(out)
