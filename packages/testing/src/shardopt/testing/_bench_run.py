"""The bench's rank: each variant built, profiled for peak memory, timed, counted, consolidated."""

from __future__ import annotations

import enum
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from shardopt.core import adam, plan_partition
from shardopt.functional import (
    consolidate_state_dict,
    register_grad_hooks,
    shard,
    torch_hyperparams,
)
from shardopt.testing._cli_measure import PeakMemory, count_collectives
from shardopt.testing._cli_models import GPT, GPTConfig, build_mlp_stack
from shardopt.testing._cli_torch import zero_redundancy_optimizer
from shardopt.testing._plan_cli_cost import Traffic

__all__ = ["MODELS", "BenchConfig", "Variant", "VariantResult", "bench_rank"]

# [Note: bench protocol]
# Every variant runs in the same world on the same model (same seed) and the same batches. For
# each: build it and run two iterations under the profiler (the peak of torch's allocator from
# before the model exists: parameters, gradients, optimizer state, DDP's buckets, staging and
# activations); then ``warmup + iters`` iterations, each after a barrier, timing forward +
# backward and ``step()`` apart (the iteration is their sum: gradient sync happens in backward
# for DDP and stage 2, in ``step`` for stage 1's gather and ZeRO's broadcasts); then one
# iteration with the collectives counted; then a consolidation, timed: the full optimizer state
# as a ``torch.optim.Adam`` state dict on rank 0 (torch's ZeRO: ``consolidate_state_dict(to=0)``
# on every rank, then ``state_dict()`` on rank 0; shardopt: ``consolidate_state_dict(state,
# hyperparameters, to=0)``), the slowest rank's time. Times are medians over the timed
# iterations of each rank, then the slowest rank. DDP runs with the Python ``allreduce_hook`` so
# that its all-reduce is counted (the same collective as its built-in).


class Variant(enum.Enum):
    """What is compared: DDP with Adam, DDP with torch's ZeRO, shardopt stages 1 and 2."""

    DDP_ADAM = "DDP + Adam(fused)"
    DDP_ZERO = "DDP + torch ZeRO"
    STAGE1 = "shardopt stage 1"
    STAGE2 = "shardopt stage 2"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A benchmark model: a factory and the shape of its batches."""

    build: Callable[[], nn.Module]
    batch: int
    length: int  # 0: dense inputs of the model's width; else token sequences of this length
    width: int  # input width, or vocabulary size


MODELS = {
    "mlp-12x1024": ModelSpec(build_mlp_stack, batch=32, length=0, width=1024),
    "gpt2-small": ModelSpec(lambda: GPT(GPTConfig(50257, 1024, 768, 12, 12)), 1, 64, 50257),
    "tiny-mlp": ModelSpec(lambda: build_mlp_stack(64, 4), batch=8, length=0, width=64),
    "tiny-gpt": ModelSpec(lambda: GPT(GPTConfig(256, 32, 32, 2, 2)), batch=2, length=16, width=256),
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Models, timed iterations, learning rate and seed of a bench run."""

    models: tuple[str, ...] = ("mlp-12x1024", "gpt2-small")
    iters: int = 5
    warmup: int = 1
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown or not self.models:
            raise ValueError(f"bench: expected models among {sorted(MODELS)}, got {self.models}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(
                f"bench: expected iters >= 1, warmup >= 0, got {self.iters}, {self.warmup}"
            )


@dataclass(frozen=True, slots=True)
class VariantResult:
    """One rank's figures for one variant (see [Note: bench protocol])."""

    model: str
    variant: Variant
    world_size: int
    parameters: int
    step_s: float
    iteration_s: float
    traffic: Traffic
    peak_bytes: int
    consolidate_s: float | None


