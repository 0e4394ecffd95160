"""ZeroRedundancyOptimizer's loads: every incoming entry checked before anything is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from shardopt.functional.checkpoint import (
    EntrySpec,
    check_entries,
    field_keys,
    hyperparam_problem,
    torch_form_specs,
)
from shardopt.optim.zero._core_backend import CoreBackend
from shardopt.optim.zero._probe_state import torch_specs
from shardopt.optim.zero._state_dicts import saved_entries

__all__ = ["checked_load", "check_torch_load"]


def _core_specs(
    api: str, backend: CoreBackend, index: Mapping[torch.Tensor, int]
) -> dict[torch.Tensor, EntrySpec]:
    """Parameter -> what the core form makes for it, from its declared state fields."""
    out: dict[torch.Tensor, EntrySpec] = {}
    for g, unit in enumerate(backend.optim.units()):
        if unit is None:
            continue
        keys = field_keys(unit.state, api, torch_only=True)
        plan = unit.state.param_buffers.plan
        specs = torch_form_specs(plan, keys, [index[p] for p in unit.params])
        for p, spec in zip(unit.params, specs):
            if spec is not None:
                out[p] = dataclasses.replace(spec, group=g)
    return out


def check_torch_load(
    api: str,
    specs: Mapping[torch.Tensor, EntrySpec],
    entries: Mapping[torch.Tensor, Any],
    *,
    allow_nonfinite: bool,
    rank: int | None,
) -> None:
    """Raises ValueError naming ``api`` for the first bad entry (see [Note: incoming state]);
    checks everything, writes nothing."""
    items = [(specs[p], entry) for p, entry in entries.items() if entry is not None]
    refusal = check_entries(api, items, allow_nonfinite=allow_nonfinite, rank=rank)
    if refusal is not None:
        raise ValueError(refusal)


def checked_load(
    api: str, zero: Any, state_dict: Any, *, allow_nonfinite: bool
) -> dict[torch.Tensor, Any]:
    """``zero.load_state_dict``'s local part: parameter -> its entry, every entry of the dict
    checked (all of them on every rank, so every rank given the same dict finds the same)."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"{api}: expected a dict with 'state' and 'param_groups', got {got}")
    entries = saved_entries(dict(state_dict), zero.param_groups)
    saved_groups = state_dict["param_groups"]
    problem = hyperparam_problem(api, saved_groups, zero.param_groups)
    if problem is not None:
        raise ValueError(problem)
    backend = zero._backend
    if isinstance(backend, CoreBackend):
        specs = _core_specs(api, backend, zero._param_to_index)
    else:
        cls, defaults = zero._optim_constructor, zero._optim_defaults
        specs = torch_specs(cls, defaults, zero.param_groups, saved_groups)
    check_torch_load(api, specs, entries, allow_nonfinite=allow_nonfinite, rank=zero.rank)
    return entries
