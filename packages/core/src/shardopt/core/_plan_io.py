"""The plain-data form of partition plans: a versioned dict, and its checked reading."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from shardopt.core._plan_spec import Bucket, BufferGroup, Strategy, TensorSpec, short

__all__ = ["PlanData", "plan_fields", "plan_to_dict"]

_FORMAT_VERSION = 2
_KEYS = {
    "version",
    "strategy",
    "world_size",
    "align",
    "bucket_numel",
    "tensors",
    "groups",
    "owners",
}


class PlanData(Protocol):
    """What :func:`plan_to_dict` reads of a Plan (typed by shape: ``_plan`` imports this module,
    not the other way round)."""

    @property
    def strategy(self) -> Strategy: ...
    @property
    def world_size(self) -> int: ...
    @property
    def align(self) -> int: ...
    @property
    def bucket_numel(self) -> int | None: ...
    @property
    def tensors(self) -> tuple[TensorSpec, ...]: ...
    @property
    def groups(self) -> tuple[BufferGroup, ...]: ...
    @property
    def owners(self) -> tuple[int, ...] | None: ...


def plan_to_dict(plan: PlanData) -> dict[str, Any]:
    """``plan`` as plain JSON-compatible data (the body of :meth:`Plan.to_dict`).

    Example:
        >>> from shardopt.core import plan_partition
        >>> data = plan_to_dict(plan_partition([((3, 2), "float32")], 2))
        >>> data["version"], data["strategy"], data["groups"][0]["buckets"]
        (2, 'flat', [{'start': 0, 'shards': [16, 16]}])
    """
    return {
        "version": _FORMAT_VERSION,
        "strategy": plan.strategy.value,
        "world_size": plan.world_size,
        "align": plan.align,
        "bucket_numel": plan.bucket_numel,
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
                "buckets": [{"start": b.start, "shards": list(b.shards)} for b in g.buckets],
                "world_size": g.world_size,
            }
            for g in plan.groups
        ],
        "owners": None if plan.owners is None else list(plan.owners),
    }


def plan_fields(data: Any) -> dict[str, Any]:
    """The :class:`Plan` arguments in ``data`` (a :func:`plan_to_dict` result), its format checked.

    The records become TensorSpecs and BufferGroups here; the Plan checks the rest when built.

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
        "bucket_numel": data["bucket_numel"],
        "tensors": tuple(_records(api, "tensors", data["tensors"], TensorSpec)),
        "groups": tuple(_records(api, "groups", data["groups"], _group)),
        "owners": tuple(owners) if isinstance(owners, list) else owners,
    }


def _group(**fields: Any) -> BufferGroup:
    buckets = fields.get("buckets")
    if not isinstance(buckets, (list, tuple)):
        raise TypeError(f"expected buckets to be a list, got {short(buckets)}")
    made = []
    for b in buckets:
        if not isinstance(b, Mapping):
            raise TypeError(f"expected each bucket to be a mapping, got {short(b)}")
        if set(b) != {"start", "shards"}:
            raise ValueError(f"expected each bucket to have keys start and shards, got {sorted(b)}")
        shards = b["shards"]
        made.append(Bucket(b["start"], tuple(shards) if isinstance(shards, list) else shards))
    return BufferGroup(**{**fields, "buckets": tuple(made)})


def _records(api: str, name: str, items: Any, kind: Callable[..., Any]) -> Iterable[Any]:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{api}: expected {name} to be a list, got {short(items)}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"{api}: expected {name}[{i}] to be a mapping, got {short(item)}")
        try:
            yield kind(**item)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{api}: {name}[{i}]: {exc}") from None
