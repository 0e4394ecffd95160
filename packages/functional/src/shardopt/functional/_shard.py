"""shard(): a core transformation partitioned by a plan and stepped on this rank's slice only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardopt.core import Plan, Transformation
from shardopt.core.blocks import PyTree, in_scope, needs_whole_tensors, tree_leaves
from shardopt.functional._options import ShardOptions, Stage
from shardopt.functional._step_grads import (
    checked_health,
    present_views,
    reduced_grads,
    to_update_dtype,
)
from shardopt.functional.engine._bucket_update import BucketUpdates
from shardopt.functional.engine._clip import (
    clip_coefficient,
    scale_grads,
)
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._compiled import planned_update
from shardopt.functional.engine._failure import failing_together, fails_together
from shardopt.functional.engine._hooks import GradReducer
from shardopt.functional.engine._masters import build_masters
from shardopt.functional.engine._mesh import (
    MeshGroups,
    global_places,
    is_split,
    local_tensors,
    mesh_groups,
    tensor_parallel,
)
from shardopt.functional.engine._param_buffers import ParamBuffers, build_param_buffers
from shardopt.functional.engine._renamed import renamed_keyword
from shardopt.functional.engine._scope import ShardReducer, meta_tree, shard_scope
from shardopt.functional.engine._state import (
    ShardedState,
    StepStats,
    flatten_state,
    probe_fields,
    tensor_labels,
)
from shardopt.functional.engine._update import (
    cut_for_whole,
    probe_scope,
    shaped,
    unshardable,
    update_and_sync,
)
from shardopt.functional.engine._validate import (
    agree_across_ranks,
    check_params,
    fingerprint,
    plan_fields,
    probe_updates,
)

__all__ = ["ShardedTransformation", "shard"]


class ShardedTransformation(NamedTuple):
    """``state = init(params)``; ``state = step(params, grads, state)`` (see :func:`shard`)."""

    init: Callable[[PyTree], ShardedState]
    step: Callable[[PyTree, PyTree | None, ShardedState], ShardedState]


@renamed_keyword("shard", "group", "process_group")
def shard(
    tx: Transformation,
    plan: Plan,
    *,
    process_group: ProcessGroup = None,
    stage: int = 1,
    grads_averaged: bool = False,
    master_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    max_norm: float | None = None,
    skip_nonfinite: bool = False,
    algorithm: str = "auto",
    comm_dtype: torch.dtype | None = None,
    master_remainders: bool = False,
    compile: bool | str = "auto",
) -> ShardedTransformation:
    """Partitions ``tx`` over the ranks of ``process_group`` as ``plan`` says (ZeRO stage 1 or 2).

    ``init(params)`` (``params``: the plan's tensors, in its order, as any pytree) checks the
    input on every rank (see [Note: cross-rank validation]), moves the parameters into the flat
    buffers of the plan's buckets (see [Note: engine]), all-gathers them so that every rank
    starts from the owners' values, and returns this rank's state (see
    [Note: sharded state layout]).

    ``step(params, grads, state)`` updates the parameters in place and returns the new state
    (which shares its tensors with ``state``: the optimizer state is updated in place too).
    ``grads`` are each rank's full LOCAL gradients (``None``: each parameter's ``.grad``); they
    are averaged over ranks by reduce-scatter into this rank's gradient shard (during backward
    with :func:`register_grad_hooks`, then ``grads`` must be None), the rank updates its shard,
    and the shards are all-gathered bucket by bucket (see [Note: update and gather pipeline];
    with :func:`register_param_hooks` the gathers overlap the next forward). Stage 1 keeps the
    full gradients (``zero_grad`` them, as for torch.optim; at W = 1 the ``.grad`` tensors
    become views of the gradient shard with the same values, as DDP's
    ``gradient_as_bucket_view``: [Note: gradients in the shard]); stage 2 frees them, in the
    hooks as they are reduced or, without hooks, in ``step``: the same loop either way (see
    [Note: one loop contract]). With
    ``grads_averaged=True`` (stage 1 only) the gradients are taken as already averaged (DDP)
    and nothing is reduced (see [Note: stage 1 averages]).

    A ``None`` gradient skips its parameter (no state change), as in torch.optim. Gradient
    accumulation is described in [Note: gradient accumulation].

    Args:
        tx: a core transformation (its piece fast path is used where it has one).
        plan: from ``plan_partition(params, world_size)``, the same on every rank; its buckets
            are the units of every collective (``plan_partition(..., bucket_numel=...)``).
        process_group: the process group (None: the default group), or a DeviceMesh: 1-D, or
            2-D with dims ("replicate", "shard") for hybrid sharding (see [Note: hybrid
            sharding]).
        stage: 1 (optimizer state sharded) or 2 (gradients too).
        grads_averaged: stage 1 only: the gradients given to ``step`` are already averaged
            over ranks (behind DDP); skip the reduction.
        master_dtype: e.g. ``torch.float32``: keep master weights and optimizer state of the
            lower-precision groups (bfloat16, float16) in this dtype; parameters are gathered in
            their own dtype.
        reduce_dtype: e.g. ``torch.float32``: reduce bfloat16/float16 gradients in this dtype
            (packing converts them; the gradient shards keep it), as Megatron's
            ``grad_reduce_in_fp32`` and FSDP2's ``reduce_dtype``.
        max_norm: clip the gradient to this global norm (the norm of the full gradient).
        skip_nonfinite: if any rank finds an inf or nan gradient, every rank skips the step
            (``state.stats.skipped``), e.g. under a gradient scaler.
        comm_dtype: e.g. ``torch.bfloat16``: gradients travel in this dtype and their owner
            sums them in float32 (in ``reduce_dtype`` where given), so each element is rounded
            once, not at every hop (see [Note: wire dtype]).
        master_remainders: with bfloat16 parameters and ``master_dtype=torch.float32``: keep
            each owned element's master as its bfloat16 parameter plus a 16-bit remainder,
            reconstructed exactly for each update (see [Note: master remainders]).
        compile: ``"auto"`` (default), ``True`` or ``False``: run the rank's update (the
            transformation's update and its apply, in place, master remainders joined and split
            in the same region) as one ``torch.compile``d function per sharded state (inductor: C++
            on the CPU, Triton on CUDA). ``"auto"`` compiles where a compiler is available, the
            transformation has no fused piece rule (a composed chain, not built-in ``adamw``)
            and the plan's largest shard holds at least ``AUTO_NUMEL`` (2**20) elements (the
            same answer on every rank), else runs eagerly;
            ``True`` compiles whatever the size; ``False`` never. The first step compiles
            (seconds); later steps never recompile for a learning rate or a schedule (their
            values are tensors). Not bitwise: per step, parameters within 4 ulps of the eager
            path (of the larger of the old and new value) and the state within 8; bitwise for
            Lion. Where compiling is impossible (no compiler, an unsupported op) it warns once,
            naming why, and runs eagerly. See docs/compiled.md and [Note: compiled updates].
        algorithm: ``"collective"`` (all-gather and reduce-scatter calls), ``"exchange"``
            (per-owner broadcasts, and an all-to-all summed by each owner) or ``"auto"``
            (exchange for CPU tensors under gloo, where it is faster); see
            [Note: collective algorithms].

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import plan_partition, sgd
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> params = [torch.ones(3), torch.ones(2)]
        >>> sharded = shard(sgd(0.5), plan_partition(params, 1))
        >>> state = sharded.init(params)
        >>> state = sharded.step(params, [torch.ones(3), None], state)
        >>> params
        [tensor([0.5000, 0.5000, 0.5000]), tensor([1., 1.])]
        >>> dist.destroy_process_group()
    """
    opts = ShardOptions(
        stage,
        grads_averaged,
        master_dtype,
        reduce_dtype,
        max_norm,
        skip_nonfinite,
        algorithm,
        comm_dtype,
        master_remainders,
        compile,
    )
    groups = mesh_groups("shard", process_group)

    @fails_together("shard.init")
    def init(params: PyTree) -> ShardedState:
        _refuse_non_tensors(tree_leaves(params), groups)
        split = [is_split(p) for p in tree_leaves(params)]
        whole = meta_tree(params)  # masks and labels are resolved on these ([Note: kinds])
        state = _init(tx, plan, opts, groups, local_tensors(params), split, whole)
        leaves = tree_leaves(params)
        tp = tensor_parallel(leaves, state.param_buffers)
        state.param_buffers.set_places(tp, global_places(leaves))
        if tp is not None:  # [Note: reductions over tensor-parallel tensors]
            state.param_buffers.scope.reducer.set_tensor_parallel(tp.group, split)
        return state

    def step(params: PyTree, grads: PyTree | None, state: ShardedState) -> ShardedState:
        with failing_together("shard.step"):  # a block: the step's path stays in this file
            return _step(tx, opts, groups.shard, tree_leaves(params), grads, state)

    return ShardedTransformation(init, step)


def _refuse_non_tensors(leaves: list[Any], groups: MeshGroups) -> None:
    """A TypeError naming the first leaf of ``params`` that is neither a tensor nor None, raised
    on every rank through init's agreement (the others name this rank); nothing if none."""
    bad = next(
        ((i, x) for i, x in enumerate(leaves) if x is not None and not isinstance(x, torch.Tensor)),
        None,
    )
    if bad is not None:
        i, x = bad
        error = TypeError(
            f"shard.init: expected params[{i}] to be a tensor, got {type(x).__name__}"
        )
        agree_across_ranks("shard", error, 0, groups.agree)


