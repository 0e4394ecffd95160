"""ZeroRedundancyOptimizer's ``train()`` / ``eval()``, for local optimizers that have them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardopt.functional.engine import fails_together
from shardopt.optim._zero_params import API, on_device
from shardopt.optim._zero_partition import copy_hyperparameters

__all__ = ["ZeroModes"]

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


class ZeroModes:
    """``train`` and ``eval`` of ZeroRedundancyOptimizer (a mixin): attributes that exist only
    when its local optimizer has them (see [Note: optimizer modes])."""

    # what the methods read of the optimizer (set by its constructor)
    param_groups: list[dict[str, Any]]
    optim: Any
    _backend: Any
    _default_device: Any

    @property
    def train(self) -> Callable[[], None]:
        """Switches every parameter on every rank to the local optimizer's train mode."""
        return self._mode("train")

    @property
    def eval(self) -> Callable[[], None]:
        """Switches every parameter on every rank to the local optimizer's eval mode."""
        return self._mode("eval")

    def _mode(self, name: str) -> Callable[[], None]:
        local = getattr(self.optim, name, None)
        if not callable(local):
            raise AttributeError(
                f"{API}.{name}: the local optimizer {type(self.optim).__name__} has no {name}()"
            )

        @fails_together(f"{API}.{name}")
        def switch() -> None:
            self._backend.wait_params()
            copy_hyperparameters(self.param_groups, self.optim.param_groups)
            local()
            copy_hyperparameters(self.optim.param_groups, self.param_groups)
            with on_device(self._default_device):
                self._backend.sync_all()

        switch.__name__ = switch.__qualname__ = name
        return switch
