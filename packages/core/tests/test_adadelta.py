"""adadelta against torch.optim.Adadelta: option table, schedules and invalid hyperparameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import adadelta, warmup_cosine_decay
from shardopt.core.blocks import tree_leaves

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

OPTIONS = [
    {"weight_decay": wd, "maximize": mx} for wd, mx in itertools.product([0.0, 0.1], [False, True])
] + [{"rho": 0.5, "eps": 1e-4}]
STATE_KEYS = {"step": "count", "square_avg": "square_avg", "acc_delta": "acc_delta"}


# [Note: bitwise cases of adadelta]
# torch's step is a fused ``param.add_(delta, alpha=-lr)``: we return ``q - p`` for torch's
# result ``q``, exact except for the rare element where ``q`` and ``p`` are more than a factor 2
# apart. So the parameters are compared to tolerance, and the state bitwise where it does not
# depend on them (no weight decay). lr = 0.7 is not a power of two: the fused rounding matters.
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_adadelta_matches_torch_adadelta_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.7 if lr_kind == "float" else torch.tensor(0.7, dtype=dtype)
    run = equivalence(
        adadelta(lr, **options),
        torch.optim.Adadelta,
        {"lr": lr, **options},
        dtype,
        skip=skip_every_third,
    )
    run.assert_params_close()
    bitwise = None if options.get("weight_decay", 0.0) == 0 else ("step",)
    run.assert_state_matches(run.state[-1], STATE_KEYS, bitwise=bitwise)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adadelta_with_default_lr_matches_torch_adadelta_bitwise(
    equivalence: Any, dtype: torch.dtype
) -> None:
    # lr = 1: the fused step p - 1 * delta has a single rounding either way.
    run = equivalence(adadelta(), torch.optim.Adadelta, {}, dtype)
    run.assert_params_equal()
    run.assert_state_equal(tree_leaves(run.state[-1].acc_delta), "acc_delta")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adadelta_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(1.0, 5, 50)
    cls = scheduled(torch.optim.Adadelta, schedule)
    run = equivalence(adadelta(schedule), cls, {"lr": 0.0}, dtype)
    run.assert_params_close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "adadelta: expected 0 <= lr, got -0.1"),
        ({"rho": 1.5}, "adadelta: expected 0 <= rho <= 1, got 1.5"),
        ({"eps": -1e-6}, "adadelta: expected 0 <= eps, got -1e-06"),
        ({"weight_decay": -0.1}, "adadelta: expected 0 <= weight_decay, got -0.1"),
        ({"lr": torch.ones(2)}, "adadelta: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_adadelta_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(adadelta, torch.optim.Adadelta, kwargs, message)
