"""radam against torch.optim.RAdam: the option table, schedules and invalid hyperparameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import radam, warmup_cosine_decay

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

# Weight decay (coupled or decoupled) x maximize; then betas with which rho_t reaches 5 sooner
# (beta2 = 0.99) or never (beta2 = 0.5: rho_inf = 3, always the unrectified step).
OPTIONS = [
    {"weight_decay": wd, "decoupled_weight_decay": dec, "maximize": mx}
    for wd, dec, mx in itertools.product([0.0, 0.1], [False, True], [False, True])
] + [{"betas": (0.8, 0.99), "eps": 1e-3}, {"betas": (0.9, 0.5)}]
STATE_KEYS = {"step": "count", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


# [Note: bitwise cases of radam]
# torch's step is ``param.add_(X, alpha=-1)``, exactly ``p - X``: we compute X in torch's order
# and return ``-X``, so without decoupled weight decay parameters and state are bitwise equal.
# Decoupled weight decay first multiplies the parameter (``mul_``): we return ``q - p`` for
# torch's result ``q``, exact except for the rare element where ``q`` and ``p`` are more than a
# factor 2 apart, so the parameters are compared to tolerance (the state does not depend on them).
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_radam_matches_torch_radam_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.01 if lr_kind == "float" else torch.tensor(0.01, dtype=dtype)
    run = equivalence(
        radam(lr, **options), torch.optim.RAdam, {"lr": lr, **options}, dtype, skip=skip_every_third
    )
    run.assert_params_close()
    decoupled = options.get("decoupled_weight_decay", False) and options["weight_decay"] != 0
    if not decoupled:
        run.assert_params_equal()
    run.assert_state_matches(run.state[-1], STATE_KEYS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_radam_matches_torch_radam_with_every_grad_present(
    equivalence: Any, dtype: torch.dtype
) -> None:
    run = equivalence(radam(), torch.optim.RAdam, {}, dtype)
    run.assert_params_equal()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_radam_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(0.05, 5, 50)
    cls = scheduled(torch.optim.RAdam, schedule)
    run = equivalence(radam(schedule), cls, {"lr": 0.0}, dtype)
    run.assert_params_equal()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "radam: expected 0 <= lr, got -0.1"),
        ({"eps": -1e-8}, "radam: expected 0 <= eps, got -1e-08"),
        ({"betas": (-0.1, 0.999)}, "radam: expected 0 <= betas[0] < 1, got -0.1"),
        ({"betas": (0.9, 1.0)}, "radam: expected 0 <= betas[1] < 1, got 1.0"),
        ({"weight_decay": -0.1}, "radam: expected 0 <= weight_decay, got -0.1"),
        ({"lr": torch.ones(2)}, "radam: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_radam_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(radam, torch.optim.RAdam, kwargs, message)
