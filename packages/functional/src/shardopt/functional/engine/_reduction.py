"""The gradient side of the engine: this rank's gradient shards, the staging their buckets are
packed in, the reductions that fill them (the strategy: _reduction_strategy.py), and each bucket's
readiness (``GradShards``)."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from shardopt.functional.engine._buckets import BucketKey
from shardopt.functional.engine._collectives import PendingQueue
from shardopt.functional.engine._reduction_strategy import reduction_for
from shardopt.functional.engine._staging import GradStaging

if TYPE_CHECKING:
    from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["GradShards"]

LocalGrads: TypeAlias = Sequence["torch.Tensor | None"]

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

_SHARD = ("gradient shard",)  # the tag of views of the gradient shards themselves
DIRECT_NUMEL = 1 << 16  # [Note: one rank's gradients]

# [Note: one rank's gradients]
# In a world of one rank (and no replicas, no wire dtype) the average of the local gradients is
# the gradients. Stage 1 without hooks and without the health check then steps on them as they
# are, where the tensors are large (DIRECT_NUMEL elements or more on average): no
# copy, the update over each bucket's pieces ([Note: prepared bucket updates]). Elsewhere a
# bucket is packed straight into its part of the gradient shard (at W = 1 the rank's shard of a
# bucket is the whole bucket, laid out alike), with no staging and no collective: one foreach
# copy, after which the bucket can be updated as one tensor, cheaper than a list of many small
# pieces. Accumulation (a second backward pass before the step, with hooks) still goes through
# the staging, whose reduction adds. Gradients averaged already (``grads_averaged=True``, as the
# drop-in's partition="flat" steps) are, at W = 1, what this path makes of local ones, so such a
# shard gets the same reducer there (no hooks: ``register_grad_hooks`` still refuses it) and the
# same one-tensor update. Its price where tensors are small: a gradient shard the size of the
# gradients, paid only by a loop that sets ``.grad`` to None (a loop that keeps them has them
# in the shard: [Note: gradients in the shard]).

# [Note: gradients in the shard]
# Stage 1 keeps the full gradients, and at W = 1 its gradient shard holds them all, laid out as
# the bucket. So, as DDP's ``gradient_as_bucket_view`` does, ``step`` (reading ``.grad``, no
# hooks) makes each ``.grad`` it packed a view of its place in the shard (``point``), with the
# same values; a loop that keeps its gradients (``zero_grad(set_to_none=False)``, accumulation
# over micro-batches) then has backward write them in place, and the next pack finds the
# caller's gradients ARE its views and copies nothing (one identity test per tensor, at C
# speed). A loop that sets ``.grad`` to None gets new tensors from backward: the pack copies them
# as before, and since the views did not stay, they are not made again (``pointing`` stops).
# Nothing in stage 1 writes to the shard but the pack (its clipping is out of place), so the
# values seen through ``.grad`` are the caller's. Gradients passed to ``step`` explicitly would
# be packed over the views: ``unpoint`` first gives each such ``.grad`` its own copy, and views
# are not made again. Only where a shard's dtype is its parameters' (no ``reduce_dtype``) and
# the parameters are plain tensors.


class GradShards:
    """This rank's compact gradient shard of each group of ``param_buffers``, and the bucket
    reductions that fill them (see [Note: gradient shards])."""

    def __init__(self, param_buffers: ParamBuffers) -> None:
        self.param_buffers = param_buffers
        self.reduction = reduction_for(param_buffers)  # [Note: wire dtype]
        self._shards: tuple[torch.Tensor, ...] = ()
        self._staging: GradStaging | None = None
        self._queue = PendingQueue()
        # (staging tag, bucket) -> each tensor's view of that staging row, and its padding's
        self._views: dict[tuple[Hashable, BucketKey], Any] = {}
        # one rank, no replicas, gradients in the shards' dtype: [Note: one rank's gradients]
        self._alone: bool | None = None  # (known at first use: it needs the group)
        self._direct: bool | None = None
        # [Note: gradients in the shard]: whether the last pack copied anything, and whether
        # ``.grad`` may be made views of the shard
        self._copied = False
        self.pointing = param_buffers.reduce_dtype is None and param_buffers.comm_dtype is None
        self._pointed: list[torch.Tensor | None] = []  # each plan tensor's view, where made
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

    def start_reduce(
        self, key: BucketKey, grads: LocalGrads, *, accumulate: bool, of_bucket: bool = False
    ) -> None:
        """Packs bucket ``key``'s local gradients (``grads[t]`` per plan tensor ``t``; with
        ``of_bucket``, one per tensor of the bucket, in its order) and launches their average
        into this rank's gradient shard (added to it with ``accumulate``)."""
        param_buffers, shards = self.param_buffers, self.shards
        out = param_buffers.compact(shards, key)
        if self.alone and not accumulate:  # [Note: one rank's gradients]
            self._pack(key, out, _SHARD, grads, of_bucket)
            return
        staging, scratch, tag = self._staging_for(key)
        self._pack(key, staging, tag, grads, of_bucket)
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
        self,
        key: BucketKey,
        staging: torch.Tensor,
        tag: Hashable,
        grads: LocalGrads,
        of_bucket: bool,
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
        srcs = list(grads) if of_bucket else self.param_buffers.of_bucket(key, grads)
        if not all(map(operator.is_not, srcs, repeat(None))):
            zeros = zeros + [d for d, g in zip(dsts, srcs) if g is None]
            dsts = [d for d, g in zip(dsts, srcs) if g is not None]
            srcs = [g for g in srcs if g is not None]
        if zeros:
            torch._foreach_zero_(zeros)
        if tag is _SHARD and all(map(operator.is_, srcs, dsts)):
            return  # the caller's gradients are the views: [Note: gradients in the shard]
        if srcs:
            torch._foreach_copy_(dsts, srcs)  # type: ignore[arg-type]  # any layout and dtype
            self._copied = True

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

    def point(self, params: Sequence[torch.Tensor]) -> None:
        """After a step's pack of ``params``' ``.grad`` at W = 1: makes each ``.grad`` it copied a
        view of the shard, the first time; stops if the last ones did not stay ([Note:
        gradients in the shard])."""
        copied, self._copied = self._copied, False
        if not (copied and self.pointing and self.alone):
            return
        if self._pointed:  # views made last time were replaced: the loop sets .grad to None
            self.pointing = False  # (those left stay views: ``unpoint`` still finds them)
            return
        buffers = self.param_buffers.buffers
        if [s.dtype for s in self.shards] != [b.dtype for b in buffers]:
            self.pointing = False
            return
        self._pointed = [None] * len(params)
        for key, tensors in self.param_buffers.bucket_tensors.items():
            for t, view in zip(tensors, self._views[(_SHARD, key)][0]):
                p = params[t]
                if p.grad is not None and type(p.grad) is torch.Tensor:
                    p.grad = self._pointed[t] = view

    def are_views(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``grads`` are the views :meth:`point` made (None where it made none): then
        they are valid gradients by construction, and the step need not check them."""
        return bool(self._pointed) and all(map(operator.is_, grads, self._pointed))

    @property
    def has_views(self) -> bool:
        """Whether some ``.grad`` may be a view of the shard (made by :meth:`point`)."""
        return bool(self._pointed)

    def unpoint(self, params: Sequence[torch.Tensor]) -> None:
        """Gives each ``.grad`` that is a view of the shard its own copy, for good ([Note:
        gradients in the shard])."""
        self.pointing = False
        for p, view in zip(params, self._pointed):
            if view is not None and p.grad is view:
                p.grad = view.clone()
        self._pointed = []

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
        of_bucket = self.param_buffers.of_bucket
        self.left[:] = [sum(of_bucket(key, trainable)) for key in self.order]
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
