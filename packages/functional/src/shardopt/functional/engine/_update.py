"""The shard update and the parameter all-gather, pipelined bucket by bucket."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardopt.core import InjectHyperparamsState, Plan, Transformation, update_pieces_
from shardopt.core.blocks import (
    Kind,
    PyTree,
    Scope,
    declared,
    in_scope,
    kind_of,
    needs_whole_tensors,
    probe_kind,
    undeclared_name,
    update_whole_,
    whole_tensor_mask,
)
from shardopt.functional.engine._bucket_update import BucketUpdates, flat_grads
from shardopt.functional.engine._compiled import compiled_update
from shardopt.functional.engine._masters import Masters
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._scope import LocalReducer
from shardopt.functional.engine._state import slice_state

__all__ = [
    "cut_for_whole",
    "probe_scope",
    "reduces",
    "shaped",
    "unshardable",
    "update_and_sync",
]

REDUCING = Kind.PER_TENSOR | Kind.WHOLE_TREE


def _name(tx: Transformation) -> str:
    found = declared(tx)
    return undeclared_name(tx) if found is None else found.name


def unshardable(tx: Transformation) -> str | None:
    """Why ``tx`` cannot be sharded, or None: an undeclared transformation that the probe finds
    not elementwise ([Note: the kind probe] in core). A reducing one over tensors split by tensor
    parallelism is counted over their group too ([Note: reductions over tensor-parallel tensors]
    in _scope.py)."""
    kind = kind_of(tx)
    if kind is None:
        kind, what = probe_kind(tx)
        if kind is not Kind.ELEMENTWISE:
            return (
                f"a transformation that declares its kind or is elementwise, got {_name(tx)}, "
                f"which declares none and whose update of one element reads {what}: declare it "
                "with shardopt.core.blocks.with_kind(tx, Kind.PER_TENSOR / WHOLE_TREE / SHAPED, "
                "name) and take its reductions through the reduction blocks (tensor_norm, "
                "tree_sum_sq, ...), which shard makes whole across ranks"
            )
    return None


# [Note: scopes of sharded updates]
# Every update under shard runs in a scope (core's [Note: reductions across shards]): masks and
# labels resolve on the whole parameters, so every piece of a tensor gets its tensor's label on
# every plan (a matrix cut by a flat plan is still a matrix to ``p.dim()``), and a reducing
# update's blocks are made whole by one all-reduce per call. An elementwise update keeps its
# bucket-by-bucket pipeline, each bucket's call in the scope of its pieces; a reducing one (a
# declared PER_TENSOR or WHOLE_TREE kind) runs once over all pieces, on every rank, since its
# blocks are collectives.


def reduces(tx: Transformation) -> bool:
    """Whether ``tx`` declares reductions over whole tensors or the tree."""
    return bool((kind_of(tx) or Kind.ELEMENTWISE) & REDUCING)


def _narrowed(scope: Scope | None, lo: int, hi: int) -> Scope | None:
    """``scope`` for the pieces ``lo:hi`` alone (an elementwise update, bucket by bucket)."""
    if scope is None:
        return None
    starts = None if scope.starts is None else scope.starts[lo:hi]
    return scope._replace(of_leaf=scope.of_leaf[lo:hi], starts=starts)


def probe_scope(plan: Plan, tree: PyTree) -> Scope:
    """The scope of init's local probes (one probe tensor per plan group, standing for the
    group's first tensor): masks and labels resolve on ``tree``; no collective."""
    firsts = [
        next(t for t, spec in enumerate(plan.tensors) if plan.locate(t)[0] == g)
        for g in range(len(plan.groups))
    ]
    return Scope(tree, tuple(range(len(plan.tensors))), tuple(firsts), LocalReducer())