def _piece_dtypes(plan: Plan, opts: ShardOptions) -> list[torch.dtype]:
    out = []
    for g in plan.groups:
        dtype = getattr(torch, g.dtype)
        out.append(opts.master_for(dtype) or dtype)
    return out


def _agreed_fields(
    tx: Transformation,
    plan: Plan,
    opts: ShardOptions,
    groups: MeshGroups,
    params: list[Any],
    split: list[bool],
    tree: PyTree,
) -> dict[str, Any]:
    """init's checks, then the agreement of every rank of ``groups.agree`` on them (raising on
    every rank if one failed or they differ); returns the state's probed fields."""
    world = dist.get_world_size(groups.shard)
    error: str | BaseException | None = check_params(plan, params, world)
    whole = needs_whole_tensors(tx)  # see [Note: whole matrices]
    probed, computes = {}, ""
    try:  # the transformation's own errors ride through the agreement too
        error = error or unshardable(tx)
        error = error or (cut_for_whole(tx, plan, split, tree) if whole else None)
        dtypes = _piece_dtypes(plan, opts)
        with in_scope(probe_scope(plan, tree)):  # masks and labels see the params' tree
            probed = probe_fields(
                tx, [torch.zeros((2, 3) if whole else 2, dtype=d) for d in dtypes]
            )
            computes = probe_updates(tx, dtypes)
    except Exception as exc:  # raised below, on this rank, after the agreement
        error = error or exc
    print_ = fingerprint(plan, (opts, sorted(probed.items()), computes, groups.description))
    named = {  # what differs, named on the failure path ([Note: naming what differs])
        "options": {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)},
        "state fields": dict(probed),
        "update": computes,
        "mesh": groups.description,
        "plan": plan_fields(plan),
    }
    agree_across_ranks("shard", error, print_, groups.agree, lambda: named)
    return probed


