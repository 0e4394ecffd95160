"""The trainers that items c, d and f build: torch's optimizers and shardopt's, on one model each,
all from the same weights and fed the same batches."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "LR",
    "Trainer",
    "device_batch",
    "drop_in",
    "max_rel_error",
    "rel_error",
    "shard_trainer",
    "torch_adamw",
    "torch_zero",
]

LR = 1e-3


class Trainer:
    """A model and the optimizer that steps it: ``backward(batch)``, ``step()``, ``settle()``
    (waits for parameter all-gathers left in flight), ``state`` (shardopt's, else None)."""

    def __init__(self, name: str, model: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        self.name, self.model, self.loss = name, model, loss
        self.params = list(model.parameters())
        self.opt: Any = None
        self.sharded: Any = None
        self.state: Any = None
        self.hooks: list[Any] = []

    def backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for p in self.params:
            p.grad = None
        loss = self.loss(self.model, batch)
        loss.backward()
        return loss.detach()

    def step(self) -> None:
        if self.sharded is None:
            self.opt.step()
        else:
            self.state = self.sharded.step(self.params, None, self.state)

    def settle(self) -> None:
        if self.sharded is not None:
            from shardopt.functional import wait_params

            wait_params(self.state)
        elif hasattr(self.opt, "wait_params"):
            self.opt.wait_params()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def device_batch(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``batch`` with every tensor on ``device``."""
    return tuple(t.to(device) for t in batch)


def _copy(model: nn.Module, device: torch.device) -> nn.Module:
    return copy.deepcopy(model).to(device)


def torch_adamw(model: nn.Module, device: torch.device, loss: Callable[..., Any]) -> Trainer:
    """torch.optim.AdamW(fused=True) on a copy of ``model``."""
    t = Trainer("torch AdamW(fused=True)", _copy(model, device), loss)
    t.opt = torch.optim.AdamW(t.params, lr=LR, fused=True)
    return t


def torch_zero(model: nn.Module, device: torch.device, loss: Callable[..., Any]) -> Trainer:
    """torch.distributed.optim.ZeroRedundancyOptimizer(AdamW, fused=True, bucket views)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    t = Trainer("torch ZeroRedundancyOptimizer", _copy(model, device), loss)
    t.opt = ZeroRedundancyOptimizer(
        t.params,
        optimizer_class=torch.optim.AdamW,
        parameters_as_bucket_view=True,
        lr=LR,
        fused=True,
    )
    return t


def drop_in(
    model: nn.Module, device: torch.device, loss: Callable[..., Any], partition: str
) -> Trainer:
    """shardopt.optim.ZeroRedundancyOptimizer(AdamW, fused=True) with ``partition``."""
    from shardopt.optim import ZeroRedundancyOptimizer

    t = Trainer(f"drop-in partition={partition}", _copy(model, device), loss)
    t.opt = ZeroRedundancyOptimizer(
        t.params,
        torch.optim.AdamW,
        parameters_as_bucket_view=True,
        partition=partition,
        lr=LR,
        fused=True,
    )
    return t


def shard_trainer(
    model: nn.Module,
    device: torch.device,
    loss: Callable[..., Any],
    *,
    stage: int,
    strategy: str,
    overlaps: bool = True,
    bucket_numel: int | None = None,
) -> Trainer:
    """``shard(adamw, plan, stage=stage)`` over a ``strategy`` plan of the default group's size;
    with ``overlaps``, gradient hooks (reduce-scatter in backward) and parameter hooks (the
    all-gather left to the next forward). ``bucket_numel`` None: plan_partition's default."""
    from shardopt.core import adamw, plan_partition
    from shardopt.functional import register_grad_hooks, register_param_hooks, shard

    hooks = "both overlaps" if overlaps else "no hooks"
    t = Trainer(f"shard stage {stage} {strategy}, {hooks}", _copy(model, device), loss)
    buckets: dict[str, Any] = {} if bucket_numel is None else {"bucket_numel": bucket_numel}
    plan = plan_partition(t.params, dist.get_world_size(), strategy=strategy, **buckets)
    t.sharded = shard(adamw(LR), plan, stage=stage)
    t.state = t.sharded.init(t.params)
    if overlaps:
        t.hooks = [register_grad_hooks(t.params, t.state), register_param_hooks(t.model, t.state)]
    return t


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|, in float64 (see ``_stats.relative_error``)."""
    from shardopt.devtools.gpu_check._stats import relative_error

    diff = (ours.detach().double() - ref.detach().double()).abs().max().item()
    return relative_error(diff, ref.detach().double().abs().max().item())


def max_rel_error(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """The worst :func:`rel_error` over pairs of tensors (0.0 for none)."""
    return max((rel_error(a, b) for a, b in zip(ours, ref, strict=True)), default=0.0)
