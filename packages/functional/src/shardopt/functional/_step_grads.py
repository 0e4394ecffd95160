"""A step's gradients, from the caller to the update: read (``.grad`` or given), checked,
reduced into the gradient shards (or taken as they are: [Note: one rank's gradients]), checked
for health across ranks, and put in the update's dtype. ``step`` in _shard.py drives them."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from shardopt.core.blocks import PyTree
from shardopt.functional._options import ShardOptions
from shardopt.functional.engine._clip import Health, global_health
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._hooks import GradReducer
from shardopt.functional.engine._mesh import local_tensors
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._state import ShardedState
from shardopt.functional.engine._validate import check_grads

__all__ = ["checked_health", "present_views", "reduced_grads", "to_update_dtype"]


_GRAD = operator.attrgetter("grad")


def grads_of(
    params: list[torch.Tensor], grads: PyTree | None, reducer: GradReducer | None
) -> tuple[list[Any], bool]:
    """(the local gradients: ``.grad`` where ``grads`` is None, whether they are the views of the
    gradient shard made at the last step: [Note: gradients in the shard]); one read of each
    ``.grad`` at C speed, and nothing else per tensor where they are the views."""
    if grads is None:
        read = list(map(_GRAD, params))
        if reducer is not None and reducer.grads.are_views(read):
            return read, True
        return local_tensors(read), False
    return local_tensors(grads), False


def checked_health(
    error: str | None,
    present: list[bool] | None,
    grads: list[torch.Tensor | None],
    state: ShardedState,
    group: ProcessGroup,
) -> Health:
    """The step's small all-reduce; raises on every rank if any rank had a bad gradient."""
    if present is not None:  # stage 2: the shards hold zeros where no rank had a gradient
        grads = list(state.param_buffers.piece_views(state.reducer.shards))
    split = state.param_buffers.tensor_parallel
    health = global_health(grads, error is not None, present, group=group, split=split)
    if error is not None:
        raise ValueError(f"shard: expected {error}")
    if health.errors:
        raise ValueError(
            f"shard: expected valid gradients on every rank, got errors on {health.errors} "
            "rank(s) (see their messages)"
        )
    return health


def present_views(state: ShardedState, present: Sequence[bool]) -> list[torch.Tensor | None]:
    """This rank's gradient shard of each of its pieces, None where ``present`` says none."""
    views = state.param_buffers.piece_views(state.reducer.shards)
    if all(present):  # the usual case, at C speed
        return views  # type: ignore[return-value]
    return [v if present[p.tensor] else None for v, p in zip(views, state.param_buffers.pieces)]


def reduced_grads(
    opts: ShardOptions, params: list[torch.Tensor], grads: PyTree | None, state: ShardedState
) -> tuple[str | None, list[bool] | None, list[torch.Tensor | None]]:
    """(the local gradient error or None, in stage 2 which tensors had a gradient here, this
    rank's gradient of each of its pieces)."""
    param_buffers: ParamBuffers = state.param_buffers
    reducer: GradReducer | None = state.reducer
    hooked = reducer is not None and reducer.hooked
    error, views = None, False
    if not hooked:
        full, views = grads_of(params, grads, reducer)
        if not views:
            error = check_grads(local_tensors(params), full, attributes=grads is None)
        if error is not None:
            if not opts.needs_health:
                raise ValueError(f"shard: expected {error}")
            full = [None] * len(params)  # take part in the collectives, raise after the check
    elif grads is not None:
        raise ValueError(
            "shard: expected grads=None in step when gradient hooks are registered, got grads"
        )
    if reducer is None or (reducer.direct and not hooked and not opts.needs_health):
        # the gradients themselves ([Note: one rank's gradients]); whole pieces' gradients as
        # they are, unless the health check reads them
        return error, None, param_buffers.grad_views(full, shaped=not opts.needs_health)
    if grads is not None and reducer.grads.has_views:  # [Note: gradients in the shard]
        reducer.grads.unpoint(params)
    present = reducer.finish() if hooked else reducer.reduce(full, views=views)
    if grads is None and not hooked and not reducer.free_grads and error is None:
        reducer.grads.point(params)
    if reducer.free_grads and grads is None and error is None:  # see [Note: one loop contract]
        for p in params:
            p.grad = None
    return error, present, present_views(state, present)


def to_update_dtype(
    grads: list[torch.Tensor | None], state: ShardedState, reduced: bool
) -> list[torch.Tensor | None]:
    """The gradients in the dtype of what they update: master weights, else the parameters."""
    param_buffers, master = state.param_buffers, state.master
    dtypes = [master.dtype(g) or buf.dtype for g, buf in enumerate(param_buffers.buffers)]
    # each group's gradients come in one dtype: its shards' (reduced) or its parameters'
    # (checked against them): the usual case converts nothing and looks at no gradient
    held = state.reducer.shards if reduced else param_buffers.buffers
    if [t.dtype for t in held] == dtypes:
        return grads
    out = []
    for g, piece in zip(grads, param_buffers.pieces):
        dtype = dtypes[piece.group]
        out.append(g if g is None or g.dtype == dtype else g.to(dtype))
    return out
