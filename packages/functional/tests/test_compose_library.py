"""Every core transformation and combinator under shard: flat (cut tensors), greedy and mixed
plans, W = 2 and 3, stages 1 and 2, each within 1e-6 of one process fed the mean gradient, or
(shaped ones on flat plans only) refused at init on every rank. One world per plan, world size
and stage steps every entry of the library in turn."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import shardopt.core as so
from shardopt.core import Transformation, apply_updates, plan_partition
from shardopt.core.blocks import Kind, kind_of
from shardopt.functional import shard
from shardopt.testing import World

STEPS = 3
SHAPES = [(6, 5), (7,), (3, 4), (1,), (9, 2)]
LR = 1e-2


def _labels(ps: list[torch.Tensor]) -> list[str]:
    return ["m" if p.dim() == 2 else "v" for p in ps]


LIBRARY: dict[str, Callable[[], Transformation]] = {
    # torch.optim's
    "sgd": lambda: so.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: so.adam(LR, amsgrad=True),
    "adamw": lambda: so.adamw(LR),
    "adagrad": lambda: so.adagrad(LR),
    "rmsprop": lambda: so.rmsprop(LR, centered=True, momentum=0.5),
    "adamax": lambda: so.adamax(LR),
    "nadam": lambda: so.nadam(LR),
    "radam": lambda: so.radam(LR),
    "adadelta": lambda: so.adadelta(1.0),
    "rprop": lambda: so.rprop(LR),
    "asgd": lambda: so.asgd(LR),
    "muon": lambda: so.partition({"m": so.muon(lr=0.02), "v": so.adamw(LR)}, _labels),
    "adafactor": lambda: so.adafactor(lr=LR),
    # optax's
    "lion": lambda: so.lion(LR),
    "lamb": lambda: so.lamb(LR, weight_decay=0.01),
    "lars": lambda: so.lars(LR, weight_decay=0.01),
    "adabelief": lambda: so.adabelief(LR),
    "yogi": lambda: so.yogi(LR),
    "novograd": lambda: so.novograd(LR),
    "adan": lambda: so.adan(LR),
    "lookahead": lambda: so.lookahead(so.sgd(0.1), sync_period=2, slow_step_size=0.5),
    "sign_sgd": lambda: so.sign_sgd(LR),
    "signum": lambda: so.signum(LR),
    "ademamix": lambda: so.ademamix(LR),
    "adopt": lambda: so.adopt(LR),
    "schedule_free_adamw": lambda: so.schedule_free_adamw(LR),
    # transforms, each before a learning rate
    "scale_by_trust_ratio": lambda: so.chain(so.scale_by_trust_ratio(), so.scale(-LR)),
    "clip_by_block_rms": lambda: so.chain(so.clip_by_block_rms(0.5), so.scale(-LR)),
    "adaptive_grad_clip": lambda: so.chain(so.adaptive_grad_clip(0.05), so.scale(-LR)),
    "centralize": lambda: so.chain(so.centralize(), so.scale(-LR)),
    "ema": lambda: so.chain(so.ema(0.9), so.scale(-LR)),
    "zero_nans": lambda: so.chain(so.zero_nans(), so.scale(-LR)),
    "clip": lambda: so.chain(so.clip(0.5), so.scale(-LR)),
    "clip_by_global_norm": lambda: so.chain(so.clip_by_global_norm(0.5), so.adam(LR)),
    "add_decayed_weights": lambda: so.chain(so.add_decayed_weights(0.1), so.scale(-LR)),
    "trace": lambda: so.chain(so.trace(0.9), so.scale_by_learning_rate(LR)),
    "identity": lambda: so.chain(so.identity(), so.scale(-LR)),
    "scale_by_adam": lambda: so.chain(so.scale_by_adam(), so.scale_by_learning_rate(LR)),
    "scale_by_adagrad": lambda: so.chain(so.scale_by_adagrad(), so.scale(-LR)),
    "scale_by_rprop": lambda: so.chain(so.scale_by_rprop(LR), so.scale(-1.0)),
    "add_decoupled_weight_decay": lambda: so.chain(
        so.scale_by_adam(), so.scale(-LR), so.add_decoupled_weight_decay(LR, 0.1)),
    "step_by_learning_rate": lambda: so.chain(so.trace(0.5), so.step_by_learning_rate(LR)),
    "add_noise": lambda: so.chain(so.add_noise(0.01, 0.55, key=3), so.scale(-LR)),
    "schedule": lambda: so.sgd(so.warmup_cosine_decay(0.1, 2, 10)),
    # combinators
    "apply_if_finite": lambda: so.apply_if_finite(so.adam(LR), 2),
    "masked": lambda: so.chain(so.masked(so.scale(0.0), lambda ps: [p.dim() == 1 for p in ps]),
                               so.adam(LR)),
    "partition": lambda: so.partition({"m": so.lamb(LR), "v": so.adam(LR)}, _labels),
    "inject_hyperparams": lambda: so.inject_hyperparams(so.adam, lr=LR),
    "multi_steps": lambda: so.multi_steps(so.adam(LR), every_k=2),
    "with_state_dtype": lambda: so.with_state_dtype(so.adam(LR), torch.float32,
                                                    compute_dtype=torch.float64),
}  # fmt: skip


def params_() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def grads_of(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def shaped(tx: Transformation) -> bool:
    return Kind.SHAPED in (kind_of(tx) or Kind.ELEMENTWISE)


def one_process(name: str, world: int) -> list[torch.Tensor]:
    tx, params = LIBRARY[name](), params_()
    state = tx.init(params)
    for step in range(STEPS):
        mean = [sum(gs) / world for gs in zip(*(grads_of(step, r) for r in range(world)))]
        updates, state = tx.update(mean, state, params)
        params = apply_updates(params, updates)
    return params


def plan_for(tx: Transformation, strategy: str, world: int) -> so.Plan:
    params = params_()
    if strategy != "mixed":
        return plan_partition(params, world, strategy=strategy, bucket_numel=16)
    # mixed: the matrices whole, the vectors cut (everything whole for a shaped one)
    whole = (lambda t: True) if shaped(tx) else (lambda t: len(t.shape) == 2)
    return plan_partition(params, world, strategy="mixed", whole=whole, bucket_numel=16)


def run_entry(name: str, world: World, strategy: str, stage: int) -> str | None:
    """None if the sharded run is within 1e-6 of one process (or, shaped on flat, refused);
    else what went wrong."""
    tx, params = LIBRARY[name](), params_()
    sharding = shard(tx, plan_for(tx, strategy, world.world_size), stage=stage)
    if strategy == "flat" and shaped(tx):
        try:
            sharding.init(params)
        except ValueError as exc:
            return None if "needs each tensor in its shape" in str(exc) else f"refused: {exc}"
        return "a shaped transformation ran on a flat plan"
    state = sharding.init(params)
    for step in range(STEPS):
        state = sharding.step(params, grads_of(step, world.rank), state)
    ref = one_process(name, world.world_size)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(params, ref)]
    worst = max(errors)
    return None if worst <= 1e-6 else f"relative error {worst:.2e}"


def run_library(world: World, strategy: str, stage: int) -> None:
    failures = {}
    for name in LIBRARY:
        problem = run_entry(name, world, strategy, stage)
        if problem is not None:
            failures[name] = problem
    assert not failures, failures


@pytest.mark.parametrize("strategy", ["flat", "greedy", "mixed"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.world(2, timeout=300)
def test_every_library_entry_sharded_at_w2_equals_one_process_or_is_refused(
    world: World, strategy: str, stage: int
) -> None:
    run_library(world, strategy, stage)


@pytest.mark.parametrize("strategy", ["flat", "greedy", "mixed"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.world(3, timeout=300)
def test_every_library_entry_sharded_at_w3_equals_one_process_or_is_refused(
    world: World, strategy: str, stage: int
) -> None:
    run_library(world, strategy, stage)
