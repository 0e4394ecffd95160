"""Flat storage: one buffer per plan group, with the parameters re-pointed as views of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardopt.core import Piece, Plan

__all__ = ["Chunk", "FlatLayout", "build_layout", "chunk_width", "make_chunks"]

# [Note: flat storage]
# ``init`` copies each parameter into its place in the flat buffer of its plan group and sets
# ``p.data`` to the view of that place, so the module, autograd and the optimizer all see the same
# memory. Rank ``r``'s slice of a buffer is then a contiguous run of its parameters' elements:
# the update writes into it, and the parameter all-gather of a whole buffer takes that slice as
# its input and the buffer as its output (torch's collectives allow the input to be the rank's
# block of the output), so the gathered values land directly in the parameters: no staging, no
# full-size copy. A bucketed all-gather (a chunk of every slice) cannot be in place, because the
# chunks of the W slices are not adjacent; it goes through a staging buffer of W chunks (the
# broadcasts of the ROOTED algorithm are in place, see [Note: collective algorithms]).
#
# [Note: bucket size]
# ``bucket_numel`` is the size of one collective's whole buffer, all ranks together: a group's
# flat buffer of at most ``bucket_numel`` elements is one chunk (gathered in place), a larger one
# is cut into chunks of ``bucket_numel // W`` elements per rank, rounded down to a multiple of the
# plan's ``align`` (at least ``align``), so every chunk of a flat plan starts aligned like the
# slices ([Note: default alignment] in shardopt.core) at any W, powers of two or not. A staging
# buffer holds W chunks, so it is at most ``bucket_numel`` elements whatever W is (or ``W *
# align`` when ``bucket_numel`` is smaller than that). Per rank and element the traffic is the
# same however the buffer is cut; only the number of calls grows as the buffers shrink. A
# per-rank size instead would make the staging grow with W: ``2 * W * bucket`` elements, e.g. two
# full gradient copies of gpt2-xl per rank at W = 1024 for a gradient shard of 6 MiB.


@dataclass(frozen=True, slots=True)
class Chunk:
    """Elements ``[start, stop)`` of every rank's slice of group ``group``: one collective."""

    group: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"Chunk: expected 0 <= start < stop, got {self.start}, {self.stop}")

    @property
    def numel(self) -> int:
        """Elements per rank."""
        return self.stop - self.start