def _init(
    tx: Transformation,
    plan: Plan,
    opts: ShardOptions,
    groups: MeshGroups,
    params: list[Any],
    split: list[bool],
    tree: PyTree,
) -> ShardedState:
    probed = _agreed_fields(tx, plan, opts, groups, params, split, tree)
    group = groups.shard
    rank, whole = dist.get_rank(group), needs_whole_tensors(tx)
    param_buffers = build_param_buffers(
        plan,
        params,
        rank,
        group=group,
        algorithm=opts.algorithm,
        reduce_dtype=opts.reduce_dtype,
        comm_dtype=opts.comm_dtype,
        replicate=groups.replicate if opts.reduces else None,
    )
    param_buffers.sync_params()
    wanted = [opts.master_for(buf.dtype) for buf in param_buffers.buffers]
    master = build_masters(param_buffers, wanted, opts.master_remainders)  # [Note: master weights]
    fulls = master.fulls()  # float32 (a copy of a remainder group's, for init only)
    shards = [m if m is not None else param_buffers.copy_shard_out(g) for g, m in enumerate(fulls)]
    views = param_buffers.piece_views(shards)
    presented = shaped(param_buffers, views) if whole else views
    reducer_ = ShardReducer(group, len(plan.tensors), param_buffers.buffers[0].device)
    pieces = [p.tensor for p in param_buffers.pieces]  # see [Note: scopes of sharded updates]
    starts = [p.start for p in param_buffers.pieces]
    param_buffers.scope = shard_scope(tree, len(plan.tensors), pieces, starts, reducer_)
    labels = tensor_labels(tx, presented, _piece_dtypes(plan, opts), param_buffers, group)
    with in_scope(param_buffers.scope):
        inner, fields, _ = flatten_state(tx.init(presented), param_buffers, probed)
    planned_update(tx, param_buffers, opts.compile, whole)  # [Note: compiled updates]
    reducer = None
    if opts.reduces or dist.get_world_size(group) == 1:  # [Note: one rank's gradients]
        stage2 = opts.stage is Stage.GRADIENTS
        reducer = GradReducer(param_buffers, free_grads=stage2, averaged=opts.grads_averaged)
    updates = BucketUpdates(tx, param_buffers, fields)  # [Note: prepared bucket updates]
    return ShardedState(inner, fields, param_buffers, master, reducer, None, labels, updates)


