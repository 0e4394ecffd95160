"""ZeroRedundancyOptimizer's ``train()`` / ``eval()``, for local optimizers that have them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardopt.functional.engine import fails_together
from shardopt.optim.zero._params import API, on_device
from shardopt.optim.zero._partition import copy_hyperparameters

__all__ = ["mode_switch"]

# [Note: optimizer modes]
# Schedule-free optimizers keep two points per parameter, the one gradients are taken at (train
# mode) and the average one evaluated (eval mode); their ``train()`` and ``eval()`` move each
# parameter between the two, from its state, and record the mode in every param group
# (``train_mode``). Under ZeroRedundancyOptimizer a rank holds the state of its own parameters
# only, so the wrapper's ``train()`` / ``eval()`` (present exactly when the local optimizer has
# them: ``hasattr`` tells) gives the local optimizer the wrapper's hyperparameters, switches it,
# copies its groups' hyperparameters (the mode) back, and syncs every parameter from its owner:
# afterwards every rank holds every parameter in the new mode. Must be called on every rank.
# The mode lives in the param groups, so state dicts carry it both ways.


def mode_switch(
    name: str,
    optim: Any,
    param_groups: list[dict[str, Any]],
    backend: Any,
    device: torch.device,
) -> Callable[[], None]:
    """ZeroRedundancyOptimizer's ``train`` or ``eval`` (``name``): switches every parameter on
    every rank to the local optimizer ``optim``'s mode (see [Note: optimizer modes]).

    Raises:
        AttributeError: ``optim`` has no such method (so ``hasattr`` on the wrapper tells).
    """
    local = getattr(optim, name, None)
    if not callable(local):
        name_of = type(optim).__name__
        raise AttributeError(f"{API}.{name}: the local optimizer {name_of} has no {name}()")

    @fails_together(f"{API}.{name}")
    def switch() -> None:
        backend.wait_params()
        copy_hyperparameters(param_groups, optim.param_groups)
        local()
        copy_hyperparameters(optim.param_groups, param_groups)
        with on_device(device):
            backend.sync_all()

    switch.__name__ = switch.__qualname__ = name
    return switch
