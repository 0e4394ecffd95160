"""Full-shape tensors of which this rank holds some boxes, for torch.distributed.checkpoint."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from shardopt.core import Piece
from shardopt.functional.engine._mesh import GlobalPlace

__all__ = ["Box", "LocalBoxes", "boxes", "piece_tensor"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)

# [Note: DCP pieces]
# DCP stores a tensor as chunks: boxes (offsets and sizes per dimension) that the ranks write and
# that any later plan reads back by overlap, which is how it reshards. Our pieces are runs
# ``[start, stop)`` of a parameter's flattened elements, not boxes, and rank boundaries fall
# anywhere (flat plans, alignment, greedy gaps), so neither DTensor's ``Shard(0)`` (chunks of
# ``torch.chunk`` sizes) nor a flat per-group tensor fits. But a run of a row-major tensor is
# exactly a few boxes (at most ``2 * ndim - 1``: a partial row, full rows, a partial row, each
# split again one dimension down), and each box is a contiguous view of the piece. So the state
# of a parameter is saved at its own full shape, keyed by name like torch's FQN optimizer state
# dicts, every rank writing the boxes of its pieces. DCP takes such objects through its
# ``_Checkpointable`` protocol (the hook DTensor uses): ``__create_write_items__``,
# ``__create_chunk_list__`` and ``__get_tensor_shard__``; LocalBoxes implements it as a tensor
# subclass without storage (the default planners look tensors up by ``isinstance``), whose only
# use is DCP: any operation on it raises. A parameter held whole by a rank is saved as a plain
# tensor view instead, and replicated values (the per-parameter counts) as plain 0-d views,
# which DCP de-duplicates across ranks.


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``, in order.

    Example:
        >>> [(o, s) for o, s, _ in boxes((3, 4), 2, 11)]
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
        >>> boxes((2, 3), 0, 6), boxes((), 0, 1)
        ([((0, 0), (2, 3), 0)], [((), (), 0)])
    """
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])

    def in_row(row: int, a: int, b: int) -> list[Box]:
        sub = boxes(shape[1:], a, b)
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in sub]

    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    out: list[Box] = []
    lo = start
    if start % inner:
        out += in_row(first, start % inner, inner)
        lo = (first + 1) * inner
    hi = stop // inner * inner
    if hi > lo:
        zeros = (0,) * (len(shape) - 1)
        out.append(((lo // inner, *zeros), ((hi - lo) // inner, *shape[1:]), lo))
    if stop > hi:
        out += in_row(hi // inner, 0, stop - hi)
    return out


# torch >= 2.5 finds DCP's hooks on any tensor by their dunder names; torch 2.4 calls them only
# on subclasses of its ``_Checkpointable`` base, by single-underscore names, the tensor passed
# again.
try:
    from torch.distributed.checkpoint.planner import (  # type: ignore[attr-defined]
        _Checkpointable as _DCPHooks,  # torch 2.4
    )
except ImportError:
    _DCPHooks = object


class LocalBoxes(torch.Tensor, _DCPHooks):
    """A tensor of ``shape`` of which this rank holds ``views`` at ``offsets`` (DCP only).

    See [Note: DCP pieces]. ``parts`` are ``(offsets, view)`` with ``view`` a tensor of the box's
    sizes (a view into the flat storage, so that DCP reads and writes in place).
    """

    _parts: tuple[tuple[torch.Size, torch.Tensor], ...]

    @staticmethod
    def __new__(
        cls, shape: Sequence[int], parts: Sequence[tuple[Sequence[int], torch.Tensor]]
    ) -> LocalBoxes:
        if not parts:
            raise ValueError("LocalBoxes: expected at least one part, got none")
        like = parts[0][1]
        out = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=like.dtype, device=like.device, requires_grad=False
        )
        out._parts = tuple((torch.Size(o), v) for o, v in parts)
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets, view.size()),
                    properties=props,
                    size=self.size(),
                ),
            )
            for offsets, view in self._parts
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, view.size()) for offsets, view in self._parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self._parts:
            if offsets == index.offset:
                return view
        raise ValueError(f"LocalBoxes: no box at offset {index.offset} of {index.fqn}")

    def _create_write_items(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.__create_write_items__(fqn, obj)

    def _create_chunk_list(self, tensor: Any) -> list[ChunkStorageMetadata]:
        return self.__create_chunk_list__()

    def _get_tensor_shard(self, tensor: Any, index: MetadataIndex) -> torch.Tensor:
        return self.__get_tensor_shard__(index)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"LocalBoxes: a checkpoint-only tensor (torch.distributed.checkpoint reads and "
            f"writes its boxes); got the operation {func}"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LocalBoxes(shape={tuple(self.shape)}, boxes={len(self._parts)})"


# [Note: tensor-parallel checkpoints]
# A DTensor parameter is planned by its local tensor ([Note: DTensor parameters]), so a piece's
# boxes ([Note: DCP pieces]) are boxes of the local tensor. The checkpoint stores the full tensor
# instead: each box moves by the local tensor's offset in it (``GlobalPlace``, DTensor's own
# ``__create_chunk_list__``), and the entry has the full shape. Every rank of every
# tensor-parallel group thus writes its own region of one tensor, and a later plan reads the
# regions it needs by overlap, whatever its data-parallel size: (dp=2, tp=2) loads at (dp=1,
# tp=2). Replicas (hybrid sharding) write the same boxes; DCP keeps one of each (it de-duplicates
# write items by key and offset), so a hybrid 2x2 checkpoint is the checkpoint of a 1-D 4 with
# the same plan over 2 ranks, and loads into any plan. Such states are saved and loaded by every
# rank of the default group together (the data-parallel group alone does not hold every region),
# so their mesh must span the world.


def piece_tensor(
    shape: tuple[int, ...], piece: Piece, flat: torch.Tensor, place: GlobalPlace | None
) -> torch.Tensor:
    """The piece's values (``flat``: its run of elements) as a full-shape checkpoint tensor (of
    the full DTensor at ``place``: see [Note: tensor-parallel checkpoints])."""
    if place is None and piece.numel == math.prod(shape):
        return flat.view(shape)
    at = place.offsets if place is not None else (0,) * len(shape)
    parts = [
        (
            tuple(a + b for a, b in zip(at, o)),
            flat[f - piece.start : f - piece.start + math.prod(s)].view(s),
        )
        for o, s, f in boxes(shape, piece.start, piece.stop)
    ]
    return LocalBoxes(shape if place is None else place.shape, parts)
