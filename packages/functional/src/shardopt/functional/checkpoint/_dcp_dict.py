"""The DCP state dict of a sharded state, and the checks of a checkpoint's metadata against it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardopt.core import Plan
from shardopt.functional.checkpoint._checkpoint_keys import (
    FieldKeys,
    ListField,
    keys_of,
    outside_tensors,
    piece_slots,
    piece_value,
    sanitised_key,
    state_keys,
)
from shardopt.functional.checkpoint._dcp_pieces import piece_tensor
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._mesh import GlobalPlace, mesh_groups
from shardopt.functional.engine._state import FieldGranularity, ShardedState

__all__ = [
    "HYPERPARAMS",
    "OPTIM_KEY",
    "check_metadata",
    "checkpoint_group",
    "fresh_where_absent",
    "optim_dict",
    "state_keysets",
]

OPTIM_KEY = "optim"
HYPERPARAMS = f"{OPTIM_KEY}.hyperparams."  # [Note: hyperparameters of a sharded state]


def _places(state: ShardedState) -> Sequence[GlobalPlace | None]:
    """Each plan tensor's place in its full DTensor, or None (see [Note: tensor-parallel
    checkpoints])."""
    param_buffers = state.param_buffers
    return param_buffers.global_places or (None,) * len(param_buffers.plan.tensors)


def optim_dict(
    state: ShardedState,
    keysets: Sequence[FieldKeys],
    names: Sequence[str],
    present: Callable[[FieldKeys, int, int], bool],
    masters: Callable[[int], bool],
    fulls: Sequence[torch.Tensor | None],
) -> dict[str, Any]:
    """This rank's DCP dict: ``{"state": {name: {key: tensor}}, "master_weights": {name:
    tensor}, "replicated": {path: tensor}}`` for the tensors ``present(keys, t, k)`` says; the
    master weights are views of ``fulls`` (``state.master.fulls()``: float32 per group)."""
    param_buffers, plan = state.param_buffers, state.param_buffers.plan
    slots = piece_slots(param_buffers)
    places = _places(state)
    entries: dict[str, dict[str, torch.Tensor]] = {}
    master_weights: dict[str, torch.Tensor] = {}
    for k, piece in enumerate(param_buffers.pieces):
        t, shape, place = piece.tensor, plan.tensors[piece.tensor].shape, places[piece.tensor]
        master = fulls[piece.group]
        if master is not None and masters(t):
            flat = master[piece.offset : piece.offset + piece.numel]
            master_weights[names[t]] = piece_tensor(shape, piece, flat, place)
        keys = keys_of(keysets, t)
        if keys is None or not present(keys, t, k):
            continue
        entry = entries.setdefault(names[t], {})
        for field, key, _ in keys.entries:
            if field.granularity is FieldGranularity.PER_PIECE:
                entry[key] = piece_value(field, param_buffers, k, slots)
            else:
                entry[key] = piece_tensor(
                    shape, piece, piece_value(field, param_buffers, k, slots), place
                )
        for shaped in keys.shaped:  # whole on their owner: plain tensors ([Note: shaped state])
            if (whole := shaped.tensors[k]) is not None:
                entry[shaped.key] = whole
    replicated = {sanitised_key(p): x for p, x, shared in outside_tensors(state) if shared}
    return {"state": entries, "master_weights": master_weights, "replicated": replicated}


def checkpoint_group(api: str, state: ShardedState, group: Any) -> ProcessGroup:
    """The group that saves or loads ``state``: the default group for tensor-parallel and hybrid
    states ([Note: tensor-parallel checkpoints]). Raises ValueError, on every calling rank alike
    and before any collective, if their ranks do not span the world."""
    param_buffers, shard_group = state.param_buffers, mesh_groups(api, group).shard
    if param_buffers.global_places is None and param_buffers.replicate is None:
        return shard_group
    replicas = (
        1 if param_buffers.replicate is None else dist.get_world_size(param_buffers.replicate)
    )
    split = param_buffers.tensor_parallel
    tp = 1 if split is None else dist.get_world_size(split.group)
    spans = dist.get_world_size(shard_group) * replicas * tp
    if spans != dist.get_world_size():  # the same on every calling rank: no collective needed
        raise ValueError(
            f"{api}: expected a tensor-parallel or hybrid state whose ranks span the world "
            f"(all {dist.get_world_size()} ranks save and load it together), got "
            f"{spans} ranks (data-parallel x replicas x tensor-parallel)"
        )
    return dist.group.WORLD


def state_keysets(
    api: str, state: ShardedState, extra: Any
) -> tuple[tuple[FieldKeys, ...], str | BaseException | None]:
    """The state's keys and the first problem of the input (for the agreement), if any."""
    try:
        keysets = state_keys(state, api)
    except ValueError as exc:  # the same structure everywhere, but ride the agreement anyway
        return (), exc
    return keysets, _common_checks(state, keysets, extra)


