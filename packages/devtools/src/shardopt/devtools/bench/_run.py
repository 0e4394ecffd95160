"""The bench's rank: every variant built side by side, timed interleaved, counted, consolidated."""

from __future__ import annotations

import enum
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from shardopt.cli.measure import PeakMemory, count_collectives, traffic_of
from shardopt.cli.models import GPT, GPTConfig, build_mlp_stack
from shardopt.cli.torch_optim import zero_redundancy_optimizer
from shardopt.core import DEFAULT_BUCKET_NUMEL, adam, plan_partition
from shardopt.functional import (
    Traffic,
    consolidate_state_dict,
    register_grad_hooks,
    register_param_hooks,
    shard,
    torch_hyperparams,
    wait_params,
)

__all__ = [
    "MODELS",
    "OVERLAP_BUCKET_NUMEL",
    "BenchConfig",
    "RankRun",
    "Variant",
    "VariantRun",
    "bench_rank",
]

# [Note: bench protocol]
# One run is one gloo world per world size. Every rank builds every variant first, each on its
# own copy of the model (same seed, so the same initial values) and each profiled on its own for
# peak memory: the peak of torch's CPU allocator over its construction and two iterations,
# counted from just before its model exists (parameters, gradients, optimizer state, DDP's
# buckets, staging and activations; the other variants, already built, are not in it).
#
# Then ``warmup + iters`` rounds. In each round every variant runs one iteration on the round's
# batch (the same for all variants), in an order rotated by one each round so that no variant is
# always first or last; each iteration starts from a synchronising all-reduce, and times forward
# + backward and ``step()`` apart (the iteration is their sum: the gradient sync happens in
# backward for DDP and the gradient hooks, in ``step`` for stage 1 and ZeRO's parameter sync).
# The variant with ``register_param_hooks`` leaves its all-gathers in flight when ``step``
# returns, and its next forward waits for them bucket by bucket. Interleaved, those gathers would
# finish during the other variants' turns, for free to it and at their expense; so its turn is
# two iterations back to back: a lead-in (untimed) whose ``step`` leaves the gathers in flight,
# then the timed one, whose forward waits for them as it would in a training loop, after which
# the parameters are waited for, untimed. Its timed iteration is thus the steady state: the rest
# of the previous gathers + forward + backward + ``step`` up to its return.
#
# Per iteration, each variant's time is the slowest rank's; the run reports medians over the
# timed rounds, and ratios of medians to "DDP + torch ZeRO" and to "DDP + Adam(fused)". After
# the rounds: one iteration of each variant with its collectives counted (DDP through a second
# DDP wrapper of the same module with the Python ``allreduce_hook``, the same all-reduce as the
# built-in one, which cannot be seen from Python), then one consolidation of each sharded
# variant, in variant order, timed: the full optimizer state as a ``torch.optim.Adam`` state dict on
# rank 0 (torch's ZeRO and the drop-in: ``consolidate_state_dict(to=0)`` on every rank, then
# ``state_dict()`` on rank 0; shardopt.functional: ``consolidate_state_dict(state,
# hyperparameters, to=0)``), the slowest rank.
#
# A variant that raises (on any rank: the ranks agree after each turn) is dropped for the rest of
# the run and reported as failed, with its error; the others go on.

OVERLAP_BUCKET_NUMEL = 1 << 21  # 8 MiB of float32: 7 buckets for the 12 x 1024 MLP


