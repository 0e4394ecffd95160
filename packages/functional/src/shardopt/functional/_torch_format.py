"""The torch.optim state-dict form: consolidated on one rank by gathers, scattered back locally."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Piece, Plan
from shardopt.functional._checkpoint_keys import (
    FieldKeys,
    field_keys,
    has_state,
    piece_slots,
    piece_value,
)
from shardopt.functional._collectives import ProcessGroup, comm_device
from shardopt.functional._state import FieldKind, ShardedState
from shardopt.functional._validate import agree_across_ranks, describe, fingerprint

__all__ = ["consolidate_state_dict", "load_torch_state_dict", "torch_hyperparams"]

Hyperparams = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None

# [Note: consolidation by gathers]
# Rank ``to`` must end up holding the S bytes of the result; the aim is to hold little besides. It
# allocates every entry first (each tensor contiguous, with a storage of its own), then fills the
# ELEMENTWISE ones one field of one plan group at a time. Rank r's field buffer of a group is its
# compact shard (``shard_numels[r]`` elements, [Note: flat storage]), and ``Plan.pieces(r)`` says
# which entry each of its elements belongs to (padding belongs to none). Shards travel in windows of
# 1 / (2 W) of the group's largest shard: each of 2 W gathers brings one window of every rank's
# shard into a staging buffer of W windows (half a shard), whose rows are copied into the entries. A
# gather needs equal sizes on every rank, and greedy shards are unequal, so each rank pads its shard
# with zeros to the largest (``max(shard_numels)``, never more), copying only the one window that
# runs past its end; the padding of a row belongs to no piece and is never read. Why windows: gloo's
# gather stages its whole result in a hidden buffer before copying it into the outputs (measured:
# the peak is twice the output), so one gather per field would hold the whole field twice besides S;
# with windows, staging and gloo's copy of it hold one shard (<= S / W; gloo frees its copy on its
# own thread, at times a window late): the peak is S plus one field shard (NCCL's gather writes into
# the outputs: S plus half a shard). The cost, 2 W gathers per field and plan group instead of one,
# is small next to the bytes at the world sizes gloo runs (measured at W = 2 and 4: faster than
# point-to-point sends to ``to`` one rank at a time). Why not views into a gathered buffer: pickle
# (``broadcast_object_list``) and ``torch.save`` of one entry would write the view's whole storage.
# PER_PIECE values (counts, NAdam's mu_product) travel first, as one (fields x tensors) float64
# matrix per rank, each rank filling the columns of the tensors whose first element it owns (float64
# holds float32 counts exactly); rank ``to`` reads column t from that owner, and the counts decide
# which parameters get an entry. The gathers run on the CPU under gloo (it has no CUDA gather) and
# on the CUDA device under NCCL ([Note: collective algorithms]); nothing is pickled. Every check
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
    Adagrad). Tensors are on the device of the gathers (the CPU under gloo), each contiguous
    with a storage of its own.

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
    state.layout.wait_params()  # [Note: deferred parameter sync]
    plan = state.layout.plan
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failure: BaseException | None = None
    try:  # local checks: their errors ride through the agreement ([Note: cross-rank validation])
        if world != plan.world_size:
            raise ValueError(f"{api}: expected a group of {plan.world_size} ranks, got {world}")
        if type(to) is not int or not 0 <= to < world:
            raise ValueError(f"{api}: expected 0 <= to < {world}, got {to!r}")
        keys = field_keys(state, api, torch_only=True)
        key_of = param_keys(api, plan, names)
        groups = param_group_dicts(api, plan, param_groups, key_of)
    except ValueError as exc:
        failure = exc
    print_ = 0 if failure else fingerprint(plan, describe((to, key_of, groups)))
    agree_across_ranks(api, failure, print_, group)
    scalars = _gather_scalars(state, keys, to, group)
    entries = _empty_entries(state, keys, scalars, comm_device(group)) if rank == to else None
    _gather_elementwise(state, keys, entries, to, group)
    if entries is None:
        return None
    out = {key_of[t]: entry for t, entry in entries.items()}
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
    out = send.new_empty((world, *send.shape)) if rank == to else None
    dist.gather(send, None if out is None else list(out.unbind(0)), group_dst=to, group=group)
    return out


def _windows(
    buf: torch.Tensor, numel: int, to: int, group: ProcessGroup
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """On rank ``to``: (rank r, offset lo, elements ``[lo, lo + len)`` of r's ``buf`` padded with
    zeros to ``numel``, the largest ``buf`` of any rank), covering every rank's ``buf``, each
    valid until the next is asked for; elsewhere nothing. Collective (2 W gathers of equal
    sizes, see [Note: consolidation by gathers]): every rank must exhaust it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = buf.to(comm_device(group)).reshape(-1)
    if world == 1:
        yield 0, 0, flat
        return
    chunk = max(1, -(-numel // (2 * world)))
    staging = flat.new_empty(world * chunk) if rank == to else None
    for lo in range(0, numel, chunk):
        n = min(chunk, numel - lo)
        send = flat[lo : lo + n]
        if send.numel() < n:  # past the end of this rank's shard: pad (one window at most)
            send = torch.cat([send, flat.new_zeros(n - send.numel())])
        rows = None if staging is None else staging[: world * n].view(world, -1)
        dist.gather(send, None if rows is None else list(rows.unbind(0)), group_dst=to, group=group)
        for r, row in enumerate(rows if rows is not None else ()):
            yield r, lo, row


def _empty_entries(
    state: ShardedState, keys: FieldKeys, scalars: Mapping[str, torch.Tensor], device: torch.device
) -> dict[int, dict[str, torch.Tensor]]:
    """Rank ``to``'s entry of every plan tensor that has one: PER_PIECE values set, ELEMENTWISE
    tensors allocated on ``device`` (for :func:`_gather_elementwise` to fill)."""
    plan = state.layout.plan
    where = tensor_locations(plan)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for t, spec in enumerate(plan.tensors):
        count = scalars[keys.count.path][t] if keys.count is not None else None
        if spec.numel == 0 or not has_state(keys, count):
            continue
        g = where[t][0]
        entry = {}
        for field, key, in_torch in keys.entries:
            if not in_torch:
                continue
            dtype = field.buffers[g].dtype
            if field.kind is FieldKind.PER_PIECE:
                entry[key] = scalars[field.path][t].to(dtype, copy=True)
            else:
                entry[key] = torch.empty(spec.shape, dtype=dtype, device=device)
        out[t] = entry
    return out


def _gather_elementwise(
    state: ShardedState,
    keys: FieldKeys,
    entries: Mapping[int, Mapping[str, torch.Tensor]] | None,
    to: int,
    group: ProcessGroup,
) -> None:
    """Fills the ELEMENTWISE tensors of ``entries`` (rank ``to``'s; None elsewhere) from every
    rank's field shards, one field of one plan group at a time."""
    plan = state.layout.plan
    fields = [(f, key) for f, key, t in keys.entries if t and f.kind is FieldKind.ELEMENTWISE]
    targets = entries if entries is not None else {}
    owned = [plan.pieces(r) for r in range(plan.world_size)] if entries is not None else []
    for g in range(len(plan.groups)):
        pieces = [[p for p in mine if p.group == g] for mine in owned]
        for f, key in fields:
            numel = max(plan.groups[g].shard_numels)
            _copy_pieces(_windows(f.buffers[g], numel, to, group), pieces, key, targets)


def _copy_pieces(
    windows: Iterator[tuple[int, int, torch.Tensor]],
    pieces: Sequence[Sequence[Piece]],
    key: str,
    targets: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Copies what each (rank r, offset lo, window of r's shard) holds of ``pieces[r]`` into
    ``targets[t][key]`` (a function of its own: the last window is freed when it returns)."""
    for r, lo, window in windows:
        hi = lo + window.numel()
        for p in pieces[r]:
            entry = targets.get(p.tensor)
            a, b = max(p.offset, lo), min(p.offset + p.stop - p.start, hi)
            if entry is not None and a < b:
                dst = entry[key].view(-1)
                dst[p.start + a - p.offset : p.start + b - p.offset].copy_(window[a - lo : b - lo])


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
    state.layout.wait_params()
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
                master.copy_(layout.copy_shard_out(g))


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
