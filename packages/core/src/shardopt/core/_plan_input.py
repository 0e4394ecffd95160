"""Reads what plan_partition accepts (tensors, specs, pairs, param groups) into TensorSpecs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import torch

from shardopt.core._plan_spec import TensorSpec, short

__all__ = ["collect_specs"]

# [Note: plan inputs]
# ``plan_partition`` takes what torch.optim takes, plus descriptions of tensors:
# - an *item* is a tensor (real or meta), a TensorSpec, or a ``(shape, dtype[, device])`` pair
#   whose shape is a tuple/list of ints and dtype a ``torch.dtype`` or its name;
# - the input is either a sequence of items (one param group) or a sequence of param groups,
#   each a sequence of items or a dict with ``"params"`` (a tensor or a sequence of items).
# The two forms are told apart by their elements, which is unambiguous: a pair's second element
# is a dtype, which no param group contains. In param groups, the group's position sets each
# spec's ``param_group``; in a flat sequence, TensorSpecs keep theirs and the others get 0.
# Like torch.optim, a bare tensor, a set (no order) or one tensor listed twice is refused.


def _is_pair(x: object) -> TypeGuard[Sequence[Any]]:
    return (
        isinstance(x, (tuple, list))
        and len(x) in (2, 3)
        and isinstance(x[0], (tuple, list))
        and all(isinstance(d, int) for d in x[0])
        and isinstance(x[1], (str, torch.dtype))
    )


def _is_item(x: object) -> bool:
    return isinstance(x, (torch.Tensor, TensorSpec)) or _is_pair(x)


def _check_ordered(api: str, where: str, value: object) -> Sequence[Any]:
    if isinstance(value, (torch.Tensor, str, bytes, Mapping, set, frozenset)) or not isinstance(
        value, Iterable
    ):
        raise TypeError(
            f"{api}: expected {where} to be an ordered sequence of tensors, TensorSpecs or "
            f"(shape, dtype[, device]) pairs, got {short(value)}"
        )
    return list(value)


def _group_items(api: str, i: int, group: object) -> Sequence[Any]:
    if isinstance(group, Mapping):
        if "params" not in group:
            raise ValueError(f"{api}: expected param group {i} to have a 'params' key")
        params = group["params"]
        return (
            [params]
            if isinstance(params, torch.Tensor)
            else _check_ordered(api, f"param group {i} 'params'", params)
        )
    return _check_ordered(api, f"param group {i}", group)


def _to_spec(api: str, where: str, x: object, param_group: int | None) -> TensorSpec:
    """The spec of item ``x``; ``param_group=None`` keeps a TensorSpec's own (else 0)."""
    if isinstance(x, torch.Tensor):
        return TensorSpec.from_tensor(x, param_group or 0)
    if isinstance(x, TensorSpec):
        if param_group is None or x.param_group == param_group:
            return x
        return dataclasses.replace(x, param_group=param_group)
    if not _is_pair(x):
        raise TypeError(
            f"{api}: expected a tensor, a TensorSpec or a (shape, dtype[, device]) pair at "
            f"{where}, got {short(x)}"
        )
    dtype = str(x[1]).removeprefix("torch.") if isinstance(x[1], torch.dtype) else x[1]
    device = str(x[2]) if len(x) == 3 else "cpu"
    return TensorSpec(tuple(x[0]), dtype, device, param_group or 0)


def collect_specs(api: str, tensors: object) -> tuple[TensorSpec, ...]:
    """The TensorSpecs of ``tensors``, param groups concatenated (see [Note: plan inputs])."""
    items = _check_ordered(api, "tensors", tensors)
    if not items:
        raise ValueError(f"{api}: expected at least one tensor, got an empty sequence")
    is_item = [_is_item(x) for x in items]
    if all(is_item):
        groups: list[Sequence[Any]] = [items]
    elif not any(is_item):
        groups = [_group_items(api, i, group) for i, group in enumerate(items)]
    else:
        raise TypeError(
            f"{api}: expected a sequence of tensors or a sequence of param groups, not a mix, "
            f"got {short(items)}"
        )
    flat = all(is_item)
    specs: list[TensorSpec] = []
    seen: dict[int, str] = {}
    for i, group in enumerate(groups):
        for j, x in enumerate(group):
            where = f"params[{j}]" if flat else f"param group {i} params[{j}]"
            if isinstance(x, torch.Tensor):
                if id(x) in seen:
                    raise ValueError(
                        f"{api}: expected distinct tensors, got the tensor at {seen[id(x)]} again "
                        f"at {where}"
                    )
                seen[id(x)] = where
            specs.append(_to_spec(api, where, x, None if flat else i))
    if not specs:
        raise ValueError(f"{api}: expected at least one tensor, got only empty param groups")
    return tuple(specs)
