"""Staging: the rotating buffers a bucket's collective packs into (gradients, staged parameters)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from shardopt.core import Plan
from shardopt.functional.engine._collectives import (
    Algorithm,
    PendingQueue,
    ProcessGroup,
    reduce_scratch_numel,
    resolve_algorithm,
)

__all__ = ["GradStaging", "Slots", "oversized", "staging_numel"]

# [Note: gradient staging]
# A group has two persistent staging buffers used in turn, so packing one bucket overlaps the
# reduction of the previous; each holds the group's largest bucket, so together they are at most
# about 2 * 2 * bucket_numel elements, whatever W (twice that under EXCHANGE, whose all-to-all
# receives into a scratch of the bucket's size: [Note: collective algorithms]). A tensor larger
# than ``bucket_numel`` (an embedding) is a bucket of its own; sizing the persistent buffers
# for it would keep twice its gradient alive between steps, so it is packed into a buffer of its
# own that lives only until its reduction completes (in stage 2 its full gradient is freed as
# soon as it is packed, so the moment's peak is one such gradient more). The staged parameter
# storage ([Note: staged parameter sync]) rotates its own two rows the same way (``Slots``).


class Slots:
    """Rows of one buffer handed out in turn; a row is handed out again only once the
    collectives that used it last have completed (``queue`` knows them by the row's tag)."""

    def __init__(self, tag: Hashable, rows: int, numel: int, like: torch.Tensor) -> None:
        self.tag = tag
        self.rows = like.new_empty((rows, numel))
        self._rows = list(self.rows.unbind(0))  # each row's view, made once
        self._next = 0

    def take(self, queue: PendingQueue) -> tuple[torch.Tensor, Hashable]:
        """The next row, free (its last collective completed), and its tag for ``queue``."""
        row = self._next
        self._next = (row + 1) % len(self._rows)
        tag = (self.tag, row)
        queue.release(tag)
        return self._rows[row], tag


class GradStaging:
    """The gradient staging of the buffer groups (see [Note: gradient staging]), allocated on
    first use: ``dtypes[g]`` and ``devices[g]`` are group ``g``'s reduction dtype and device."""

    def __init__(
        self,
        plan: Plan,
        dtypes: tuple[torch.dtype, ...],
        devices: tuple[torch.device, ...],
        algorithm: Algorithm,
        group: ProcessGroup,
        *,
        widened: bool = False,
    ) -> None:
        self.plan, self.dtypes, self.devices = plan, dtypes, devices
        self.algorithm, self.group, self.widened = algorithm, group, widened
        self.oversized = tuple(oversized(plan, g) for g in range(len(plan.groups)))
        self._slots: list[Slots | None] = [None] * len(plan.groups)
        # (bucket, row tag) -> the bucket's staging and scratch in that row: made once
        self._views: dict[tuple[tuple[int, int], Hashable], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def allocated(self) -> tuple[torch.Tensor, ...]:
        """The persistent staging buffers allocated so far."""
        return tuple(s.rows for s in self._slots if s is not None)

    def take(
        self, key: tuple[int, int], queue: PendingQueue
    ) -> tuple[torch.Tensor, torch.Tensor, Hashable]:
        """Bucket ``key``'s staging, its reduction's scratch (maybe empty) and their tag."""
        g = key[0]
        bucket = self.plan.groups[g].buckets[key[1]]
        dtype, device = self.dtypes[g], self.devices[g]
        algo = resolve_algorithm(self.algorithm, self.group, device)
        numel = bucket.numel + reduce_scratch_numel(bucket, algo, widened=self.widened)
        if key[1] in self.oversized[g]:
            buf = torch.empty(numel, dtype=dtype, device=device)
            return buf[: bucket.numel], buf[bucket.numel :], key
        slots = self._slots[g]
        if slots is None:
            regular = len(self.plan.groups[g].buckets) - len(self.oversized[g])
            count = 2 if regular > 1 else 1
            like = torch.empty(0, dtype=dtype, device=device)
            numel_per_row = staging_numel(self.plan, g, algo, widened=self.widened) // count
            slots = self._slots[g] = Slots(g, count, numel_per_row, like)
        row, tag = slots.take(queue)
        views = self._views.get((key, tag))
        if views is None:
            views = self._views[(key, tag)] = (row[: bucket.numel], row[bucket.numel : numel])
        return views[0], views[1], tag


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


def staging_numel(
    plan: Plan, g: int, algorithm: Algorithm = Algorithm.COLLECTIVE, *, widened: bool = False
) -> int:
    """Elements of group ``g``'s persistent gradient staging under the concrete ``algorithm``:
    two slots (one if the group has a single bucket), each holding any of its buckets that is
    not :func:`oversized` with that bucket's reduction scratch (see [Note: gradient staging];
    ``widened``: [Note: wire dtype])."""
    skip = oversized(plan, g)
    buckets = [x for b, x in enumerate(plan.groups[g].buckets) if b not in skip]
    largest = max(
        (b.numel + reduce_scratch_numel(b, algorithm, widened=widened) for b in buckets),
        default=0,
    )
    return largest * (2 if len(buckets) > 1 else 1)