class _Runner:
    """A built variant: ``iteration(i)`` runs forward, backward and step on batch ``i``."""

    def __init__(self, name: str, variant: Variant, config: BenchConfig, rank: int) -> None:
        spec = MODELS[name]
        self.spec, self.rank, self.world = spec, rank, dist.get_world_size()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = spec.build()
        self.params = list(self.model.parameters())
        self.variant, self.net = variant, self.model
        self.opt: Any = None  # a torch optimizer, or None for shardopt
        self.state: Any = None  # shardopt's ShardedState
        if variant is Variant.STAGE1 or variant is Variant.STAGE2:
            plan = plan_partition(self.params, self.world)
            stage = 2 if variant is Variant.STAGE2 else 1
            self.sharded = shard(adam(config.lr), plan, stage=stage)
            self.hyperparams = torch_hyperparams(torch.optim.Adam, lr=config.lr)
            self.state = self.sharded.init(self.params)
            if variant is Variant.STAGE2:
                self.hooks = register_grad_hooks(self.params, self.state)
        if variant is not Variant.STAGE2:
            self.net = DistributedDataParallel(self.model)
            self.net.register_comm_hook(None, allreduce_hook)
        if variant is Variant.DDP_ADAM:
            self.opt = torch.optim.Adam(self.params, lr=config.lr, fused=True)
        elif variant is Variant.DDP_ZERO:
            self.opt = zero_redundancy_optimizer()(
                self.net.parameters(),
                optimizer_class=torch.optim.Adam,
                parameters_as_bucket_view=True,
                lr=config.lr,
                fused=True,
            )

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * i + self.rank)
        s = self.spec
        if s.length == 0:
            x = torch.randn(s.batch, s.width, generator=gen)
            return x, torch.randn(s.batch, s.width, generator=gen)
        tokens = torch.randint(0, s.width, (s.batch, s.length + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def forward_backward(self, i: int) -> None:
        for p in self.params:
            p.grad = None
        x, y = self.batch(i)
        out = self.net(x)
        if self.spec.length == 0:
            loss = F.mse_loss(out, y)
        else:
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
        else:
            self.state = self.sharded.step(self.params, None, self.state)

    def consolidate(self) -> float | None:
        """Seconds of :meth:`state_dict_on_0` (None for DDP + Adam: every rank has the state)."""
        if self.variant is Variant.DDP_ADAM:
            return None
        dist.barrier()
        start = time.perf_counter()
        self.state_dict_on_0()
        return time.perf_counter() - start

    def state_dict_on_0(self) -> dict[str, Any] | None:
        """The full optimizer state as a torch.optim.Adam state dict on rank 0 (None elsewhere),
        by torch's ZeRO or shardopt's consolidation; see [Note: bench protocol]."""
        if self.variant is Variant.DDP_ZERO:
            self.opt.consolidate_state_dict(to=0)
            return self.opt.state_dict() if self.rank == 0 else None
        if self.state is not None:
            return consolidate_state_dict(self.state, self.hyperparams, to=0)
        return self.opt.state_dict() if self.rank == 0 else None


def run_variant(name: str, variant: Variant, config: BenchConfig, rank: int) -> VariantResult:
    """Runs one variant by [Note: bench protocol]; this rank's figures."""
    gc.collect()
    with PeakMemory() as peak:
        runner = _Runner(name, variant, config, rank)
        for i in range(2):
            runner.forward_backward(i)
            runner.step()
    steps, iterations = [], []
    for i in range(config.warmup + config.iters):
        dist.barrier()
        start = time.perf_counter()
        runner.forward_backward(2 + i)
        middle = time.perf_counter()
        runner.step()
        end = time.perf_counter()
        if i >= config.warmup:
            steps.append(end - middle)
            iterations.append(end - start)
    dist.barrier()
    with count_collectives() as log:
        runner.forward_backward(0)
        runner.step()
    consolidate_s = runner.consolidate()
    parameters = sum(p.numel() for p in runner.params)
    del runner
    gc.collect()
    return VariantResult(
        name,
        variant,
        dist.get_world_size(),
        parameters,
        statistics.median(steps),
        statistics.median(iterations),
        log.traffic(),
        peak.peak,
        consolidate_s,
    )


def bench_rank(rank: int, world: int, config: BenchConfig, progress: bool) -> list[VariantResult]:
    """Every model and variant on this rank, in order; a progress bar on rank 0."""
    from tqdm import tqdm

    jobs = [(m, v) for m in config.models for v in Variant]
    bar = tqdm(jobs, desc=f"bench W={world}", unit="variant", disable=not progress or rank != 0)
    results = []
    for name, variant in bar:
        bar.set_postfix_str(f"{name}: {variant.value}")
        results.append(run_variant(name, variant, config, rank))
    return results