# [Note: update and gather pipeline]
# The rank's pieces are updated through core's piece fast path (``update_pieces_``) one bucket at a
# time, in bucket order; once a bucket's pieces are updated (and, with master weights, written
# into the rank's shard of the parameter buffer: [Note: master weights] in _masters.py) its
# all-gather is launched, so the gather of
# bucket k runs while the pieces of bucket k + 1 are updated. A piece never straddles buckets
# (tensors are whole in one bucket), so a piece is updated exactly once and its step count
# advances once. With ``register_param_hooks`` the gathers are left in flight when step returns
# ([Note: deferred parameter sync]), to overlap the next forward, not the update: so the update
# runs in one call first (no gather competes with it for the cores and memory bandwidth: faster
# than pipelined; measured: docs/performance.md), then the gathers are launched in bucket order,
# the order the forward needs them. A state with tensors outside its per-piece fields
# cannot be cut by pieces; it is updated in one call, then gathered bucket by bucket. The
# hyperparameters of an ``inject_hyperparams`` state do not count (a 0-d tensor lr included):
# every bucket's call reads them, none writes them ([Note: hyperparameters of a sharded state]).


_LAST_SLICEABLE: list[Any] = [None, -1, False]  # (inner, n, answer): step asks every step


def _sliceable(inner: Any, n: int) -> bool:
    last = _LAST_SLICEABLE
    if last[0] is inner and last[1] == n:
        return bool(last[2])
    last[:] = [inner, n, _sliceable_walk(inner, n)]
    return bool(last[2])


def _sliceable_walk(inner: Any, n: int) -> bool:
    def stop(x: Any) -> bool:
        return (type(x) is list and len(x) == n) or isinstance(x, InjectHyperparamsState)

    for x in pytree.tree_leaves(inner, is_leaf=stop):
        if isinstance(x, InjectHyperparamsState):
            if not _sliceable_walk(x.inner, n):  # its hyperparameters are read-only
                return False
        elif isinstance(x, torch.Tensor):
            return False
    return True


def _update(
    tx: Transformation,
    inner: Any,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    lo: int,
    hi: int,
    reducing: bool = False,
) -> None:
    # a reducing update runs on every rank, with or without pieces: its blocks are collectives
    if (lo >= hi or not any(map(operator.is_not, grads[lo:hi], repeat(None)))) and not reducing:
        return
    n = len(params)
    state = inner if (lo, hi) == (0, n) else slice_state(inner, n, lo, hi)
    update_pieces_(tx, params[lo:hi], grads[lo:hi], state)


def cut_for_whole(
    tx: Transformation, plan: Plan, split: Sequence[bool], tree: PyTree = None
) -> str | None:
    """Why ``plan`` cannot run ``tx``, which needs whole tensors, or None: a flat plan, a mixed
    one cutting a tensor that ``tx`` updates whole, or such a tensor split by tensor parallelism
    (``split``: DTensors with a Shard placement; see [Note: whole matrices])."""
    if plan.owners is None:
        return (
            f"a plan of whole tensors (strategy='greedy' or 'mixed') for {_name(tx)}, which "
            "needs each tensor in its shape (Kind.SHAPED), got a flat plan, whose pieces are "
            "1-D slices"
        )
    presented = [
        torch.empty(spec.shape if plan.is_whole(t) else (spec.numel,), device="meta")
        for t, spec in enumerate(plan.tensors)
    ]
    every = range(len(plan.tensors))  # labels of the whole tensors, as the update resolves them
    scope = None if tree is None else Scope(tree, tuple(every), tuple(every), LocalReducer())
    with in_scope(scope):
        mask = whole_tensor_mask(tx, presented)
    parts = [t for t, w in enumerate(mask) if w and t < len(split) and split[t]]
    if parts:
        return (
            "every tensor updated by a transformation that needs it whole to be whole on its "
            f"rank, got tensors {parts[:8]} split by tensor parallelism (DTensor Shard "
            "placements): Newton-Schulz or row means of a shard are not those of the matrix"
        )
    cut = [t for t, w in enumerate(mask) if w and not plan.is_whole(t)]
    if not cut:
        return None
    return (
        f"every tensor updated by a transformation that needs it whole to be owned whole, got "
        f"tensors {cut[:8]} cut by the mixed plan (give them to whole=, or to an "
        "elementwise optimizer)"
    )


