"""Each bucket's update prepared once: one call per bucket, over the bucket or over its pieces."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardopt.core import InjectHyperparamsState, Transformation
from shardopt.core.blocks import PreparedPieces, prepare_pieces
from shardopt.functional.engine._buckets import BucketKey
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._state import (
    FieldGranularity,
    StateField,
    piece_list_pred,
    piece_slots,
    slice_state,
)

__all__ = ["BucketUpdates", "flat_grads"]

# [Note: prepared bucket updates]
# An elementwise update is the same call on the same tensors at every step: each bucket's pieces,
# their state and their gradient views. So each bucket's update is prepared once, on its first
# step (core's [Note: prepared pieces]), in one of two forms:
#
# - over the bucket: when the bucket's gradients are its part of the gradient shard (what the
#   reduction leaves), every piece starts and ends on a 64-byte boundary of the bucket's shard,
#   and every piece's per-piece values (its step count) are equal, the update runs on the
#   bucket's shard as ONE tensor: the parameter buffer's shard of the bucket, the gradient
#   shard's part, each elementwise field's part, and the first piece's count; the other pieces'
#   per-piece values are then copied from the first (one copy per field). The padding between
#   pieces holds zeros in every one of those tensors and stays zero under an elementwise update.
#   It computes the same bits as the pieces one by one: the kernels are elementwise and cut their
#   work in 64-byte units from each tensor's start (torch's CPU fused kernels split by cache
#   lines, their vector loops are at most 64 bytes wide), so a piece aligned to that unit sees
#   the same lanes either way; a piece that is not aligned (a bias of 10 elements) sends its
#   bucket to the other form.
# - over the pieces: one call over lists of the pieces' views made at preparation (the kernels
#   still loop over the pieces, in C++).
#
# Either serves a bucket whose pieces all have gradients, in the update's dtype (as ``_step``
# gives them) and without master weights; any other bucket, and a transformation without a
# preparer, takes the piece rule, so the paths share one state and compute the same bits.
# Whether the per-piece values are equal is read from the tensors (a host read) when a bucket is
# prepared and again whenever something else wrote them: a bucket that fell back to the piece
# rule (a piece without a gradient skips its step), or a load (the buffers' version counters
# moved while this object did not write them). The preparations hold the state's tensors, so
# they are made again when the state's tensors are another set (the anchor: the state, or the
# inner state of inject_hyperparams, whose values change between steps while its tensors stay),
# and when another transformation steps the state (a ``shard`` of the same plan made anew).

_UNIT_BYTES = 64  # the cache line: the unit torch's CPU fused kernels split their work by


def flat_grads(grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``grads`` as 1-D views (for every path but the prepared ones, where the gradients of
    whole pieces came in their tensors' shapes)."""
    return [g if g is None or g.dim() == 1 else g.view(-1) for g in grads]


class _Bucket:
    """One bucket's preparation: the update over the bucket (or None) and over its pieces."""

    __slots__ = ("equal_slots", "grad", "over_bucket", "over_pieces", "slots")

    def __init__(self) -> None:
        self.over_bucket: PreparedPieces | None = None
        # by whether whole pieces' gradients come in their shapes: the update over the pieces
        self.over_pieces: dict[bool, PreparedPieces | None] = {}
        # each per-piece field's slots of the bucket's pieces: (all, the first, the others)
        self.slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.equal_slots: bool | None = None  # None: to be read
        self.grad: tuple[Any, torch.Tensor | None] = (None, None)  # (shard, its bucket's part)


