"""torch.optim classes and arguments mapped to the shardopt.core factories with the same rule."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardopt.core import Transformation
from shardopt.core.blocks import TORCH_COMPAT, torch_compat

__all__ = ["CORE_FACTORIES", "LocalOptimizerSpec", "plan_local_optimizer"]

logger = logging.getLogger(__name__)

# The torch.optim classes with a pure counterpart in shardopt.core (same hyperparameter names),
# from core's torch compatibility records. All of them are elementwise: a parameter's update
# reads only its own elements and state.
CORE_FACTORIES: dict[type, Callable[..., Transformation]] = {
    r.torch_class: r.factory for r in TORCH_COMPAT
}


@dataclass(frozen=True, slots=True)
class LocalOptimizerSpec:
    """How to build a local optimizer: a shardopt.core factory, or the class itself.

    ``factory`` is ``None`` for the fallback: ``optimizer_class(params, *args, **kwargs)``.
    """

    optimizer_class: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    factory: Callable[..., Transformation] | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.optimizer_class):
            raise TypeError(
                "DistributedOptimizer: expected an optimizer class as optimizer_class, got "
                f"{self.optimizer_class!r}"
            )


def plan_local_optimizer(
    optimizer_class: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
) -> LocalOptimizerSpec:
    """Maps ``optimizer_class(params, *args, **kwargs)`` to a shardopt.core factory if it can.

    Only the classes of ``CORE_FACTORIES`` themselves map (a subclass may override ``step``), and
    only when every argument has a counterpart in the factory or keeps torch's default; flags that
    pick an implementation (``foreach``, ``fused``, ``capturable``) are dropped. Otherwise the
    spec's ``factory`` is None.

    Example:
        >>> import torch
        >>> plan_local_optimizer(torch.optim.SGD, (), {"lr": 0.1}).factory.__name__
        'sgd'
        >>> plan_local_optimizer(torch.optim.LBFGS, (), {"lr": 0.1}).factory is None
        True
    """
    kwargs = dict(kwargs or {})
    fallback = LocalOptimizerSpec(optimizer_class, tuple(args), kwargs)
    record = torch_compat(optimizer_class)
    if record is None:
        return fallback
    factory = record.factory
    signature = inspect.signature(optimizer_class.__init__)
    try:
        bound = signature.bind(None, None, *args, **kwargs)
    except TypeError:
        return fallback  # arguments torch itself will reject
    bound.apply_defaults()
    accepted = inspect.signature(factory).parameters
    factory_kwargs: dict[str, Any] = {}
    for key, value in list(bound.arguments.items())[2:]:
        if key in record.implementation:
            continue
        if key in accepted:
            factory_kwargs[key] = value
        elif not _is_default(value, signature.parameters[key].default):
            logger.debug("plan_local_optimizer: %s=%r has no shardopt.core counterpart", key, value)
            return fallback
    return LocalOptimizerSpec(optimizer_class, tuple(args), kwargs, factory, factory_kwargs)


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return value is default
    return bool(value == default)