def _common_checks(state: ShardedState, keysets: Sequence[FieldKeys], extra: Any) -> str | None:
    listed = {s.path for keys in keysets for s in keys.shaped}
    listed |= {f.path for keys in keysets for f, _, _ in keys.entries if isinstance(f, ListField)}
    per_piece = [
        path
        for path, _, replicated in outside_tensors(state)
        if not replicated and path.rsplit("[", 1)[0] not in listed
    ]
    if per_piece:
        return f"every per-parameter tensor of the state in a field, got others at {per_piece}"
    if any(keys.shaped for keys in keysets) and state.param_buffers.global_places is not None:
        return "no shaped state (Adafactor's row_var, col_var) with DTensor parameters"
    if extra is not None and (not isinstance(extra, Mapping) or OPTIM_KEY in extra):
        return f"extra to be a mapping without the key {OPTIM_KEY!r}, got {type(extra).__name__}"
    return None


def check_metadata(
    api: str, state: ShardedState, keysets: Sequence[FieldKeys], names: Sequence[str], md: Any
) -> tuple[str | None, list[bool], list[bool]]:
    """(the first problem of the checkpoint for ``state``, whether each tensor has state in it,
    whether it has master weights); the same on every rank (plan and file are)."""
    plan: Plan = state.param_buffers.plan
    places = _places(state)
    saved = md.state_dict_metadata
    prefix = f"{OPTIM_KEY}.state."
    wants = [
        _wanted(keys_of(keysets, t), spec.shape, places[t]) for t, spec in enumerate(plan.tensors)
    ]
    expected = {f"{prefix}{n}.{key}" for n, want in zip(names, wants) for key in want}
    unknown = sorted(k for k in saved if k.startswith(prefix) and k not in expected)
    if unknown:
        return f"state keys among those of this optimizer and plan, got {unknown[:4]}", [], []
    present, masters = [], []
    for t, spec in enumerate(plan.tensors):
        base, want = f"{prefix}{names[t]}.", wants[t]
        have = [key for key in want if base + key in saved]
        present.append(bool(have) and spec.numel > 0)
        masters.append(f"{OPTIM_KEY}.master_weights.{names[t]}" in saved)
        if have and len(have) != len(want):
            return f"keys {list(want)} for parameter {names[t]!r}, got {have}", [], []
        for key, shape in want.items() if have else ():
            item = saved[base + key]
            if not isinstance(item, TensorStorageMetadata) or item.size != shape:
                got = getattr(item, "size", type(item).__name__)
                return f"{base + key} of shape {tuple(shape)}, got {got}", [], []
    for path, _, replicated in outside_tensors(state):
        if replicated and f"{OPTIM_KEY}.replicated.{sanitised_key(path)}" not in saved:
            return f"the replicated state {path} in the checkpoint, got none", [], []
    return None, present, masters


def _wanted(
    keys: FieldKeys | None, shape: tuple[int, ...], place: GlobalPlace | None
) -> dict[str, torch.Size]:
    """The saved keys of a parameter of ``shape`` (at ``place``), with their shapes."""
    if keys is None:
        return {}
    full = shape if place is None else place.shape
    want = {
        key: torch.Size(() if field.granularity is FieldGranularity.PER_PIECE else full)
        for field, key, _ in keys.entries
    }
    want.update({key: torch.Size(s) for key, s in keys.shapes(shape, torch.float32).items()})
    return want


def fresh_where_absent(
    state: ShardedState,
    keysets: Sequence[FieldKeys],
    names: Sequence[str],
    present: Sequence[bool],
) -> str | None:
    slots = piece_slots(state.param_buffers)
    for k, piece in enumerate(state.param_buffers.pieces):
        keys = keys_of(keysets, piece.tensor)
        if keys is None or keys.count is None or present[piece.tensor]:
            continue
        count = piece_value(keys.count, state.param_buffers, k, slots).item()
        if count != 0:
            return (
                f"state in the checkpoint for parameter {names[piece.tensor]!r}, whose state "
                f"here has count {count:g} (load into a fresh state)"
            )
    return None
