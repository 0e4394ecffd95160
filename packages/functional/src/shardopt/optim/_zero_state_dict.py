"""State dicts of a greedy partition: consolidating the local optimizers' states, and loading."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.functional.engine import ProcessGroup, irecv_from, isend_to
from shardopt.optim._zero_transport import (
    gather_objects,
    pack_tensors,
    snapshot,
    unpack_tensor,
    wait_all,
)

__all__ = ["consolidate_greedy", "load_greedy", "local_states", "saved_entries"]

API = "ZeroRedundancyOptimizer"


def local_states(
    optim: torch.optim.Optimizer, global_index: Callable[[torch.Tensor], int]
) -> dict[int, dict[str, Any]]:
    """The local optimizer's ``state_dict()["state"]`` keyed by global parameter index."""
    local = optim.state_dict()
    order = [p for group in optim.param_groups for p in group["params"]]
    return {
        global_index(order[i]): entry
        for i, entry in local["state"].items()
        if isinstance(i, int) and entry is not None
    }


def _packable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested


def consolidate_greedy(
    states: dict[int, dict[str, Any]],
    *,
    to: int,
    group: ProcessGroup,
    device: torch.device,
) -> dict[int, dict[str, Any]] | None:
    """Every rank's ``states`` (global index -> entry) merged on group rank ``to``; collective.

    See [Note: consolidation without pickled tensors]. The target's own entries are copied (on
    the CPU); the others' are views of one received buffer per rank. Returns None on the other
    ranks.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    buf = None
    meta: Any = None
    if rank != to:
        tensors: list[torch.Tensor] = []
        layout = []
        for index, entry in states.items():
            items: list[tuple[str, int | None, Any]] = []
            for key, value in entry.items():
                if _packable(value):
                    items.append((key, len(tensors), None))
                    tensors.append(value)
                else:
                    items.append((key, None, value))
            layout.append((index, items))
        buf, specs = pack_tensors(tensors, device)
        meta = (layout, specs, buf.numel())
    metas = gather_objects(meta, to=to, group=group, device=device)
    if metas is None:
        assert buf is not None
        work = isend_to(buf, to, group=group) if buf.numel() else None
        if work is not None:
            work.wait()
        return None
    received: list[torch.Tensor | None] = [None] * world
    works = []
    for r in range(world):
        if r != rank and metas[r][2]:
            into = torch.empty(metas[r][2], dtype=torch.uint8, device=device)
            received[r] = into
            works.append(irecv_from(into, r, group=group))
    wait_all(works)
    out = {index: snapshot(entry) for index, entry in states.items()}
    for r in range(world):
        if r != rank:
            out.update(_unpack_states(metas[r], received[r]))
    return out


def _unpack_states(meta: Any, buf: torch.Tensor | None) -> dict[int, dict[str, Any]]:
    layout, specs, _ = meta
    cpu = None if buf is None else buf.cpu()
    out = {}
    for index, items in layout:
        entry = {}
        for key, position, value in items:
            if position is None:
                entry[key] = value
            else:
                assert cpu is not None
                entry[key] = unpack_tensor(cpu, *specs[position])
        out[index] = entry
    return out


def saved_entries(
    state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> dict[torch.Tensor, Any]:
    """Parameter -> its entry in ``state_dict["state"]``, matched by position in the param
    groups as torch.optim does; raises ValueError unless the group sizes are ``groups``'."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{API}.load_state_dict: expected {len(groups)} param groups (as this optimizer "
            f"has), got {len(saved_groups)}"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{API}.load_state_dict: expected param group {i} of {len(group['params'])} "
                f"parameters (as this optimizer has), got {len(saved['params'])}"
            )
    saved_ids = [i for g in saved_groups for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    state = state_dict["state"]
    return {p: state[i] for i, p in zip(saved_ids, params) if i in state}


def load_greedy(
    optim: torch.optim.Optimizer,
    saved_groups: Sequence[dict[str, Any]],
    entry_of: Callable[[torch.Tensor], dict[str, Any] | None],
) -> None:
    """Loads the saved hyperparameters and the entries of this rank's parameters into the local
    optimizer through its own ``load_state_dict`` (its casts and checks apply)."""
    local_groups = []
    state: dict[int, Any] = {}
    index = 0
    for saved, group in zip(saved_groups, optim.param_groups):
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        local_groups.append({**hyper, "params": list(range(index, index + len(group["params"])))})
        for p in group["params"]:
            entry = entry_of(p)
            if entry is not None:
                state[index] = entry
            index += 1
    optim.load_state_dict({"state": state, "param_groups": local_groups})
