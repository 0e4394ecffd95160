"""The torch.optim state-dict form: consolidated on one rank by gathers, scattered back locally."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Plan
from shardopt.functional._checkpoint_keys import (
    FieldKeys,
    field_keys,
    has_state,
    piece_slots,
    piece_value,
)
from shardopt.functional._collectives import ProcessGroup, comm_device
from shardopt.functional._state import FieldKind, ShardedState, StateField

__all__ = ["consolidate_state_dict", "load_torch_state_dict", "torch_hyperparams"]

Hyperparams = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None

# [Note: consolidation by gathers]
# Rank ``to`` needs, per parameter and state key, the full tensor. ELEMENTWISE fields already sit
# in flat buffers laid out like the parameters, so one ``gather`` per (plan group, dtype) of the
# rank's field buffers stacked as rows brings every rank's slice to ``to``, where tensor t of the
# group is elements ``[offset, offset + numel)`` of the rank-major concatenation (padding is
# skipped). PER_PIECE values (counts, NAdam's mu_product) travel as one (fields x tensors) float64
# matrix per rank, each rank filling the columns of the tensors whose first element it owns
# (float64 holds float32 counts exactly); the root reads column t from that owner. So the whole
# consolidation is a few tensor gathers, on the CPU under gloo (which has no CUDA gather) and on
# the CUDA device under NCCL ([Note: collective algorithms]); nothing is pickled. Every check
# runs before the first gather, on every rank alike, so a bad argument raises everywhere.


def torch_hyperparams(optimizer: type[torch.optim.Optimizer], **kwargs: Any) -> dict[str, Any]:
    """The hyperparameters ``optimizer(params, **kwargs)`` records in a param group, defaults
    included (for the ``param_groups`` of :func:`consolidate_state_dict`).

    Example:
        >>> hp = torch_hyperparams(torch.optim.SGD, lr=0.1, momentum=0.9)
        >>> hp["lr"], hp["momentum"], hp["nesterov"], "params" in hp
        (0.1, 0.9, False, False)
    """
    probe = torch.nn.Parameter(torch.zeros(1))
    group = optimizer([probe], **kwargs).state_dict()["param_groups"][0]
    return {k: v for k, v in group.items() if k != "params"}


def consolidate_state_dict(
    state: ShardedState,
    param_groups: Hyperparams = None,
    *,
    names: Sequence[str] | None = None,
    to: int = 0,
    group: ProcessGroup = None,
) -> dict[str, Any] | None:
    """The full optimizer state in ``torch.optim.<Class>.state_dict()`` format, on rank ``to``.

    Every rank of ``group`` must call it (it gathers, see [Note: consolidation by gathers]);
    rank ``to`` gets ``{"state": {index: {"step": ..., "exp_avg": ..., ...}}, "param_groups":
    [{..., "params": [indices]}]}`` with the keys of [Note: torch state keys], the others None.
    Parameters that never had a gradient get no entry (as in torch; every parameter for
    Adagrad). Tensors are on the device of the gather (the CPU under gloo).

    Args:
        state: a state of one of the ten core optimizers (anything else raises ValueError).
        param_groups: the hyperparameters of each plan param group (e.g.
            :func:`torch_hyperparams`), one mapping for all groups, or None for none. A
            ``"params"`` key, if present, must list the group's parameters.
        names: one key per plan tensor instead of its index (torch's FQN optimizer format).
        to: the rank (in ``group``) that receives the dict.
        group: the process group of the sharded optimizer (None: the default group).

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import adam, plan_partition
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> params = [torch.ones(3), torch.ones(2)]
        >>> sharded = shard(adam(0.1), plan_partition(params, 1))
        >>> state = sharded.step(params, [torch.ones(3), None], sharded.init(params))
        >>> sd = consolidate_state_dict(state, torch_hyperparams(torch.optim.Adam, lr=0.1))
        >>> list(sd["state"]), list(sd["state"][0]), sd["param_groups"][0]["params"]
        ([0], ['step', 'exp_avg', 'exp_avg_sq'], [0, 1])
        >>> torch.optim.Adam([torch.nn.Parameter(p) for p in params]).load_state_dict(sd)
        >>> dist.destroy_process_group()
    """
    api = "consolidate_state_dict"
    plan = state.layout.plan
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world != plan.world_size:
        raise ValueError(f"{api}: expected a group of {plan.world_size} ranks, got {world}")
    if type(to) is not int or not 0 <= to < world:
        raise ValueError(f"{api}: expected 0 <= to < {world}, got {to!r}")
    keys = field_keys(state, api, torch_only=True)
    key_of = param_keys(api, plan, names)
    groups = param_group_dicts(api, plan, param_groups, key_of)
    flats = _gather_elementwise(state, keys, to, group)
    scalars = _gather_scalars(state, keys, to, group)
    if rank != to:
        return None
    where = tensor_locations(plan)
    out: dict[Hashable, dict[str, torch.Tensor]] = {}
    for t, spec in enumerate(plan.tensors):
        count = scalars[keys.count.path][t] if keys.count is not None else None
        if spec.numel == 0 or not has_state(keys, count):
            continue
        g, offset = where[t]
        entry = {}
        for field, key, in_torch in keys.entries:
            if not in_torch:
                continue
            if field.kind is FieldKind.PER_PIECE:
                entry[key] = scalars[field.path][t].to(field.buffers[g].dtype, copy=True)
            else:
                flat = flats[field.path][g]
                entry[key] = flat[offset : offset + spec.numel].view(spec.shape).clone()
        out[key_of[t]] = entry
    return {"state": out, "param_groups": groups}


def param_keys(api: str, plan: Plan, names: Sequence[str] | None) -> list[Hashable]:
    """The key of each plan tensor: its index, or its name from ``names`` (checked)."""
    if names is None:
        return list(range(len(plan.tensors)))
    names = list(names)
    if len(names) != len(plan.tensors) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{api}: expected names to be {len(plan.tensors)} strings (one per plan tensor), "
            f"got {names!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: expected distinct names, got {names!r}")
    return list(names)


def param_group_dicts(
    api: str, plan: Plan, hyper: Hyperparams, key_of: Sequence[Hashable]
) -> list[dict[str, Any]]:
    """torch's ``param_groups``: the hyperparameters of each plan param group and its "params"."""
    ids = sorted({t.param_group for t in plan.tensors})
    members = [
        [key_of[t] for t, spec in enumerate(plan.tensors) if spec.param_group == pg] for pg in ids
    ]
    if hyper is None:
        hypers: list[Mapping[str, Any]] = [{} for _ in ids]
    elif isinstance(hyper, Mapping):
        hypers = [hyper for _ in ids]
    else:
        hypers = list(hyper)
        if len(hypers) != len(ids) or not all(isinstance(h, Mapping) for h in hypers):
            raise ValueError(
                f"{api}: expected param_groups to be one mapping, or {len(ids)} (one per plan "
                f"param group), got {hyper!r}"
            )
    out = []
    for i, (h, params) in enumerate(zip(hypers, members)):
        if "params" in h and list(h["params"]) != params:
            raise ValueError(
                f"{api}: expected param_groups[{i}]['params'] == {params}, got {h['params']!r}"
            )
        out.append({**{k: v for k, v in h.items() if k != "params"}, "params": params})
    return out


def tensor_locations(plan: Plan) -> list[tuple[int, int]]:
    """(plan group, offset in its flat buffer) of every plan tensor."""
    where = [(0, 0)] * len(plan.tensors)
    for g, grp in enumerate(plan.groups):
        for t, offset in zip(grp.tensors, grp.offsets):
            where[t] = (g, offset)
    return where


def _gather_rows(rows: torch.Tensor, to: int, group: ProcessGroup) -> torch.Tensor | None:
    """``rows`` of every rank, stacked on rank ``to`` (None elsewhere): one gather."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = rows.to(comm_device(group)).contiguous()
    if world == 1:
        return send.unsqueeze(0)
    bins = [torch.empty_like(send) for _ in range(world)] if rank == to else None
    dist.gather(send, bins, group_dst=to, group=group)
    return torch.stack(bins) if bins is not None else None


def _gather_elementwise(
    state: ShardedState, keys: FieldKeys, to: int, group: ProcessGroup
) -> dict[str, list[torch.Tensor]]:
    """On ``to``: every ELEMENTWISE torch field's full (padded) flat buffer per plan group."""
    fields = [f for f, _, t in keys.entries if t and f.kind is FieldKind.ELEMENTWISE]
    out: dict[str, list[torch.Tensor]] = {f.path: [] for f in fields}
    for g in range(len(state.layout.plan.groups)):
        by_dtype: dict[torch.dtype, list[StateField]] = {}
        for f in fields:
            by_dtype.setdefault(f.buffers[g].dtype, []).append(f)
        for same in by_dtype.values():
            gathered = _gather_rows(torch.stack([f.buffers[g] for f in same]), to, group)
            for i, f in enumerate(same):
                if gathered is not None:  # on rank ``to``
                    out[f.path].append(gathered[:, i].reshape(-1))
    return out


def _gather_scalars(
    state: ShardedState, keys: FieldKeys, to: int, group: ProcessGroup
) -> dict[str, torch.Tensor]:
    """On ``to``: each PER_PIECE field's value per plan tensor, from the rank owning its start."""
    layout, plan = state.layout, state.layout.plan
    fields = [f for f, _, _ in keys.entries if f.kind is FieldKind.PER_PIECE]
    if not fields:
        return {}
    rows = torch.zeros(len(fields), len(plan.tensors), dtype=torch.float64)
    slots = piece_slots(layout)
    for k, piece in enumerate(layout.pieces):
        if piece.start == 0:
            for i, f in enumerate(fields):
                rows[i, piece.tensor] = piece_value(f, layout, k, slots).item()
    gathered = _gather_rows(rows, to, group)
    if gathered is None:
        return {}
    gathered = gathered.cpu()
    owners = [plan.tensor_pieces(t)[0][0] if s.numel else 0 for t, s in enumerate(plan.tensors)]
    picked = gathered[torch.tensor(owners), :, torch.arange(len(plan.tensors))]  # (tensors, F)
    return {f.path: picked[:, i] for i, f in enumerate(fields)}


def load_torch_state_dict(
    state: ShardedState, torch_sd: Mapping[str, Any], *, names: Sequence[str] | None = None
) -> None:
    """Copies a ``torch.optim`` state dict into this rank's shards, in place (no communication).

    Call it on every rank with the same full dict (e.g. ``torch.load`` of an exported one, or
    :func:`consolidate_state_dict` of another world size or plan): each rank keeps the slices of
    its own pieces. Hyperparameters in ``param_groups`` are not loaded (a core transformation's
    are fixed at construction); the groups' ``params`` must match the plan. Parameters without
    an entry keep their state, which must still be fresh (count 0). Master weights, which
    torch.optim does not have, are re-initialised from the current parameters.

    Raises:
        ValueError: a state that torch cannot represent, or a dict that does not match the plan
            or the optimizer (a missing or unexpected key, a shape), before anything is written.

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import sgd, plan_partition
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> params = [torch.ones(3)]
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
        >>> opt.param_groups[0]["params"][0].grad = torch.ones(3)
        >>> opt.step()
        >>> sharded = shard(sgd(0.1, momentum=0.9), plan_partition(params, 1))
        >>> state = sharded.init(params)
        >>> load_torch_state_dict(state, opt.state_dict())
        >>> state.inner[0].momentum[0]
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
    """
    api = "load_torch_state_dict"
    keys = field_keys(state, api, torch_only=True)
    layout, plan = state.layout, state.layout.plan
    key_of = param_keys(api, plan, names)
    entries = _checked_entries(api, plan, keys, torch_sd, key_of)
    slots = piece_slots(layout)
    for k, piece in enumerate(layout.pieces):
        if entries[piece.tensor] is None and keys.count is not None:
            count = piece_value(keys.count, layout, k, slots)
            if count.item() != 0:
                raise ValueError(
                    f"{api}: expected an entry for parameter {key_of[piece.tensor]!r}, whose "
                    f"state here has count {count.item():g}; load into a fresh state"
                )
    with torch.no_grad():
        for k, piece in enumerate(layout.pieces):
            entry = entries[piece.tensor]
            if entry is None:
                continue
            for field, key, in_torch in keys.entries:
                dst = piece_value(field, layout, k, slots)
                if not in_torch:  # SGD's count: torch keeps none, a buffer means >= 1 step
                    dst.clamp_(min=1)
                elif field.kind is FieldKind.PER_PIECE:
                    dst.copy_(torch.as_tensor(entry[key]).reshape(()))
                else:
                    dst.copy_(entry[key].reshape(-1)[piece.start : piece.stop])
        for g, master in enumerate(state.master):
            if master is not None:
                master.copy_(layout.shard(g))


def _checked_entries(
    api: str, plan: Plan, keys: FieldKeys, torch_sd: Any, key_of: Sequence[Hashable]
) -> list[Mapping[str, Any] | None]:
    """Each plan tensor's entry of ``torch_sd["state"]`` (None if absent), all checked."""
    if not isinstance(torch_sd, Mapping) or set(torch_sd) != {"state", "param_groups"}:
        got = sorted(torch_sd) if isinstance(torch_sd, Mapping) else type(torch_sd).__name__
        raise ValueError(f"{api}: expected a dict with keys 'param_groups' and 'state', got {got}")
    want = [g["params"] for g in param_group_dicts(api, plan, None, key_of)]
    groups = torch_sd["param_groups"]
    params = [list(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    if params != want:
        raise ValueError(f"{api}: expected param_groups with params {want}, got {params}")
    state = torch_sd["state"]
    unknown = [k for k in state if k not in set(key_of)]
    if unknown:
        raise ValueError(f"{api}: expected state keys among {list(key_of)}, got {unknown}")
    expected = {key: f for f, key, in_torch in keys.entries if in_torch}
    out: list[Mapping[str, Any] | None] = []
    for t, spec in enumerate(plan.tensors):
        entry = state.get(key_of[t])
        out.append(entry)
        if entry is None:
            continue
        if not isinstance(entry, Mapping) or set(entry) != set(expected):
            got_keys = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(
                f"{api}: expected state[{key_of[t]!r}] with keys {sorted(expected)}, got {got_keys}"
            )
        for key, field in expected.items():
            value = torch.as_tensor(entry[key])
            shape = () if field.kind is FieldKind.PER_PIECE else spec.shape
            if tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"{api}: expected state[{key_of[t]!r}][{key!r}] of shape {tuple(shape)}, "
                    f"got {tuple(value.shape)}"
                )
    return out
