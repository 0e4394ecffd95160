"""Who updates which parameter: torch's greedy assignment as a core plan, in torch's shapes."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from shardopt.core import Plan, plan_partition
from shardopt.optim.zero._params import API

__all__ = [
    "copy_hyperparameters",
    "flat_partition",
    "greedy_plan",
    "owners",
    "partition_parameters",
    "step_only",
]


# [Note: the greedy partition]
# ``plan_partition(param groups, W, strategy="greedy")`` is torch's assignment exactly (see
# [Note: greedy matches torch]): per param group in order, the parameters sorted by size, largest
# first, each to the rank with the smallest running total; totals carry over between groups and
# count every parameter, frozen ones included. The plan's tensors are the parameters in param-group
# order, so plan tensor t is global index t of the state dict. A rank's local optimizer receives
# one group per param group (empty where it owns none), its parameters in the order torch gives
# them (the sorted order), so that its local state dict reads like torch's. Appending a param
# group never moves the parameters of the earlier groups, which is why ``add_param_group`` can
# add one group to the local optimizers.


def greedy_plan(param_groups: Sequence[dict[str, Any]], world_size: int) -> Plan:
    """The greedy plan of ``param_groups`` (see [Note: the greedy partition]).

    Example:
        >>> groups = [{"params": [torch.zeros(9), torch.zeros(7), torch.zeros(5)]}]
        >>> greedy_plan(groups, 2).owners
        (0, 1, 1)
    """
    return plan_partition(
        [{"params": list(g["params"])} for g in param_groups], world_size, strategy="greedy"
    )


def partition_parameters(
    param_groups: Sequence[dict[str, Any]], plan: Plan
) -> list[list[dict[str, Any]]]:
    """torch's ``_partition_parameters()``: per rank, a copy of every group with the parameters
    that rank owns, largest first.

    Example:
        >>> groups = [{"params": [torch.zeros(9), torch.zeros(7), torch.zeros(5)], "lr": 0.1}]
        >>> per_rank = partition_parameters(groups, greedy_plan(groups, 2))
        >>> [[len(g["params"]) for g in rank] for rank in per_rank]
        [[1], [2]]
    """
    assert plan.owners is not None
    out: list[list[dict[str, Any]]] = [[] for _ in range(plan.world_size)]
    t = 0
    for group in param_groups:
        params = list(group["params"])
        index = range(t, t + len(params))
        by_size = sorted(index, key=lambda i: -plan.tensors[i].numel)
        for rank in range(plan.world_size):
            local = copy.copy(group)
            local["params"] = [params[i - t] for i in by_size if plan.owners[i] == rank]
            out[rank].append(local)
        t += len(params)
    return out


def flat_partition(
    param_groups: Sequence[dict[str, Any]], units: Sequence[Any], world_size: int
) -> list[list[dict[str, Any]]]:
    """Per rank, a copy of every group with the parameters that have elements on the rank, for a
    flat partition (``units[i].plan`` is group i's; ``units[i]`` None for an empty group)."""
    out: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    for group, unit in zip(param_groups, units):
        for r in range(world_size):
            held = set() if unit is None else {p.tensor for p in unit.plan.pieces(r)}
            local = copy.copy(group)
            local["params"] = [p for t, p in enumerate(group["params"]) if t in held]
            out[r].append(local)
    return out


def owners(
    param_groups: Sequence[dict[str, Any]], plans: Sequence[Plan | None]
) -> dict[torch.Tensor, int]:
    """Parameter -> the rank that updates it, from one plan over all groups (greedy) or one per
    group (flat; None for an empty group), where it is the rank holding the first element."""
    if len(plans) == 1:
        per_plan = [[p for g in param_groups for p in g["params"]]]
    else:
        per_plan = [list(g["params"]) for g in param_groups]
    out: dict[torch.Tensor, int] = {}
    for plan, params in zip(plans, per_plan):
        if plan is None:
            continue
        for t, p in enumerate(params):
            if plan.owners is not None:
                out[p] = plan.owners[t]
            else:
                pieces = plan.tensor_pieces(t)
                out[p] = pieces[0][0] if pieces else 0
    return out


def step_only(optim: torch.optim.Optimizer, keep: set[int]) -> None:
    """``optim.step()`` over the parameters whose ``id`` is in ``keep``: the others leave its
    param groups for the call (their state untouched) and come back to their places."""
    saved = [group["params"] for group in optim.param_groups]
    try:
        for group, params in zip(optim.param_groups, saved):
            group["params"] = [p for p in params if id(p) in keep]
        optim.step()
    finally:
        for group, params in zip(optim.param_groups, saved):
            group["params"] = params


def copy_hyperparameters(
    src_param_groups: Sequence[dict[str, Any]], dst_param_groups: Sequence[dict[str, Any]]
) -> None:
    """Copies every key but ``"params"`` of each source group into its destination group (the
    hyperparameters between ZeroRedundancyOptimizer's groups and its local optimizer's).

    Example:
        >>> dst = [{"params": [], "lr": 0.1}]
        >>> copy_hyperparameters([{"params": [1], "lr": 0.5}], dst)
        >>> dst
        [{'params': [], 'lr': 0.5}]
    """
    if len(src_param_groups) != len(dst_param_groups):
        raise ValueError(
            f"{API}: expected as many source as destination param groups, got "
            f"{len(src_param_groups)} and {len(dst_param_groups)}"
        )
    for src, dst in zip(src_param_groups, dst_param_groups):
        for key, value in src.items():
            if key != "params":
                dst[key] = value
