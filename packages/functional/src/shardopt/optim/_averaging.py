"""average_parameters: averages parameters in place across a group, one all-reduce per dtype."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from shardopt.functional.engine import (
    ProcessGroup,
    average_flat,
    check_averageable,
    in_group,
    resolve_group,
)

__all__ = ["average_parameters", "collect_params"]

ParamsOrGroups = Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]

# [Note: averaging in place]
# torch's ``average_parameters`` rebinds ``p.data`` to a slice of its reduced buffer. Here the
# average is copied into each parameter instead: the parameter keeps its storage, so views of it
# (ZeRO's bucket views, FSDP's flat parameters) and the version counter stay valid, at the cost of
# one copy per parameter. The values are the same.


def collect_params(
    api: str, params_or_param_groups: ParamsOrGroups, *, only_with_grad: bool = False
) -> list[torch.Tensor]:
    """The tensors of a list of tensors and/or param groups, each once, in order.

    With ``only_with_grad`` the tensors whose ``.grad`` is ``None`` are left out, as torch's
    averagers leave them out.
    """
    if isinstance(params_or_param_groups, torch.Tensor):
        raise TypeError(
            f"{api}: expected an iterable of tensors or param groups, got a tensor "
            "(wrap it in a list)"
        )
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    for entry in params_or_param_groups:
        if isinstance(entry, Mapping):
            if "params" not in entry:
                raise ValueError(
                    f"{api}: expected a param group with a 'params' key, got keys {sorted(entry)}"
                )
            members = entry["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
        elif isinstance(entry, torch.Tensor):
            members = [entry]
        else:
            raise TypeError(
                f"{api}: expected tensors or param groups (dicts), got {type(entry).__name__}"
            )
        for p in members:
            if isinstance(p, torch.Tensor) and (
                id(p) in seen or (only_with_grad and p.grad is None)
            ):
                continue
            check_averageable(api, p)
            seen.add(id(p))
            params.append(p)
    return params


@torch.no_grad()
def average_parameters(
    params_or_param_groups: ParamsOrGroups,
    process_group: ProcessGroup | None = None,
    *,
    only_with_grad: bool = False,
) -> None:
    """Replaces each parameter by its mean across ``process_group`` (default: the whole world).

    Takes tensors (``model.parameters()``) or param groups (``optimizer.param_groups``). The
    parameters are flattened into one buffer per (dtype, device), each rank divides it by the group
    size and one ``all_reduce`` per buffer sums the quotients; the results are copied back in
    place (see [Note: averaging in place]). A rank outside ``process_group`` returns at once. With
    ``only_with_grad`` the parameters without a gradient are left as they are: what torch's
    averagers average. A collective: every rank of the group calls it with the same parameters.

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> average_parameters([{"params": [p]}])
        >>> p.data
        tensor([1., 1.])
        >>> dist.destroy_process_group()

    Raises:
        TypeError: for an entry that is neither a tensor nor a param group.
        ValueError: for a parameter that is not floating point or complex.
        RuntimeError: without ``process_group`` when no default group is initialized.
    """
    params = collect_params(
        "average_parameters", params_or_param_groups, only_with_grad=only_with_grad
    )
    group = resolve_group("average_parameters", process_group)
    if not params or not in_group(group):
        return
    for p, mean in zip(params, average_flat(params, group)):
        p.copy_(mean)
