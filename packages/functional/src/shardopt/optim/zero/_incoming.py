"""ZeroRedundancyOptimizer's loads: every incoming entry checked before anything is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
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

__all__ = ["check_optimizer_load", "check_torch_load", "checked_load"]


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
    held: Container[torch.Tensor] | None = None,
) -> None:
    """Raises ValueError naming ``api`` for the first bad entry (see [Note: incoming state]):
    the form of every entry, the values of those of ``held`` (None: all); writes nothing."""
    items = [(specs[p], entry) for p, entry in entries.items() if entry is not None]
    refusal = check_entries(api, items, rank=rank, domain=False)
    if refusal is None:
        mine = [(specs[p], e) for p, e in entries.items() if e is not None and _in(p, held)]
        refusal = check_entries(api, mine, allow_nonfinite=allow_nonfinite, rank=rank)
    if refusal is not None:
        raise ValueError(refusal)


def _in(p: torch.Tensor, held: Container[torch.Tensor] | None) -> bool:
    return held is None or p in held


def checked_load(
    api: str, zero: Any, state_dict: Any, *, allow_nonfinite: bool
) -> dict[torch.Tensor, Any]:
    """``zero.load_state_dict``'s local part: parameter -> its entry, the form of every entry
    checked on every rank, the values of those this rank loads (a refusal reaches the others
    through the agreement)."""
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
    held = {p for g in zero._partition_parameters()[zero.rank] for p in g["params"]}
    check_torch_load(
        api, specs, entries, allow_nonfinite=allow_nonfinite, rank=zero.rank, held=held
    )
    return entries


def check_optimizer_load(
    api: str, optim: torch.optim.Optimizer, state_dict: Any, *, allow_nonfinite: bool
) -> None:
    """Checks a state dict for a local torch optimizer ``optim`` (probed record of its class,
    see [Note: probed state records]) without loading it; a dict whose param groups do not
    match ``optim``'s is left for ``optim.load_state_dict`` to refuse."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{api}: expected a state dict, got {type(state_dict).__name__}")
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    groups = optim.param_groups
    if not isinstance(saved_groups, list) or not isinstance(state, Mapping):
        return
    sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in saved_groups]
    if sizes != [len(g["params"]) for g in groups]:
        return
    problem = hyperparam_problem(api, saved_groups, groups)
    if problem is not None:
        raise ValueError(problem)
    ids = [i for g in saved_groups for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    entries = {p: state[i] for i, p in zip(ids, params) if i in state}
    specs = torch_specs(type(optim), dict(optim.defaults), groups, saved_groups)
    check_torch_load(api, specs, entries, allow_nonfinite=allow_nonfinite, rank=None)