class BucketUpdates:
    """Each bucket's prepared update for one sharded state (see [Note: prepared bucket
    updates])."""

    def __init__(
        self,
        tx: Transformation,
        param_buffers: ParamBuffers,
        fields: Sequence[StateField],
    ) -> None:
        self.tx, self.param_buffers, self._fields = tx, param_buffers, tuple(fields)
        self._anchor: Any = None
        self._buckets: dict[BucketKey, _Bucket] = {}
        # how each bucket was updated at the last step: "bucket", "pieces" or "rule"
        self.forms: dict[BucketKey, str] = {}
        self._versions: tuple[int, ...] = ()
        self._slot_of = piece_slots(param_buffers)
        self._elementwise = {
            f.path for f in self._fields if f.granularity is FieldGranularity.ELEMENTWISE
        }

    def begin(self, tx: Transformation, inner: Any) -> None:
        """Starts a step of ``tx`` over ``inner``: forgets the preparations of another
        transformation (a state stepped by another ``shard`` of the same plan) or of another set
        of tensors, and what it read of per-piece values that others wrote since."""
        anchor = inner.inner if isinstance(inner, InjectHyperparamsState) else inner
        if anchor is not self._anchor or tx is not self.tx:
            self.tx, self._anchor, self._buckets = tx, anchor, {}
        if self._slot_versions() != self._versions:
            for bucket in self._buckets.values():
                bucket.equal_slots = None

    def end(self) -> None:
        """Ends a step: what the per-piece buffers hold now is this object's doing."""
        self._versions = self._slot_versions()

    def _slot_versions(self) -> tuple[int, ...]:
        return tuple(
            b._version
            for f in self._fields
            if f.granularity is FieldGranularity.PER_PIECE
            for b in f.buffers
        )

    def run(
        self,
        key: BucketKey,
        inner: Any,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        grad_shards: Sequence[torch.Tensor] | None,
        shaped: bool = False,
    ) -> bool:
        """Updates bucket ``key``'s pieces by its prepared update; False if none serves (some
        piece without a gradient, or no preparer): nothing was done, and the bucket's per-piece
        values are read again before it next goes over the bucket. ``grad_shards``: the
        compact gradient shards that ``grads`` are views of, or None; ``shaped``: the gradients
        of whole pieces come in their tensors' shapes (``grad_views(..., shaped=True)``)."""
        lo, hi = self.param_buffers.piece_ranges[key]
        some = grads[lo:hi]
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._prepare(key, inner)
        if lo == hi or not all(map(operator.is_not, some, repeat(None))):
            bucket.equal_slots = None
            self.forms[key] = "rule"
            return False
        if grad_shards is not None and bucket.over_bucket is not None:
            if bucket.equal_slots is None:
                bucket.equal_slots = all(bool((s == first).all()) for s, first, _ in bucket.slots)
            if bucket.equal_slots:
                shard, grad = bucket.grad
                if shard is not grad_shards[key[0]]:
                    grad = self.param_buffers.compact(grad_shards, key)
                    bucket.grad = (grad_shards[key[0]], grad)
                if bucket.over_bucket([grad], inner):  # type: ignore[list-item]
                    for _, first, others in bucket.slots:
                        others.copy_(first)
                    self.forms[key] = "bucket"
                    return True
        if shaped not in bucket.over_pieces:
            bucket.over_pieces[shaped] = self._over_pieces(key, inner, params, shaped)
        over_pieces = bucket.over_pieces[shaped]
        done = over_pieces is not None and over_pieces(some, inner)  # type: ignore[arg-type]
        self.forms[key] = "pieces" if done else "rule"
        if not done:
            bucket.equal_slots = None
        return done

    def _prepare(self, key: BucketKey, inner: Any) -> _Bucket:
        """Bucket ``key``'s update over the bucket, where it can have one."""
        bucket = _Bucket()
        lo, hi = self.param_buffers.piece_ranges[key]
        shard = self.param_buffers.bucket_shard(key) if lo < hi else None
        if shard is not None and self._aligned(key, shard):
            region, slots = self._bucket_state(key, inner, len(self.param_buffers.pieces))
            if region is not None:
                bucket.over_bucket = prepare_pieces(self.tx, [shard], region)
                bucket.slots = slots
        return bucket

    def _over_pieces(
        self, key: BucketKey, inner: Any, params: Sequence[torch.Tensor], shaped: bool
    ) -> PreparedPieces | None:
        """Bucket ``key``'s update over its pieces (``params``' views; in their tensors' shapes
        where whole, with ``shaped``)."""
        lo, hi = self.param_buffers.piece_ranges[key]
        n = len(params)
        state = inner if (lo, hi) == (0, n) else slice_state(inner, n, lo, hi)
        pieces = list(params[lo:hi])
        if shaped:
            pieces, state = self._in_shapes(lo, hi, pieces, state)
        return prepare_pieces(self.tx, pieces, state)

    def _in_shapes(
        self, lo: int, hi: int, pieces: list[torch.Tensor], state: Any
    ) -> tuple[list[torch.Tensor], Any]:
        """``pieces`` and the elementwise fields of ``state`` (theirs) viewed in their tensors'
        shapes where a piece is a whole tensor, as ``grad_views(..., shaped=True)`` gives
        their gradients."""
        specs, elementwise = self.param_buffers.plan.tensors, self._elementwise
        shapes = [
            specs[p.tensor].shape if p.start == 0 and p.stop == specs[p.tensor].numel else None
            for p in self.param_buffers.pieces[lo:hi]
        ]

        def view(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            return [x if s is None else x.view(s) for x, s in zip(xs, shapes)]

        is_field = piece_list_pred(hi - lo)
        leaves, spec = pytree.tree_flatten_with_path(state, is_leaf=is_field)
        out = [
            view(leaf) if is_field(leaf) and pytree.keystr(path) in elementwise else leaf
            for path, leaf in leaves
        ]
        return view(pieces), pytree.tree_unflatten(out, spec)

    def _aligned(self, key: BucketKey, first: torch.Tensor) -> bool:
        """Whether every piece of bucket ``key`` starts and ends on a 64-byte boundary of the
        bucket's shard, in the update's dtype (that of ``first``)."""
        unit = max(1, _UNIT_BYTES // first.element_size())
        pb = self.param_buffers
        lo, hi = pb.piece_ranges[key]
        base = pb.shard_offsets[key]
        return all(
            (p.offset - base) % unit == 0 and (p.stop - p.start) % unit == 0
            for p in pb.pieces[lo:hi]
        )

    def _bucket_state(
        self, key: BucketKey, inner: Any, n: int
    ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """``inner`` with each field's per-piece list replaced by a one-element list: the
        bucket's part of an elementwise field, the first piece's slot of a per-piece field;
        and each per-piece field's slots of the bucket. (None, []) where a per-piece list is not
        a field: the update would see the pieces apart."""
        pb = self.param_buffers
        lo, hi = pb.piece_ranges[key]
        first_slot = self._slot_of[lo]
        by_path = {f.path: f for f in self._fields}
        is_field = piece_list_pred(n)
        leaves, spec = pytree.tree_flatten_with_path(inner, is_leaf=is_field)
        out, slots = [], []
        for path, leaf in leaves:
            if not is_field(leaf):
                out.append(leaf)
                continue
            field = by_path.get(pytree.keystr(path))
            if field is None:
                return None, []
            buf = field.buffers[key[0]]
            if field.granularity is FieldGranularity.ELEMENTWISE:
                out.append([pb.compact(field.buffers, key)])
            else:
                run = buf[first_slot : first_slot + hi - lo]
                slots.append((run, run[0], run[1:]))
                out.append([run[0]])
        return pytree.tree_unflatten(out, spec), slots
