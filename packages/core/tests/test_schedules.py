"""Schedules: values, validation, tracing, and learning rates equal to torch's LambdaLR."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    Schedule,
    Transformation,
    apply_updates,
    constant,
    cosine_decay,
    join_schedules,
    linear_warmup,
    scale_by_learning_rate,
    warmup_cosine_decay,
)
from shardopt.core.blocks import resolve


def at(schedule: Schedule, count: float) -> float:
    return float(schedule(torch.tensor(count, dtype=torch.float32)))


def cos_frac(frac: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * frac))


@pytest.mark.parametrize(
    ("schedule", "count", "expected"),
    [
        (constant(0.3), 0.0, 0.3),
        (constant(0.3), 1e6, 0.3),
        (linear_warmup(1.0, 4), 0.0, 0.0),
        (linear_warmup(1.0, 4), 1.0, 0.25),
        (linear_warmup(1.0, 4), 4.0, 1.0),
        (linear_warmup(1.0, 4), 9.0, 1.0),  # stays at the peak
        (linear_warmup(2.0, 4, init_value=1.0), 2.0, 1.5),
        (cosine_decay(2.0, 10), 0.0, 2.0),
        (cosine_decay(2.0, 10), 3.0, 2.0 * cos_frac(0.3)),
        (cosine_decay(2.0, 10), 10.0, 0.0),
        (cosine_decay(2.0, 10, alpha=0.1), 10.0, 0.2),
        (cosine_decay(2.0, 10, alpha=0.1), 25.0, 0.2),  # stays at alpha * init_value
        (join_schedules([constant(1.0), linear_warmup(3.0, 2)], [5]), 4.0, 1.0),
        (join_schedules([constant(1.0), linear_warmup(3.0, 2)], [5]), 5.0, 0.0),
        (join_schedules([constant(1.0), linear_warmup(3.0, 2)], [5]), 6.0, 1.5),
        (join_schedules([constant(1.0), constant(2.0), constant(3.0)], [2, 4]), 3.0, 2.0),
        (join_schedules([constant(1.0), constant(2.0), constant(3.0)], [2, 4]), 4.0, 3.0),
        (warmup_cosine_decay(1.0, 2, 12), 0.0, 0.0),
        (warmup_cosine_decay(1.0, 2, 12), 1.0, 0.5),
        (warmup_cosine_decay(1.0, 2, 12), 2.0, 1.0),
        (warmup_cosine_decay(1.0, 2, 12), 7.0, cos_frac(0.5)),
        (warmup_cosine_decay(1.0, 2, 12, alpha=0.5), 12.0, 0.5),
        (warmup_cosine_decay(1.0, 2, 12, alpha=0.5), 40.0, 0.5),
    ],
)
def test_schedule_value_at_count(schedule: Schedule, count: float, expected: float) -> None:
    assert at(schedule, count) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_resolve_calls_schedules_and_returns_scalars_and_tensors_as_given() -> None:
    lr = torch.tensor(0.5)
    assert resolve(0.1, torch.tensor(3.0)) == 0.1
    assert resolve(lr, torch.tensor(3.0)) is lr
    assert float(resolve(linear_warmup(1.0, 4), torch.tensor(2.0))) == 0.5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: linear_warmup(1.0, 0), r"linear_warmup: expected warmup_steps > 0, got 0"),
        (lambda: cosine_decay(1.0, -3), r"cosine_decay: expected decay_steps > 0, got -3"),
        (
            lambda: join_schedules([constant(1.0)], [3]),
            r"join_schedules: expected len\(schedules\) == len\(boundaries\) \+ 1",
        ),
        (
            lambda: join_schedules([constant(1.0)] * 3, [4, 4]),
            r"join_schedules: expected increasing non-negative boundaries, got \[4, 4\]",
        ),
        (
            lambda: join_schedules([constant(1.0)] * 2, [-1]),
            r"join_schedules: expected increasing non-negative boundaries, got \[-1\]",
        ),
        (lambda: warmup_cosine_decay(1.0, 5, 5), r"decay_steps > warmup_steps, got 5 and 5"),
    ],
)
def test_schedule_rejects_bad_arguments(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "schedule",
    [linear_warmup(1.0, 4), cosine_decay(1.0, 10, alpha=0.1), warmup_cosine_decay(1.0, 3, 9)],
    ids=["linear_warmup", "cosine_decay", "warmup_cosine_decay"],
)
def test_schedule_traces_under_vmap(schedule: Schedule) -> None:
    counts = torch.arange(12, dtype=torch.float32)
    batched = torch.func.vmap(schedule)(counts)
    expected = torch.stack([torch.as_tensor(schedule(c)) for c in counts])
    assert torch.equal(torch.as_tensor(batched), expected)


def run_with_lambda_lr(
    tx: Transformation,
    torch_cls: Callable[..., torch.optim.Optimizer],
    base_lr: float,
    schedule: Schedule,
    torch_kwargs: dict[str, Any],
    steps: int = 30,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Steps ``tx`` and ``torch_cls`` + ``LambdaLR(schedule / base_lr)`` on the same grads."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
        "b": torch.zeros(3, dtype=torch.float64),
    }
    leaves, spec = pytree.tree_flatten(params)
    torch_leaves = [p.clone().requires_grad_(True) for p in leaves]
    opt = torch_cls(torch_leaves, lr=base_lr, **torch_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: at(schedule, n) / base_lr)
    state = tx.init(params)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in leaves]
        for p, g in zip(torch_leaves, grads):
            p.grad = g.clone()
        opt.step()
        sched.step()
        updates, state = tx.update(pytree.tree_unflatten(grads, spec), state, params)
        params = apply_updates(params, updates)
    return pytree.tree_leaves(params), [p.detach() for p in torch_leaves]


SCHEDULES = {
    "linear_warmup": linear_warmup(0.1, 10, init_value=0.01),
    "cosine_decay": cosine_decay(0.1, 20, alpha=0.05),
    "warmup_cosine_decay": warmup_cosine_decay(0.1, 5, 25),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(
    ("make_tx", "torch_cls", "torch_kwargs"),
    [
        (lambda s: scale_by_learning_rate(s), torch.optim.SGD, {}),
        (lambda s: shardopt.core.adam(s), torch.optim.Adam, {}),
        (lambda s: shardopt.core.sgd(s, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
    ],
    ids=["scale_by_learning_rate", "adam", "sgd-momentum"],
)
def test_schedule_lr_matches_torch_lambda_lr(
    name: str,
    make_tx: Callable[[Schedule], Transformation],
    torch_cls: type[torch.optim.Optimizer],
    torch_kwargs: dict[str, Any],
) -> None:
    schedule = SCHEDULES[name]
    ours, ref = run_with_lambda_lr(make_tx(schedule), torch_cls, 0.1, schedule, torch_kwargs)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_schedule_count_of_a_parameter_without_gradient_does_not_advance() -> None:
    # [Note: per-parameter step counts]: a skipped parameter's schedule lags behind, unlike a
    # LambdaLR that advances per optimizer.step() for the whole group.
    tx = scale_by_learning_rate(linear_warmup(1.0, 4))
    params = [torch.zeros(1), torch.zeros(1)]
    state = tx.init(params)
    _, state = tx.update([torch.ones(1), None], state, params)
    updates, state = tx.update([torch.ones(1), torch.ones(1)], state, params)
    assert updates[0].item() == -0.25
    assert updates[1].item() == 0.0