class Variant(enum.Enum):
    """What is compared (see [Note: bench protocol])."""

    DDP_ADAM = "DDP + Adam(fused)"
    DDP_ZERO = "DDP + torch ZeRO"
    DROP_IN = "DDP + shardopt ZeRO drop-in"
    STAGE1 = "shardopt stage 1"
    STAGE2 = "shardopt stage 2 + grad hooks"
    STAGE2_OVERLAP = "shardopt stage 2 + both overlaps"

    @property
    def ddp(self) -> bool:
        """Whether the variant runs behind DDP (which averages the gradients)."""
        return self in (Variant.DDP_ADAM, Variant.DDP_ZERO, Variant.DROP_IN)

    @property
    def hooked(self) -> bool:
        """Whether gradient hooks reduce-scatter during backward."""
        return self in (Variant.STAGE2, Variant.STAGE2_OVERLAP)

    @property
    def sharded_state(self) -> bool:
        """Whether the optimizer state is sharded (and so consolidated)."""
        return self is not Variant.DDP_ADAM

    def describe(self, bucket_numel: int) -> str:
        """How the variant is configured, in words."""
        return {
            Variant.DDP_ADAM: "DDP (gradient_as_bucket_view) + torch.optim.Adam(fused=True)",
            Variant.DDP_ZERO: "DDP + torch ZeroRedundancyOptimizer(Adam, fused=True, "
            "parameters_as_bucket_view=True)",
            Variant.DROP_IN: "DDP + shardopt.optim.ZeroRedundancyOptimizer(Adam, fused=True, "
            "parameters_as_bucket_view=True, partition='greedy')",
            Variant.STAGE1: "shard(adam, stage=1): local gradients reduce-scattered in step(), "
            f"no DDP; bucket_numel={DEFAULT_BUCKET_NUMEL:,} (default)",
            Variant.STAGE2: "shard(adam, stage=2) + register_grad_hooks, no DDP; "
            f"bucket_numel={bucket_numel:,}",
            Variant.STAGE2_OVERLAP: "shard(adam, stage=2) + register_grad_hooks + "
            f"register_param_hooks, no DDP; bucket_numel={bucket_numel:,}",
        }[self]


BASELINE = Variant.DDP_ZERO
REFERENCE = Variant.DDP_ADAM


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
    """Model, variants, rounds, bucket size of the overlap variants, learning rate and seed."""

    model: str = "mlp-12x1024"
    variants: tuple[str, ...] = tuple(v.name for v in Variant)
    iters: int = 10
    warmup: int = 2
    bucket_numel: int = OVERLAP_BUCKET_NUMEL
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"bench: expected models among {sorted(MODELS)}, got {self.model!r}")
        names = [v.name for v in Variant]
        if not self.variants or any(v not in names for v in self.variants):
            raise ValueError(f"bench: expected variants among {names}, got {self.variants}")
        if BASELINE.name not in self.variants:
            raise ValueError(f"bench: expected the baseline {BASELINE.name} among the variants")
        if self.iters < 1 or self.warmup < 0 or self.bucket_numel < 1:
            raise ValueError(
                "bench: expected iters >= 1, warmup >= 0, bucket_numel >= 1, got "
                f"{self.iters}, {self.warmup}, {self.bucket_numel}"
            )


@dataclass(slots=True)
class VariantRun:
    """One rank's raw figures for one variant in one run (see [Note: bench protocol])."""

    variant: Variant
    parameters: int = 0
    buckets: int = 0  # of the shardopt plan (0: none)
    steps: list[float] = field(default_factory=list)  # per timed round, seconds
    iterations: list[float] = field(default_factory=list)
    launched_early: list[float] = field(default_factory=list)  # per timed round (hooks only)
    traffic: Traffic | None = None
    peak_bytes: int = 0
    consolidate_s: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RankRun:
    """One rank's run: its figures per variant, in :class:`Variant` order."""

    rank: int
    world_size: int
    variants: tuple[VariantRun, ...]


