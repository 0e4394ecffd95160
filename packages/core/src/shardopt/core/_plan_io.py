"""The plain-data form of partition plans: a versioned dict, and its checked reading."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from shardopt.core._plan_spec import FlatGroup, TensorSpec, short

if TYPE_CHECKING:
    from shardopt.core._plan import Plan

__all__ = ["plan_fields", "plan_to_dict"]

_FORMAT_VERSION = 1
_KEYS = {"version", "strategy", "world_size", "align", "tensors", "groups", "owners"}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """``plan`` as plain JSON-compatible data (the body of :meth:`Plan.to_dict`).

    Example:
        >>> from shardopt.core import plan_partition
        >>> data = plan_to_dict(plan_partition([((3, 2), "float32")], 2))
        >>> data["version"], data["strategy"], data["groups"][0]["shard_numel"]
        (1, 'flat', 16)
    """
    return {
        "version": _FORMAT_VERSION,
        "strategy": plan.strategy.value,
        "world_size": plan.world_size,
        "align": plan.align,
        "tensors": [
            {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "device": t.device,
                "param_group": t.param_group,
            }
            for t in plan.tensors
        ],
        "groups": [
            {
                "dtype": g.dtype,
                "device": g.device,
                "tensors": list(g.tensors),
                "offsets": list(g.offsets),
                "shard_numel": g.shard_numel,
                "world_size": g.world_size,
            }
            for g in plan.groups
        ],
        "owners": None if plan.owners is None else list(plan.owners),
    }


def plan_fields(data: Any) -> dict[str, Any]:
    """The :class:`Plan` arguments in ``data`` (a :func:`plan_to_dict` result), its format checked.

    The records become TensorSpecs and FlatGroups here; the Plan checks the rest when built.

    Example:
        >>> from shardopt.core import plan_partition
        >>> fields = plan_fields(plan_to_dict(plan_partition([((3, 2), "float32")], 2)))
        >>> fields["strategy"], fields["tensors"][0].shape, fields["owners"]
        ('flat', (3, 2), None)
    """
    api = "Plan.from_dict"
    if not isinstance(data, Mapping):
        raise TypeError(f"{api}: expected a mapping, got {short(data)}")
    if set(data) != _KEYS:
        raise ValueError(
            f"{api}: expected keys {sorted(_KEYS)}, missing {sorted(_KEYS - set(data))}, "
            f"unexpected {sorted(set(data) - _KEYS)}"
        )
    if data["version"] != _FORMAT_VERSION:
        raise ValueError(f"{api}: expected version {_FORMAT_VERSION}, got {data['version']!r}")
    owners = data["owners"]
    return {
        "strategy": data["strategy"],
        "world_size": data["world_size"],
        "align": data["align"],
        "tensors": tuple(_records(api, "tensors", data["tensors"], TensorSpec)),
        "groups": tuple(_records(api, "groups", data["groups"], FlatGroup)),
        "owners": tuple(owners) if isinstance(owners, list) else owners,
    }


def _records(api: str, name: str, items: Any, kind: type) -> Iterable[Any]:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{api}: expected {name} to be a list, got {short(items)}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"{api}: expected {name}[{i}] to be a mapping, got {short(item)}")
        try:
            yield kind(**item)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{api}: {name}[{i}]: {exc}") from None
