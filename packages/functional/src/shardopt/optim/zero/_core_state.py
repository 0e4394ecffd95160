"""partition='flat' state in torch.optim's form, through shardopt.functional's checkpoint code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardopt.functional import ShardedState, consolidate_state_dict
from shardopt.functional.checkpoint import (
    field_keys,
    has_state,
    piece_value,
    to_cpu,
    write_torch_state_dict,
)
from shardopt.functional.engine import ProcessGroup, piece_slots
from shardopt.optim.zero._params import API

__all__ = ["consolidate_flat", "load_flat", "piece_entries"]


# [Note: flat state in torch's form]
# The torch names of the core states, consolidation by gathers and loading are
# shardopt.functional's (``field_keys``, ``consolidate_state_dict``, ``load_torch_state_dict``,
# see [Note: torch state keys] and [Note: consolidation by gathers]); each param group is one
# sharded state, whose tensor t is the group's t-th parameter. Two things are ours: the keys are
# moved to the global parameter indices, and loading follows torch.optim's semantics, where a
# parameter without an entry in the loaded dict starts afresh (its state is reset first, as
# ``load_torch_state_dict`` only fills fresh states). A group of whole tensors (Muon, Adafactor)
# shows each piece's state in its parameter's shape, Adafactor's ``row_var``/``col_var``/
# ``variance`` included ([Note: shaped state]).


def piece_entries(state: ShardedState) -> dict[int, dict[str, torch.Tensor]]:
    """Piece index -> torch-named views of its state, for pieces torch would hold state for."""
    keys = field_keys(state, API, torch_only=True)
    param_buffers = state.param_buffers
    plan = param_buffers.plan
    slots = piece_slots(param_buffers)
    out = {}
    for k, piece in enumerate(param_buffers.pieces):
        count = None if keys.count is None else piece_value(keys.count, param_buffers, k, slots)
        if keys.count is None and not keys.eager:
            continue  # no state at all (SGD without momentum)
        if not has_state(keys, count):
            continue
        entry = {
            key: piece_value(f, param_buffers, k, slots) for f, key, kept in keys.entries if kept
        }
        if plan.is_whole(piece.tensor):  # in its shape
            shape = plan.tensors[piece.tensor].shape
            entry = {key: v if v.dim() == 0 else v.view(shape) for key, v in entry.items()}
        entry.update({s.key: t for s in keys.shaped if (t := s.tensors[k]) is not None})
        out[k] = keys.ordered(entry)
    return out


def consolidate_flat(
    units: Sequence[Any],
    global_index: Sequence[Sequence[int]],
    *,
    to: int,
    group: ProcessGroup,
) -> dict[int, dict[str, Any]] | None:
    """Every group's state in torch's form on rank ``to`` (None elsewhere), keyed by global index
    ``global_index[i][t]`` of group i's t-th parameter; collective."""
    out: dict[int, dict[str, Any]] = {}
    for unit, index in zip(units, global_index):
        if unit is None:
            continue
        sd = consolidate_state_dict(unit.state, None, to=to, process_group=group)
        if sd is not None:
            out.update({index[t]: to_cpu(entry) for t, entry in sd["state"].items()})
    return out if torch.distributed.get_rank(group) == to else None


def load_flat(unit: Any, entries: Sequence[dict[str, Any] | None]) -> None:
    """Loads torch-form ``entries`` (one per parameter of the group, None: none), checked already
    ([Note: incoming state]), into this rank's slice of the group's state (see [Note: flat
    state in torch's form])."""
    param_buffers = unit.state.param_buffers
    slots = piece_slots(param_buffers)
    shaped = field_keys(unit.state, API, torch_only=True).shaped
    with torch.no_grad():
        for k, piece in enumerate(param_buffers.pieces):
            if entries[piece.tensor] is not None:
                continue
            for f in unit.state.fields:
                piece_value(f, param_buffers, k, slots).fill_(unit.initial[f.path][piece.group])
            for s in shaped:  # Adafactor's second moments, which start at zero
                if (t := s.tensors[k]) is not None:
                    t.zero_()
    state = {t: e for t, e in enumerate(entries) if e is not None}
    sd = {"state": state, "param_groups": [{"params": list(range(len(entries)))}]}
    write_torch_state_dict(f"{API}.load_state_dict", unit.state, sd, domain=False)
