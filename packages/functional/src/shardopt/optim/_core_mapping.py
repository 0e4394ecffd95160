"""torch.optim classes and arguments mapped to the shardopt.core factories with the same rule."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import shardopt.core as core
from shardopt.core import Transformation

__all__ = ["CORE_FACTORIES", "LocalOptimizerSpec", "plan_local_optimizer"]

logger = logging.getLogger(__name__)

# The torch.optim classes with a pure counterpart in shardopt.core (same hyperparameter names).
# All of them are elementwise: a parameter's update reads only its own elements and state.
CORE_FACTORIES: dict[type, str] = {
    torch.optim.SGD: "sgd",
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adamw",
    torch.optim.Adagrad: "adagrad",
    torch.optim.RMSprop: "rmsprop",
    torch.optim.Adamax: "adamax",
    torch.optim.NAdam: "nadam",
    torch.optim.RAdam: "radam",
    torch.optim.Adadelta: "adadelta",
    torch.optim.Rprop: "rprop",
}
# Constructor flags of torch.optim that pick an implementation, not an update rule.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable"})


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
        >>> plan_local_optimizer(torch.optim.ASGD, (), {"lr": 0.1}).factory is None
        True
    """
    kwargs = dict(kwargs or {})
    fallback = LocalOptimizerSpec(optimizer_class, tuple(args), kwargs)
    name = CORE_FACTORIES.get(optimizer_class)
    if name is None:
        return fallback
    try:
        factory = getattr(core, name)
        signature = inspect.signature(optimizer_class.__init__)
        bound = signature.bind(None, None, *args, **kwargs)
    except (AttributeError, ImportError, TypeError):
        return fallback  # no factory yet, or arguments torch itself will reject
    bound.apply_defaults()
    accepted = inspect.signature(factory).parameters
    factory_kwargs: dict[str, Any] = {}
    for key, value in list(bound.arguments.items())[2:]:
        if key in _IMPLEMENTATION_FLAGS:
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
