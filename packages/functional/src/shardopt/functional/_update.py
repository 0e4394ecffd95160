"""The shard update and the parameter all-gather, pipelined bucket by bucket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardopt.core import Transformation, update_flat_
from shardopt.functional._collectives import (
    Algorithm,
    PendingQueue,
    ProcessGroup,
    all_gather_params,
)
from shardopt.functional._layout import Chunk, FlatLayout
from shardopt.functional._state import slice_state

__all__ = ["gather_chunk", "gather_params", "update_and_gather"]

# [Note: update and gather pipeline]
# The rank's pieces are updated through core's flat fast path (``update_flat_``), a bucket of
# pieces at a time, group by group; after each bucket, the chunks whose every element is now up
# to date are all-gathered asynchronously, so the gather of chunk k runs while the pieces of
# chunk k + 1 are updated. A piece that straddles a chunk boundary is updated whole with the
# earlier chunk (a piece is the unit of the update: its step count must advance once). A group
# whose flat buffer has at most ``bucket_numel`` elements is one chunk ([Note: bucket size]): its
# gather is in place and group g's gather overlaps group g + 1's update. A state with tensors
# outside its per-piece fields cannot be cut by pieces; it is updated in one call, then gathered.


def gather_chunk(
    layout: FlatLayout,
    k: int,
    queue: PendingQueue,
    group: ProcessGroup,
    algorithm: Algorithm | str = Algorithm.AUTO,
) -> None:
    """Launches the all-gather of ``layout.chunks[k]`` (its group's staging slots in turn).

    The last chunk runs synchronously: nothing is left to overlap it with, and a blocking call
    costs less than an asynchronous one (gloo hands those to a worker thread).
    """
    c: Chunk = layout.chunks[k]
    shard_numel = layout.plan.groups[c.group].shard_numel
    whole = (c.start, c.stop) == (0, shard_numel)
    staging, buffers = None, layout.staging[c.group]
    slot = k % (2 if buffers is None else len(buffers))
    if not whole and buffers is not None:
        queue.release((c.group, slot))
        staging = buffers[slot]
    pending = all_gather_params(
        layout.buffers[c.group],
        shard_numel,
        bucket=None if whole else (c.start, c.stop),
        staging=staging,
        group=group,
        async_op=k < len(layout.chunks) - 1,
        algorithm=algorithm,
    )
    queue.push((c.group, slot), pending)


def gather_params(
    layout: FlatLayout, group: ProcessGroup, algorithm: Algorithm | str = Algorithm.AUTO
) -> None:
    """All-gathers every rank's slices into every rank's buffers (one parameter sync)."""
    queue = PendingQueue()
    for k in range(len(layout.chunks)):
        gather_chunk(layout, k, queue, group, algorithm)
    queue.wait_all()


def _sliceable(inner: Any, n: int) -> bool:
    def is_field(x: Any) -> bool:
        return type(x) is list and len(x) == n

    leaves = pytree.tree_leaves(inner, is_leaf=is_field)
    return not any(isinstance(x, torch.Tensor) for x in leaves)


class _Updater:
    """Updates ranges of pieces in place and copies master weights back into the parameters."""

    def __init__(
        self,
        tx: Transformation,
        inner: Any,
        layout: FlatLayout,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        master: Sequence[torch.Tensor | None],
    ) -> None:
        self.tx, self.inner, self.layout = tx, inner, layout
        self.params, self.grads, self.master = params, grads, master
        self.n = len(layout.pieces)

    def update(self, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        grads = self.grads[lo:hi]
        if any(g is not None for g in grads):
            whole = (lo, hi) == (0, self.n)
            state = self.inner if whole else slice_state(self.inner, self.n, lo, hi)
            update_flat_(self.tx, self.params[lo:hi], grads, state)
        self.copy_master(lo, hi)

    def copy_master(self, lo: int, hi: int) -> None:
        pieces = self.layout.pieces
        for g in {pieces[i].group for i in range(lo, hi)}:
            master = self.master[g]
            if master is None:
                continue
            mine = [pieces[i] for i in range(lo, hi) if pieces[i].group == g]
            a, b = mine[0].offset, mine[-1].offset + mine[-1].numel
            with torch.no_grad():
                self.layout.shard(g)[a:b].copy_(master[a:b])


def update_and_gather(
    tx: Transformation,
    inner: Any,
    layout: FlatLayout,
    grads: Sequence[torch.Tensor | None],
    master: Sequence[torch.Tensor | None],
    group: ProcessGroup,
    algorithm: Algorithm | str = Algorithm.AUTO,
) -> None:
    """Updates this rank's pieces with ``grads`` (one per piece) and syncs the parameters.

    See [Note: update and gather pipeline]. ``inner`` is updated in place.
    """
    shards = [m if m is not None else layout.shard(g) for g, m in enumerate(master)]
    params = layout.piece_views(shards)
    updater = _Updater(tx, inner, layout, params, grads, master)
    queue = PendingQueue()
    if not _sliceable(inner, updater.n):
        updater.update(0, updater.n)
        for k in range(len(layout.chunks)):
            gather_chunk(layout, k, queue, group, algorithm)
        queue.wait_all()
        return
    pieces, i = layout.pieces, 0
    for k, c in enumerate(layout.chunks):
        j = i
        while j < len(pieces) and (
            pieces[j].group < c.group or (pieces[j].group == c.group and pieces[j].offset < c.stop)
        ):
            j += 1
        updater.update(i, j)
        i = j
        gather_chunk(layout, k, queue, group, algorithm)
    updater.update(i, len(pieces))  # pieces of groups without chunks (none in a valid plan)
    queue.wait_all()
