"""partition="flat": ZeroRedundancyOptimizer's backend over shardopt.functional's shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.functional import ParamBuffers
from shardopt.functional.engine import ProcessGroup
from shardopt.optim.zero._core_optimizer import (
    DDP_AVERAGED,
    CoreShardOptimizer,
    Wire,
    torch_defaults,
)
from shardopt.optim.zero._partition import copy_hyperparameters, flat_partition, owners

__all__ = ["CoreBackend"]


class CoreBackend:
    """The flat partition behind ZeroRedundancyOptimizer: ``optim`` is a CoreShardOptimizer, one
    ``shard`` per param group (see [Note: the flat local optimizer])."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        wire: Wire = DDP_AVERAGED,
        *,
        group: ProcessGroup,
        world_size: int,
    ) -> None:
        like = next(p for g in param_groups for p in g["params"])
        full = torch_defaults(optimizer_class, defaults, like)
        self.optim = CoreShardOptimizer(optimizer_class, full, group, world_size, wire)
        self.world_size = world_size
        for g in param_groups:
            self.prepare(g)

    def prepare(self, group: dict[str, Any]) -> None:
        """Fills the class's defaults into ``group`` and checks that shardopt.core runs it."""
        self.optim.prepare(group)

    def start(self, param_groups: list[dict[str, Any]]) -> None:
        """Shards every group (collective)."""
        for g in param_groups:
            self.optim.add_param_group(g)

    def add_group(self, param_groups: list[dict[str, Any]]) -> None:
        """Shards the new group into flat buffers of its own."""
        self.optim.add_param_group(param_groups[-1])

    def step(
        self,
        param_groups: list[dict[str, Any]],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """Every group's update and parameter all-gather (``shard``'s step)."""
        self.wait_params()
        copy_hyperparameters(param_groups, self.optim.param_groups)
        loss = self.optim.step(closure, **kwargs)
        copy_hyperparameters(self.optim.param_groups, param_groups)
        return loss

    def wait_params(self) -> None:
        """Waits for every group's gathers left in flight (param hooks)."""
        for param_buffers in self.view_buffers():
            param_buffers.wait_params()

    def view_buffers(self) -> list[ParamBuffers]:
        """Each sharded group's ParamBuffers."""
        return [u.state.param_buffers for u in self.optim.units() if u is not None]

    def hook_targets(self, api: str) -> list[Any]:
        """Each sharded group's state."""
        return [u.state for u in self.optim.units() if u is not None]

    def partition(self, param_groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Per rank, each group with the parameters that have elements on the rank."""
        return flat_partition(param_groups, self.optim.units(), self.world_size)

    def owners(self, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, int]:
        """Parameter -> the rank holding its first element."""
        return owners(param_groups, [None if u is None else u.plan for u in self.optim.units()])

    def consolidate(
        self, param_groups: list[dict[str, Any]], index: dict[torch.Tensor, int], *, to: int
    ) -> dict[int, dict[str, Any]] | None:
        """Every group's state in torch's form on rank ``to`` ([Note: flat state in torch's
        form])."""
        copy_hyperparameters(param_groups, self.optim.param_groups)
        return self.optim.consolidate(index, to=to)

    def sync_all(self) -> None:
        """Every group's all-gather (collective)."""
        for param_buffers in self.view_buffers():
            param_buffers.sync_params()

    def load(
        self,
        saved_groups: Sequence[dict[str, Any]],
        entries: dict[torch.Tensor, Any],
        wide: dict[Any, Any] | None = None,
    ) -> None:
        """Loads the entries into this rank's slices (the hyperparameters come with the next
        step, from the optimizer's groups; the core forms keep no optimizer-wide state)."""
        self.optim.load(entries)