class _Runner:
    """A built variant: ``iteration(i)`` runs forward, backward and step on batch ``i``."""

    def __init__(self, variant: Variant, config: BenchConfig, rank: int) -> None:
        spec = MODELS[config.model]
        self.spec, self.rank, self.world = spec, rank, dist.get_world_size()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = spec.build()
        self.params = list(self.model.parameters())
        self.variant, self.net = variant, self.model
        self.opt: Any = None  # a torch optimizer, or None for shardopt.functional
        self.state: Any = None  # shardopt's ShardedState
        self.hooks: Any = None
        self.param_hooks: Any = None
        self.buckets = 0
        if not variant.ddp:
            stage = 1 if variant is Variant.STAGE1 else 2
            bucket_numel = DEFAULT_BUCKET_NUMEL if stage == 1 else config.bucket_numel
            plan = plan_partition(self.params, self.world, bucket_numel=bucket_numel)
            self.buckets = sum(len(g.buckets) for g in plan.groups)
            self.sharded = shard(adam(config.lr), plan, stage=stage)
            self.hyperparams = torch_hyperparams(torch.optim.Adam, lr=config.lr)
            self.state = self.sharded.init(self.params)
            if variant.hooked:
                self.hooks = register_grad_hooks(self.params, self.state)
            if variant is Variant.STAGE2_OVERLAP:
                self.param_hooks = register_param_hooks(self.model, self.state)
            return
        self.net = DistributedDataParallel(self.model, gradient_as_bucket_view=True)
        if variant is Variant.DDP_ADAM:
            self.opt = torch.optim.Adam(self.params, lr=config.lr, fused=True)
            return
        if variant is Variant.DDP_ZERO:
            zero = zero_redundancy_optimizer()
        else:
            from shardopt.optim import ZeroRedundancyOptimizer

            zero = ZeroRedundancyOptimizer
        self.opt = zero(
            self.params,
            optimizer_class=torch.optim.Adam,
            parameters_as_bucket_view=True,
            lr=config.lr,
            fused=True,
        )

    @property
    def deferred(self) -> bool:
        """Whether ``step`` returns with the parameter all-gathers in flight."""
        return self.param_hooks is not None

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * i + self.rank)
        s = self.spec
        if s.length == 0:
            x = torch.randn(s.batch, s.width, generator=gen)
            return x, torch.randn(s.batch, s.width, generator=gen)
        tokens = torch.randint(0, s.width, (s.batch, s.length + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def forward_backward(self, i: int, net: nn.Module | None = None) -> None:
        for p in self.params:
            p.grad = None
        x, y = self.batch(i)
        out = (net or self.net)(x)
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

    def iteration(self, i: int) -> tuple[float, float]:
        """Forward + backward and step on batch ``i``: their seconds."""
        start = time.perf_counter()
        self.forward_backward(i)
        middle = time.perf_counter()
        self.step()
        return middle - start, time.perf_counter() - middle

    def settle(self) -> None:
        """Waits for the parameters (the deferred all-gathers), if any are in flight."""
        if self.deferred:
            wait_params(self.state)

    def counted(self, i: int) -> Traffic:
        """One iteration with its collectives counted (see [Note: bench protocol])."""
        net = None
        if self.variant.ddp:
            net = DistributedDataParallel(self.model, gradient_as_bucket_view=True)
            net.register_comm_hook(None, allreduce_hook)
        dist.barrier()
        with count_collectives() as log:
            self.forward_backward(i, net)
            self.step()
            self.settle()
        return traffic_of(log)

    def consolidate(self) -> float:
        """Seconds of :meth:`state_dict_on_0`, this rank."""
        dist.barrier()
        start = time.perf_counter()
        self.state_dict_on_0()
        return time.perf_counter() - start

    def state_dict_on_0(self) -> dict[str, Any] | None:
        """The full optimizer state as a torch.optim.Adam state dict on rank 0 (None elsewhere);
        see [Note: bench protocol]."""
        if self.variant is Variant.DDP_ADAM:
            return self.opt.state_dict() if self.rank == 0 else None
        if self.opt is not None:
            self.opt.consolidate_state_dict(to=0)
            return self.opt.state_dict() if self.rank == 0 else None
        return consolidate_state_dict(self.state, self.hyperparams, to=0)


def _agree(failed: bool) -> bool:
    """Whether any rank failed (a collective: also the start line of the next turn)."""
    flag = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


class _Slot:
    """A variant's runner and figures on this rank; :meth:`attempt` turns errors into a failure."""

    def __init__(self, variant: Variant) -> None:
        self.run = VariantRun(variant)
        self.runner: _Runner | None = None

    @property
    def alive(self) -> bool:
        return self.run.error is None

    def attempt(self, fn: Callable[[], None]) -> None:
        """Runs ``fn``; if it raises here or the turn failed on another rank, the variant is out."""
        failed = False
        try:
            fn()
        except Exception as exc:  # a failing variant is reported, not fatal
            failed = True
            self.run.error = _error(exc)
        if _agree(failed):
            if self.run.error is None:
                self.run.error = "failed on another rank"
            self.runner = None
            gc.collect()


def _build(slot: _Slot, config: BenchConfig, rank: int) -> None:
    gc.collect()
    with PeakMemory() as peak:
        runner = _Runner(slot.run.variant, config, rank)
        for i in range(2):
            runner.forward_backward(i)
            runner.step()
        runner.settle()
    slot.runner = runner
    slot.run.parameters = sum(p.numel() for p in runner.params)
    slot.run.buckets = runner.buckets
    slot.run.peak_bytes = peak.peak


def _turn(slot: _Slot, i: int, timed: bool) -> None:
    runner = slot.runner
    assert runner is not None
    if runner.deferred:
        runner.iteration(i)  # lead-in: leaves the all-gathers in flight
    forward_backward, step = runner.iteration(i)
    runner.settle()
    if timed:
        slot.run.steps.append(step)
        slot.run.iterations.append(forward_backward + step)
        if runner.hooks is not None:
            slot.run.launched_early.append(runner.hooks.launched_early)


def bench_rank(rank: int, world: int, config: BenchConfig, progress: bool) -> RankRun:
    """One run on this rank by [Note: bench protocol]; a progress bar on rank 0."""
    from tqdm import tqdm

    slots = [_Slot(Variant[name]) for name in config.variants]
    rounds = config.warmup + config.iters
    total = len(slots) * (rounds + 3)
    bar = tqdm(total=total, desc=f"bench W={world}", unit="turn", disable=not progress or rank)
    _agree(False)
    for slot in slots:
        bar.set_postfix_str(f"build {slot.run.variant.value}")
        slot.attempt(partial(_build, slot, config, rank))
        bar.update()
    bar.set_postfix_str("interleaved rounds")
    for r in range(rounds):
        k = r % len(slots)
        for slot in slots[k:] + slots[:k]:
            if slot.alive:
                slot.attempt(partial(_turn, slot, 2 + r, r >= config.warmup))
            bar.update()
    bar.set_postfix_str("counting, consolidating")
    for slot in slots:
        if slot.alive:
            slot.attempt(partial(_count, slot))
        bar.update()
    for slot in slots:
        if slot.alive and slot.run.variant.sharded_state:
            slot.attempt(partial(_consolidate, slot))
        bar.update()
    bar.close()
    runs = tuple(s.run for s in slots)
    for s in slots:
        s.runner = None
    gc.collect()
    return RankRun(rank, world, runs)


def _count(slot: _Slot) -> None:
    assert slot.runner is not None
    slot.run.traffic = slot.runner.counted(0)


def _consolidate(slot: _Slot) -> None:
    assert slot.runner is not None
    slot.run.consolidate_s = slot.runner.consolidate()


def slowest(values: list[list[float]]) -> list[float]:
    """Per timed round, the slowest rank's value (``values``: one list per rank)."""
    return [max(per_round) for per_round in zip(*values)]


def median_or_none(values: list[float]) -> float | None:
    """The median of ``values``, None when empty."""
    return statistics.median(values) if values else None