# [Note: whole matrices]
# Muon and Adafactor (core's [Note: whole tensors]) step whole matrices, so they are sharded by a
# plan that owns those matrices whole: greedy (every tensor whole) or mixed (the tensors its
# ``whole`` picks whole, the others cut as a flat plan cuts them; ``cost=...`` balances the whole
# ones). The owner of a matrix receives its averaged gradient by the same bucketed reduce-scatter,
# updates it with the transformation's pure update on views in the matrix's shape
# (``update_whole_``; the state is in those shapes too), and the same all-gather sends it back.
# Cut tensors reach the transformation as 1-D slices, so a ``partition`` labelling by ``dim()``
# sends them to its elementwise optimizer (Muon with AdamW). At init, ``whole_tensor_mask`` says
# which tensors the transformation updates whole, as they will be presented; a plan that cuts one
# (a flat plan; a mixed plan whose ``whole`` leaves out Adafactor's vectors), or one whose tensor
# tensor parallelism splits (a DTensor with a Shard placement: its local tensor is a part), is
# refused on every rank, since a part would be updated as if it were the tensor, without an error.


def _step(
    tx: Transformation,
    opts: ShardOptions,
    group: ProcessGroup,
    params: list[torch.Tensor],
    grads: PyTree | None,
    state: ShardedState,
) -> ShardedState:
    param_buffers: ParamBuffers = state.param_buffers
    problem = param_buffers.check_views(local_tensors(params))
    if problem is not None:
        raise ValueError(f"shard: expected {problem}")
    param_buffers.wait_params()  # the update writes the shards the last gathers send
    error, present, piece_grads = reduced_grads(opts, params, grads, state)
    # the compact gradient shards that piece_grads view, where they do (else they are the
    # caller's, whole pieces' in their shapes but for the health check) ([Note: prepared
    # bucket updates])
    shards = None if present is None else state.reducer.shards
    shaped = present is None and not opts.needs_health
    stats = None
    if opts.needs_health:
        health = checked_health(error, present, piece_grads, state, group)
        if health.present is not None:
            piece_grads = present_views(state, health.present)
        if opts.skip_nonfinite and not health.finite:
            return state._replace(stats=StepStats(health.norm, True))
        stats = StepStats(health.norm, False)
        if opts.max_norm is not None:
            coef = clip_coefficient(health.norm, opts.max_norm)
            in_place = opts.stage is Stage.GRADIENTS
            piece_grads = scale_grads(piece_grads, coef, in_place=in_place)
            shards = shards if in_place else None
    update_grads = to_update_dtype(piece_grads, state, present is not None)
    shards = shards if update_grads is piece_grads else None
    update_and_sync(
        tx, state.inner, param_buffers, update_grads, state.master, state.updates, shards, shaped
    )
    return state._replace(stats=stats)