def chunk_width(plan: Plan, shard_numel: int, bucket_numel: int | None) -> int:
    """Elements per rank of each chunk of a group whose slices have ``shard_numel`` elements.

    See [Note: bucket size]: the whole slice if the group's buffer fits in ``bucket_numel``,
    else ``bucket_numel // world_size`` rounded down to a multiple of ``plan.align`` (at least
    ``plan.align``).

    Example:
        >>> from shardopt.core import plan_partition
        >>> plan = plan_partition([((1000,), "float32")], 4, align=16)
        >>> chunk_width(plan, 256, None), chunk_width(plan, 256, 1024), chunk_width(plan, 256, 200)
        (256, 256, 48)
    """
    if bucket_numel is None or plan.world_size * shard_numel <= bucket_numel:
        return shard_numel
    align = plan.align
    return max(align, bucket_numel // plan.world_size // align * align)


def make_chunks(plan: Plan, bucket_numel: int | None) -> tuple[Chunk, ...]:
    """Splits every group's slice into chunks of :func:`chunk_width` elements (the last shorter).

    ``bucket_numel`` counts the elements of one collective over all ranks
    ([Note: bucket size]); None makes one chunk per group.

    Example:
        >>> from shardopt.core import plan_partition
        >>> plan = plan_partition([((10,), "float32")], 2, align=1)
        >>> [(c.start, c.stop) for c in make_chunks(plan, 4)]
        [(0, 2), (2, 4), (4, 5)]
    """
    chunks = []
    for g, group in enumerate(plan.groups):
        size = chunk_width(plan, group.shard_numel, bucket_numel)
        for start in range(0, group.shard_numel, max(size, 1)):
            chunks.append(Chunk(g, start, min(start + size, group.shard_numel)))
    return tuple(chunks)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where everything of one rank lives: the plan, the flat buffers, the pieces, the chunks.

    ``buffers[g]`` is the flat buffer of ``plan.groups[g]`` (``padded_numel`` elements, the
    parameters are views of it); ``pieces`` is ``plan.pieces(rank)``; ``chunks`` the collectives
    of one parameter sync (or gradient reduction), ordered by (group, start); ``staging[g]``
    the buffers of ``world_size`` chunks for the collectives that cannot be in place (two, used
    in turn, for a group of several chunks; one for a group of one chunk), or None.
    """

    plan: Plan
    rank: int
    buffers: tuple[torch.Tensor, ...]
    pieces: tuple[Piece, ...]
    chunks: tuple[Chunk, ...]
    staging: tuple[torch.Tensor | None, ...]

    def __post_init__(self) -> None:
        if len(self.buffers) != len(self.plan.groups):
            raise ValueError(
                f"FlatLayout: expected {len(self.plan.groups)} buffers, got {len(self.buffers)}"
            )
        for g, (buf, group) in enumerate(zip(self.buffers, self.plan.groups)):
            if buf.dim() != 1 or buf.numel() != group.padded_numel:
                raise ValueError(
                    f"FlatLayout: expected buffers[{g}] 1-D of {group.padded_numel} elements, "
                    f"got shape {tuple(buf.shape)}"
                )

    def shard(self, g: int) -> torch.Tensor:
        """This rank's slice of ``buffers[g]``."""
        n = self.plan.groups[g].shard_numel
        return self.buffers[g][self.rank * n : (self.rank + 1) * n]

    def check_views(self, params: Sequence[torch.Tensor]) -> str | None:
        """None if ``params`` are still the views of the buffers made by ``init``, else why not."""
        if len(params) != len(self.plan.tensors):
            return f"{len(self.plan.tensors)} parameters (as in the plan), got {len(params)}"
        for g, group in enumerate(self.plan.groups):
            base, size = self.buffers[g].data_ptr(), self.buffers[g].element_size()
            for t, offset in zip(group.tensors, group.offsets):
                p = params[t]
                moved = p.numel() > 0 and p.data_ptr() != base + offset * size
                if moved or tuple(p.shape) != self.plan.tensors[t].shape:
                    return (
                        f"the parameters given to init (views of the flat buffers), got "
                        f"params[{t}] elsewhere"
                    )
        return None

    def piece_views(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's elements as a 1-D view into ``shards[piece.group]``."""
        return [shards[p.group][p.offset : p.offset + p.numel] for p in self.pieces]

    def grad_views(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each piece's elements of full gradients ``grads`` (one per plan tensor), as views."""
        out: list[torch.Tensor | None] = []
        for p in self.pieces:
            g = grads[p.tensor]
            out.append(None if g is None else g.view(-1)[p.start : p.stop])
        return out


def build_layout(
    plan: Plan,
    params: Sequence[torch.Tensor],
    rank: int,
    bucket_numel: int | None,
    *,
    needs_staging: Callable[[torch.device, bool], bool] = lambda device, split: split,
) -> FlatLayout:
    """Allocates the flat buffers, copies ``params`` in and re-points them as views.

    See [Note: flat storage]. ``params`` must match ``plan.tensors`` (checked by the caller).
    A group gets staging buffers if ``needs_staging(its device, whether it has several chunks)``.

    Example:
        >>> from shardopt.core import plan_partition
        >>> params = [torch.ones(2, 2), torch.zeros(3)]
        >>> layout = build_layout(plan_partition(params, 1, align=8), params, 0, None)
        >>> params[0].data_ptr() == layout.buffers[0].data_ptr(), layout.buffers[0].numel()
        (True, 8)
    """
    buffers = []
    with torch.no_grad():
        for group in plan.groups:
            device = params[group.tensors[0]].device if group.tensors else torch.device("cpu")
            dtype = plan.tensors[group.tensors[0]].torch_dtype if group.tensors else torch.float32
            buf = torch.zeros(group.padded_numel, dtype=dtype, device=device)
            for t, offset in zip(group.tensors, group.offsets):
                p = params[t]
                view = buf[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
            buffers.append(buf)
    chunks = make_chunks(plan, bucket_numel)
    staging = []
    for g, buf in enumerate(buffers):
        widths = [c.numel for c in chunks if c.group == g]
        make = widths and needs_staging(buf.device, len(widths) > 1)
        slots = 2 if len(widths) > 1 else 1  # two let a chunk's packing overlap the previous one
        staging.append(buf.new_zeros((slots, plan.world_size * max(widths))) if make else None)
    return FlatLayout(plan, rank, tuple(buffers), plan.pieces(rank), chunks, tuple(staging))