def shaped(param_buffers: ParamBuffers, views: Sequence[Any]) -> list[Any]:
    """Each piece's view in its tensor's shape where the plan owns it whole; 1-D (as it comes)
    where a mixed plan cuts it."""
    plan = param_buffers.plan
    return [
        v.view(plan.tensors[p.tensor].shape) if v is not None and plan.is_whole(p.tensor) else v
        for v, p in zip(views, param_buffers.pieces)
    ]


def _by_rule(
    tx: Transformation,
    inner: Any,
    param_buffers: ParamBuffers,
    params: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    key: Any,
    master: Masters,
    grads_shaped: bool,
) -> Sequence[torch.Tensor | None]:
    """Bucket ``key``'s pieces updated by the piece rule, on master views where the group has
    them; returns ``grads`` with the bucket's made 1-D where they came shaped."""
    lo, hi = param_buffers.piece_ranges[key]
    if grads_shaped:
        grads = [*grads[:lo], *flat_grads(grads[lo:hi]), *grads[hi:]]
    master.views_for_update(params, (key,))
    with in_scope(_narrowed(param_buffers.scope, lo, hi)):
        _update(tx, inner, params, grads, lo, hi)
    return grads


def update_and_sync(
    tx: Transformation,
    inner: Any,
    param_buffers: ParamBuffers,
    grads: Sequence[torch.Tensor | None],
    master: Masters,
    updates: BucketUpdates | None = None,
    grad_shards: Sequence[torch.Tensor] | None = None,
    grads_shaped: bool = False,
) -> None:
    """Updates this rank's pieces with ``grads`` (one per piece) and syncs the parameters.

    See [Note: update and gather pipeline]. ``inner`` is updated in place. The pieces of groups
    with master weights are updated on the float32 views ``master`` gives, bucket by bucket
    where the update is, and written back into the parameter buffer just before each bucket's
    gather ([Note: master weights]). Returns with the gathers in flight when param hooks are
    registered (``param_buffers.deferred``), else when they are done. ``updates`` prepares and
    runs the buckets that can go through one call each ([Note: prepared bucket updates] in
    _bucket_update.py); ``grad_shards`` are the compact gradient shards ``grads`` view, if they
    do; with ``grads_shaped`` the gradients of whole pieces come in their tensors' shapes
    (every path but the prepared ones flattens them).
    """
    params: list[torch.Tensor] = list(param_buffers.param_views())
    compiled = compiled_update(param_buffers)  # [Note: compiled updates]: one call, then gathers
    if compiled is not None:
        grads = flat_grads(grads) if grads_shaped else grads
        with in_scope(compiled.scope):
            done = compiled.run(inner, params, grads, master)
        if done:
            for key in param_buffers.keys:  # each bucket's masters rounded in, then gathered
                master.write_back(key)
                param_buffers.start_param_sync(key)
            param_buffers.finish_param_syncs()
            return
    whole = needs_whole_tensors(tx)  # [Note: whole matrices]: pieces are whole tensors
    reducing = reduces(tx)
    sliceable = _sliceable(inner, len(params)) and not (param_buffers.deferred or whole or reducing)
    if not sliceable:  # one update of every piece: every bucket's masters at once
        grads = flat_grads(grads) if grads_shaped else grads
        master.views_for_update(params, param_buffers.keys)
    with in_scope(param_buffers.scope):  # masks and labels see whole tensors; blocks reduce
        if whole:  # in their tensors' shapes where the plan owns them whole, else 1-D
            update_whole_(tx, shaped(param_buffers, params), shaped(param_buffers, grads), inner)
        elif not sliceable:
            _update(tx, inner, params, grads, 0, len(params), reducing)

    if sliceable and updates is not None:
        updates.begin(tx, inner)
    for key in param_buffers.keys:  # each bucket's pieces updated (where sliceable), then gathered
        if sliceable:
            ran = master.dtype(key[0]) is None and updates is not None
            ran = ran and updates.run(key, inner, params, grads, grad_shards, grads_shaped)  # type: ignore[union-attr]
            if not ran:  # the piece rule, on 1-D gradients
                grads = _by_rule(tx, inner, param_buffers, params, grads, key, master, grads_shaped)
        master.write_back(key)
        param_buffers.start_param_sync(key)
    if sliceable and updates is not None:
        updates.end()
    param_buffers.finish_param_syncs()
