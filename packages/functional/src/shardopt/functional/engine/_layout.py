"""The engine: flat buffers in buckets, and the collectives that move them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from shardopt.core import Bucket, Plan
from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._collectives import (
    Algorithm,
    Pending,
    PendingQueue,
    ProcessGroup,
    all_gather_bucket,
    average_across,
    reduce_scatter_bucket,
    reduce_scratch_numel,
    resolve_algorithm,
)

__all__ = ["BucketKey", "FlatLayout", "build_layout", "staging_numel"]

BucketKey = tuple[int, int]  # (plan group, bucket in the group)

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
#   accumulate). See [Note: gradient staging].
#
# [Note: gradient staging]
# A group has two persistent staging buffers used in turn, so packing one bucket overlaps the
# reduction of the previous; each holds the group's largest bucket, so together they are at most
# about 2 * 2 * bucket_numel elements, whatever W (twice that under EXCHANGE, whose all-to-all
# receives into a scratch of the bucket's size: [Note: collective algorithms]). A tensor larger
# than ``bucket_numel`` (an embedding) is a bucket of its own; sizing the persistent buffers
# for it would keep twice its gradient alive between steps, so it is packed into a buffer of its
# own that lives only until its reduction completes (in stage 2 its full gradient is freed as
# soon as it is packed, so the moment's peak is one such gradient more).
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


class FlatLayout:
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
        replicate: ProcessGroup | None = None,
    ) -> None:
        _check_buffers(plan, buffers)
        self.plan, self.rank, self.buffers = plan, rank, tuple(buffers)
        self.group, self.algorithm = group, Algorithm(algorithm)
        self.replicate = replicate  # the other replicas' group ([Note: hybrid sharding])
        self._tensor_parallel: Any = None  # see [Note: tensor-parallel norms]
        self._global_places: Any = None  # see [Note: tensor-parallel checkpoints]
        self.reduce_dtype = reduce_dtype
        self.pieces = plan.pieces(rank)
        self._map_buckets()
        self.grad_shards: tuple[torch.Tensor | None, ...] = (None,) * len(plan.groups)
        self._staging: list[torch.Tensor | None] = [None] * len(plan.groups)
        self._slot = [0] * len(plan.groups)
        self._grads = PendingQueue()
        self._params: dict[BucketKey, Pending] = {}
        self._order = {key: i for i, key in enumerate(self.keys)}
        # The buckets keys[:synced] have no parameter sync in flight (the sync frontier).
        self.synced = len(self.keys)
        self._param_views: list[torch.Tensor] | None = None
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
        self.oversized = tuple(oversized(plan, g) for g in range(len(plan.groups)))
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

    # -- where things are ------------------------------------------------------------------------

    def bucket_of(self, tensor: int) -> BucketKey:
        """The (group, bucket) that holds plan tensor ``tensor``."""
        g, b, _ = self.plan.locate(tensor)
        return g, b

    def bucket(self, key: BucketKey) -> Bucket:
        """The plan's bucket ``key``."""
        return self.plan.groups[key[0]].buckets[key[1]]

    def bucket_shard(self, key: BucketKey) -> torch.Tensor:
        """This rank's shard of bucket ``key``, as a view of the parameter buffer."""
        bucket = self.bucket(key)
        start = bucket.shard_start(self.rank)
        return self.buffers[key[0]][start : start + bucket.shards[self.rank]]

    def compact(self, shards: Sequence[torch.Tensor], key: BucketKey) -> torch.Tensor:
        """Bucket ``key``'s part of compact shards ``shards`` (one per group)."""
        off = self.shard_offsets[key]
        return shards[key[0]][off : off + self.bucket(key).shards[self.rank]]

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

    def piece_views(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's elements of compact shards ``shards`` (one per group), as 1-D views."""
        return [shards[p.group][p.offset : p.offset + p.numel] for p in self.pieces]

    def grad_views(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each piece's elements of full gradients ``grads`` (one per plan tensor), as views."""
        out: list[torch.Tensor | None] = []
        for p in self.pieces:
            g = grads[p.tensor]
            out.append(None if g is None else g.view(-1)[p.start : p.stop])
        return out

    def address_of(self, t: int) -> int:
        """Where plan tensor ``t``'s elements start in its group's buffer (a memory address)."""
        g, _, offset = self.plan.locate(t)
        return self.buffers[g].data_ptr() + offset * self.buffers[g].element_size()

    def check_views(self, params: Sequence[torch.Tensor]) -> str | None:
        """None if ``params`` are still the views of the buffers made by ``init``, else why not."""
        if len(params) != len(self.plan.tensors):
            return f"{len(self.plan.tensors)} parameters (as in the plan), got {len(params)}"
        for t, p in enumerate(map(local_tensor, params)):
            moved = p.numel() > 0 and p.data_ptr() != self.address_of(t)
            if moved or tuple(p.shape) != self.plan.tensors[t].shape:
                return (
                    f"the parameters given to init (views of the flat buffers), got params[{t}] "
                    "elsewhere"
                )
        return None

    # -- parameter sync ------------------------------------------------------------------------

    def start_param_sync(self, key: BucketKey) -> None:
        """Launches the all-gather of bucket ``key`` (see [Note: deferred parameter sync])."""
        self.wait_params((key,))
        bucket = self.bucket(key)
        pending = all_gather_bucket(
            self.buffers[key[0]], bucket, group=self.group, async_op=True, algorithm=self.algorithm
        )
        self._params[key] = pending
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

    def sync_params(self) -> None:
        """Every bucket's parameter sync, launched in bucket order and waited for."""
        for key in self.keys:
            self.start_param_sync(key)
        self.wait_params()

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
        return tuple(s for s in self._staging if s is not None)

    def _staging_for(self, key: BucketKey) -> tuple[torch.Tensor, torch.Tensor, Hashable]:
        """Bucket ``key``'s staging, its reduction's scratch (maybe empty) and their tag."""
        g, bucket = key[0], self.bucket(key)
        dtype = self.reduce_dtype or self.buffers[g].dtype
        device = self.buffers[g].device
        algo = resolve_algorithm(self.algorithm, self.group, device)
        numel = bucket.numel + reduce_scratch_numel(bucket, algo)
        if key[1] in self.oversized[g]:
            buf = torch.empty(numel, dtype=dtype, device=device)
            return buf[: bucket.numel], buf[bucket.numel :], key
        slots = self._staging[g]
        if slots is None:
            regular = len(self.plan.groups[g].buckets) - len(self.oversized[g])
            count = 2 if regular > 1 else 1
            shape = (count, staging_numel(self.plan, g, algo) // count)
            slots = self._staging[g] = torch.empty(shape, dtype=dtype, device=device)
        slot = self._slot[g]
        self._slot[g] = (slot + 1) % slots.shape[0]
        self._grads.release((g, slot))  # the slot's previous reduction must be done
        row = slots[slot]
        return row[: bucket.numel], row[bucket.numel : numel], (g, slot)

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
        pending = reduce_scatter_bucket(
            staging,
            bucket,
            part,
            accumulate=accumulate and part is out,
            group=self.group,
            async_op=True,
            algorithm=self.algorithm,
            scratch=scratch,
        )
        if part is not out:
            pending = average_across(
                pending, part, out, accumulate=accumulate, group=self.replicate
            )
        self._grads.push(tag, pending)

    @property
    def grads_pending(self) -> bool:
        """Whether some gradient sync is still in flight."""
        return len(self._grads) > 0

    def finish_grad_sync(self) -> None:
        """Waits for every gradient sync in flight (their shards are then complete)."""
        self._grads.wait_all()


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
    replicate: ProcessGroup | None = None,
) -> FlatLayout:
    """Allocates the flat buffers, copies ``params`` in and re-points them as views.

    See [Note: flat storage]. ``params`` must match ``plan.tensors`` (checked by the caller).

    Example:
        >>> from shardopt.core import plan_partition
        >>> params = [torch.ones(2, 2), torch.zeros(3)]
        >>> layout = build_layout(plan_partition(params, 1, align=8), params, 0)
        >>> params[0].data_ptr() == layout.buffers[0].data_ptr(), layout.buffers[0].numel()
        (True, 8)
    """
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
        replicate=replicate,
    )


def oversized(plan: Plan, g: int) -> frozenset[int]:
    """The buckets of group ``g`` that are one tensor of ``plan.bucket_numel`` elements or more
    (their gradients go through a staging buffer of their own: [Note: gradient staging])."""
    if plan.bucket_numel is None:
        return frozenset()
    count: dict[int, int] = {}
    big: set[int] = set()
    for t in plan.groups[g].tensors:
        _, b, _ = plan.locate(t)
        count[b] = count.get(b, 0) + 1
        if plan.tensors[t].numel >= plan.bucket_numel:
            big.add(b)
    return frozenset(b for b in big if count[b] == 1)


def staging_numel(plan: Plan, g: int, algorithm: Algorithm = Algorithm.COLLECTIVE) -> int:
    """Elements of group ``g``'s persistent gradient staging under the concrete ``algorithm``:
    two slots (one if the group has a single bucket), each holding any of its buckets that is
    not :func:`oversized` with that bucket's reduction scratch (see [Note: gradient staging])."""
    skip = oversized(plan, g)
    buckets = [x for b, x in enumerate(plan.groups[g].buckets) if b not in skip]
    largest = max((b.numel + reduce_scratch_numel(b, algorithm) for b in buckets), default=0)
    return largest * (2 if len(buckets) > 1 else 1)
