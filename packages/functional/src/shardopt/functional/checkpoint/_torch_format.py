"""The torch.optim state-dict form: consolidated on one rank by gathers, scattered back locally."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from shardopt.core import Plan
from shardopt.functional.checkpoint._checkpoint_keys import (
    FieldKeys,
    keys_of,
    piece_slots,
    piece_value,
    state_keys,
)
from shardopt.functional.checkpoint._consolidate import (
    empty_entries,
    gather_elementwise,
    gather_scalars,
    gather_shaped,
    merge_codes,
    shaped_dtypes,
)
from shardopt.functional.checkpoint._incoming import EntrySpec, check_entries, torch_form_specs
from shardopt.functional.engine._collectives import ProcessGroup, comm_device
from shardopt.functional.engine._failure import fails_together
from shardopt.functional.engine._renamed import renamed_keyword
from shardopt.functional.engine._state import FieldGranularity, ShardedState
from shardopt.functional.engine._validate import (
    agree_across_ranks,
    describe,
    fingerprint,
    plan_fields,
)

__all__ = [
    "consolidate_state_dict",
    "load_torch_state_dict",
    "torch_hyperparams",
    "write_torch_state_dict",
]

Hyperparams = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def torch_hyperparams(optimizer: type[torch.optim.Optimizer], **kwargs: Any) -> dict[str, Any]:
    """The hyperparameters ``optimizer(params, **kwargs)`` records in a param group, defaults
    included (for the ``param_groups`` of :func:`consolidate_state_dict`).

    Example:
        >>> hp = torch_hyperparams(torch.optim.SGD, lr=0.1, momentum=0.9)
        >>> hp["lr"], hp["momentum"], hp["nesterov"], "params" in hp
        (0.1, 0.9, False, False)
    """
    probe = torch.nn.Parameter(torch.zeros(1, 1))  # a matrix: torch.optim.Muon takes no other
    group = optimizer([probe], **kwargs).state_dict()["param_groups"][0]
    return {k: v for k, v in group.items() if k != "params"}


@renamed_keyword("consolidate_state_dict", "group", "process_group")
@fails_together("consolidate_state_dict")
def consolidate_state_dict(
    state: ShardedState,
    param_groups: Hyperparams = None,
    *,
    names: Sequence[str] | None = None,
    to: int = 0,
    process_group: ProcessGroup = None,
) -> dict[Any, Any] | None:
    """The full optimizer state in ``torch.optim.<Class>.state_dict()`` format, on rank ``to``.

    Every rank of ``process_group`` must call it (it gathers, see [Note: consolidation by gathers]
    in ``_consolidate.py``);
    rank ``to`` gets ``{"state": {index: {"step": ..., "exp_avg": ..., ...}}, "param_groups":
    [{..., "params": [indices]}]}`` with the keys of [Note: torch state keys], the others None.
    Parameters that never had a gradient get no entry (as in torch; every parameter for
    Adagrad). Tensors are on the device of the gathers (the CPU under gloo), each contiguous
    with a storage of its own.

    The state of a core ``partition`` (Muon for matrices, AdamW for the rest, say) gives one
    such dict per label, ``{label: dict}`` in the partition's order, each what the label's torch
    optimizer over the label's parameters would give (its ``"state"`` keyed by the index among
    them, or by name), with only the param groups that hold some of them.

    Args:
        state: a state of one of the core optimizers, or of a ``partition`` of them (anything
            else raises ValueError).
        param_groups: the hyperparameters of each plan param group (e.g.
            :func:`torch_hyperparams`), one mapping for all groups, or None for none. A
            ``"params"`` key, if present, must list the group's parameters. For a partition,
            a mapping from each label to its optimizer's (each as above).
        names: one key per plan tensor instead of its index (torch's FQN optimizer format).
        to: the rank (in ``process_group``) that receives the dict.
        process_group: the process group of the sharded optimizer (None: the default group).

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
    state.param_buffers.wait_params()  # [Note: deferred parameter sync]
    plan = state.param_buffers.plan
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    failure: BaseException | None = None
    keysets: tuple[FieldKeys, ...] = ()
    try:  # local checks: their errors ride through the agreement ([Note: cross-rank validation])
        if world != plan.world_size:
            raise ValueError(f"{api}: expected a group of {plan.world_size} ranks, got {world}")
        if type(to) is not int or not 0 <= to < world:
            raise ValueError(f"{api}: expected 0 <= to < {world}, got {to!r}")
        keysets = state_keys(state, api, torch_only=True)
        key_of = param_keys(api, plan, names)
        groups = [
            param_group_dicts(
                api, plan, _hyper_of(api, keys, param_groups), _keys_in(keys, key_of), keys
            )
            for keys in keysets
        ]
        local = [shaped_dtypes(api, keys, state) for keys in keysets]
    except ValueError as exc:
        failure = exc
    print_ = 0 if failure else fingerprint(plan, describe((to, key_of, groups)))
    agree_across_ranks(
        api,
        failure,
        print_,
        process_group,
        lambda: {"to": to, "param keys": key_of, "param_groups": groups, "plan": plan_fields(plan)},
    )
    out = {
        keys.label: _gathered(
            state, keys, codes, to, process_group, _keys_in(keys, key_of), label_groups
        )
        for keys, codes, label_groups in zip(keysets, local, groups)
    }
    if rank != to:
        return None
    return out[None] if state.labels is None else out


def _gathered(
    state: ShardedState,
    keys: FieldKeys,
    codes: torch.Tensor,
    to: int,
    group: ProcessGroup,
    key_of: Sequence[Hashable],
    groups: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The torch dict of ``keys`` gathered on rank ``to`` (None elsewhere); collective."""
    scalars = gather_scalars(state, keys, to, group)
    codes = merge_codes(codes, group) if keys.shaped else codes
    rank, device = dist.get_rank(group), comm_device(group)
    entries = empty_entries(state, keys, scalars, codes, device) if rank == to else None
    gather_elementwise(state, keys, entries, to, group)
    gather_shaped(state, keys, codes, entries, to, group)
    if entries is None:
        return None
    sd = {key_of[t]: keys.ordered(entry) for t, entry in entries.items()}
    return {"state": sd, "param_groups": groups}


def _keys_in(keys: FieldKeys, key_of: Sequence[Hashable]) -> list[Hashable]:
    """Each plan tensor's key in the torch dict of ``keys``: ``key_of``, or for one label of a
    partition (names aside) its index among that label's tensors (-1 for others)."""
    if keys.tensors is None or any(isinstance(k, str) for k in key_of):
        return list(key_of)
    index = {t: i for i, t in enumerate(sorted(keys.tensors))}
    return [index.get(t, -1) for t in range(len(key_of))]


def _hyper_of(api: str, keys: FieldKeys, hyper: Hyperparams) -> Hyperparams:
    """The hyperparameters for ``keys``: ``hyper``, or for a label of a partition
    ``hyper[label]`` (``hyper`` maps each label to its optimizer's hyperparameters)."""
    if keys.tensors is None or hyper is None:
        return hyper
    if not isinstance(hyper, Mapping) or keys.label not in hyper:
        raise ValueError(
            f"{api}: expected param_groups of a partition to map each label to its "
            f"hyperparameters, got {hyper!r} without label {keys.label!r}"
        )
    return cast(Mapping[Hashable, Any], hyper)[keys.label]


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
    api: str,
    plan: Plan,
    hyper: Hyperparams,
    key_of: Sequence[Hashable],
    keys: FieldKeys | None = None,
) -> list[dict[str, Any]]:
    """torch's ``param_groups``: the hyperparameters of each plan param group and its "params"
    (for one label of a partition, ``keys``: the groups holding its tensors, and those only)."""
    ids = sorted({t.param_group for t in plan.tensors})
    members = [
        [
            key_of[t]
            for t, spec in enumerate(plan.tensors)
            if spec.param_group == pg and (keys is None or keys.covers(t))
        ]
        for pg in ids
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
        if params or keys is None or keys.tensors is None:
            out.append({**{k: v for k, v in h.items() if k != "params"}, "params": params})
    return out


def load_torch_state_dict(
    state: ShardedState,
    torch_sd: Mapping[str, Any],
    *,
    names: Sequence[str] | None = None,
    allow_nonfinite: bool = False,
) -> None:
    """Copies a ``torch.optim`` state dict into this rank's shards, in place (no communication).

    Call it on every rank with the same full dict (e.g. ``torch.load`` of an exported one, or
    :func:`consolidate_state_dict` of another world size or plan): each rank keeps the slices of
    its own pieces. A ``partition``'s state takes ``{label: dict}``, one torch dict per label
    (as :func:`consolidate_state_dict` gives). Hyperparameters in ``param_groups`` are not
    loaded (a core transformation's are fixed at construction); the groups' ``params`` must
    match the plan. Parameters without an entry keep their state, which must still be fresh
    (count 0). Master weights, which torch.optim does not have, are re-initialised from the
    current parameters.

    Every entry is checked before anything is written ([Note: incoming state]): its keys, each
    tensor's shape, dtype (never complex for a real parameter) and memory (no expanded or
    overlapping view), step counts and second moments >= 0, every value finite. The whole dict
    is checked on every rank alike, so every rank given the same dict refuses it together.
    ``allow_nonfinite=True`` loads NaN and inf values (a diverged run, reloaded on purpose).

    Raises:
        ValueError: a state that torch cannot represent, or a dict that does not match the plan
            or the optimizer (a missing or unexpected key, a shape, a dtype, a view, a value out
            of its domain), before anything is written.

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
    write_torch_state_dict(
        "load_torch_state_dict", state, torch_sd, names, allow_nonfinite=allow_nonfinite
    )


def write_torch_state_dict(
    api: str,
    state: ShardedState,
    torch_sd: Any,
    names: Sequence[str] | None = None,
    *,
    allow_nonfinite: bool = False,
    domain: bool = True,
) -> None:
    """:func:`load_torch_state_dict` for ``api``; ``domain=False``: the caller checked the
    values already ([Note: incoming state]), only their form is checked here."""
    state.param_buffers.wait_params()
    keysets = state_keys(state, api, torch_only=True)
    param_buffers, plan = state.param_buffers, state.param_buffers.plan
    key_of = param_keys(api, plan, names)
    entries: list[Mapping[str, Any] | None] = [None] * len(plan.tensors)
    items: list[tuple[EntrySpec, Any]] = []
    for keys, sd in zip(keysets, _dicts_of(api, state, keysets, torch_sd)):
        keyed = _keys_in(keys, key_of)
        specs = torch_form_specs(plan, keys, keyed)
        for t, entry in enumerate(_checked_entries(api, plan, keys, sd, keyed)):
            entries[t] = entries[t] if entry is None else entry
            if entry is not None and (spec := specs[t]) is not None:
                items.append((spec, entry))
    refusal = check_entries(api, items, allow_nonfinite=allow_nonfinite, domain=domain)
    if refusal is not None:
        raise ValueError(refusal)
    slots = piece_slots(param_buffers)
    for k, piece in enumerate(param_buffers.pieces):
        found = keys_of(keysets, piece.tensor)
        if found is not None and entries[piece.tensor] is None and found.count is not None:
            count = piece_value(found.count, param_buffers, k, slots)
            if count.item() != 0:
                raise ValueError(
                    f"{api}: expected an entry for parameter {key_of[piece.tensor]!r}, whose "
                    f"state here has count {count.item():g}; load into a fresh state"
                )
    with torch.no_grad():
        for k, piece in enumerate(param_buffers.pieces):
            entry, found = entries[piece.tensor], keys_of(keysets, piece.tensor)
            if entry is None or found is None:
                continue
            for field, key, in_torch in found.entries:
                dst = piece_value(field, param_buffers, k, slots)
                if not in_torch:  # SGD's count: torch keeps none, a buffer means >= 1 step
                    dst.clamp_(min=1)
                elif field.granularity is FieldGranularity.PER_PIECE:
                    dst.copy_(torch.as_tensor(entry[key]).reshape(()))
                else:
                    dst.copy_(entry[key].reshape(-1)[piece.start : piece.stop])
            for shaped in found.shaped:  # [Note: shaped state]: pieces are whole tensors
                if (whole := shaped.tensors[k]) is not None:
                    whole.copy_(entry[shaped.key])
        state.master.reset()  # from the current parameters ([Note: master weights])


def _dicts_of(
    api: str, state: ShardedState, keysets: Sequence[FieldKeys], torch_sd: Any
) -> list[Any]:
    """The torch dict of each of ``keysets``: ``torch_sd``, or its value at each label of a
    partition (``{label: dict}``, as :func:`consolidate_state_dict` gives)."""
    if state.labels is None:
        return [torch_sd]
    labels = [keys.label for keys in keysets]
    if not isinstance(torch_sd, Mapping) or list(torch_sd) != labels:
        got = list(torch_sd) if isinstance(torch_sd, Mapping) else type(torch_sd).__name__
        raise ValueError(
            f"{api}: expected the state of a partition as one torch dict per label, keyed by "
            f"{labels}, got {got}"
        )
    return [torch_sd[label] for label in labels]


def _checked_entries(
    api: str, plan: Plan, keys: FieldKeys, torch_sd: Any, key_of: Sequence[Hashable]
) -> list[Mapping[str, Any] | None]:
    """Each plan tensor's entry of ``torch_sd["state"]`` (None if absent), the dict's form
    checked (the entries': [Note: incoming state])."""
    if not isinstance(torch_sd, Mapping) or set(torch_sd) != {"state", "param_groups"}:
        got = sorted(torch_sd) if isinstance(torch_sd, Mapping) else type(torch_sd).__name__
        raise ValueError(f"{api}: expected a dict with keys 'param_groups' and 'state', got {got}")
    want = [g["params"] for g in param_group_dicts(api, plan, None, key_of, keys)]
    groups = torch_sd["param_groups"]
    params = [list(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    if params != want:
        raise ValueError(f"{api}: expected param_groups with params {want}, got {params}")
    state = torch_sd["state"]
    known = [k for t, k in enumerate(key_of) if keys.covers(t)]
    unknown = [k for k in state if k not in set(known)]
    if unknown:
        raise ValueError(f"{api}: expected state keys among {known}, got {unknown}")
    return [state.get(key_of[t]) if keys.covers(t) else None for t in range(len(plan.tensors))]
