"""adamax against torch.optim.Adamax: the option table, schedules and invalid hyperparameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import adamax, warmup_cosine_decay
from shardopt.core.blocks import tree_leaves

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

OPTIONS = [
    {"weight_decay": wd, "maximize": mx} for wd, mx in itertools.product([0.0, 0.1], [False, True])
] + [{"betas": (0.8, 0.99), "eps": 1e-3}]
STATE_KEYS = {"step": "count", "exp_avg": "exp_avg", "exp_inf": "exp_inf"}


# [Note: bitwise cases of adamax]
# torch's step is ``param.addcdiv_(exp_avg, exp_inf, value=-lr / (1 - beta1**t))``, that is
# ``p + (value * m) / u``: we return that update with the step size computed as torch does (in
# float64, or in the dtype of a tensor lr), so parameters and state are bitwise equal.
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_adamax_matches_torch_adamax_bitwise_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.02 if lr_kind == "float" else torch.tensor(0.02, dtype=dtype)
    run = equivalence(
        adamax(lr, **options),
        torch.optim.Adamax,
        {"lr": lr, **options},
        dtype,
        skip=skip_every_third,
    )
    run.assert_params_close()
    run.assert_params_equal()
    run.assert_state_matches(run.state[-1], STATE_KEYS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adamax_matches_torch_adamax_with_every_grad_present(
    equivalence: Any, dtype: torch.dtype
) -> None:
    run = equivalence(adamax(), torch.optim.Adamax, {}, dtype)
    run.assert_params_equal()
    run.assert_state_equal(tree_leaves(run.state[-1].exp_inf), "exp_inf")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adamax_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(0.05, 5, 50)
    cls = scheduled(torch.optim.Adamax, schedule)
    run = equivalence(adamax(schedule), cls, {"lr": 0.0}, dtype)
    run.assert_params_equal()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "adamax: expected 0 <= lr, got -0.1"),
        ({"eps": -1e-8}, "adamax: expected 0 <= eps, got -1e-08"),
        ({"betas": (1.0, 0.999)}, "adamax: expected 0 <= betas[0] < 1, got 1.0"),
        ({"betas": (0.9, -0.1)}, "adamax: expected 0 <= betas[1] < 1, got -0.1"),
        ({"weight_decay": -0.1}, "adamax: expected 0 <= weight_decay, got -0.1"),
        ({"lr": torch.ones(2)}, "adamax: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_adamax_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(adamax, torch.optim.Adamax, kwargs, message)
