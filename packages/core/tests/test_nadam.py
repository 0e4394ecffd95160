"""nadam against torch.optim.NAdam: the option table, schedules and invalid hyperparameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import nadam, warmup_cosine_decay
from shardopt.core.blocks import tree_leaves

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

# Weight decay (coupled or decoupled) x maximize, then the momentum-decay schedule and betas.
OPTIONS = [
    {"weight_decay": wd, "decoupled_weight_decay": dec, "maximize": mx}
    for wd, dec, mx in itertools.product([0.0, 0.1], [False, True], [False, True])
] + [{"momentum_decay": 0.1}, {"momentum_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-3}]
STATE_KEYS = {
    "step": "count",
    "mu_product": "mu_product",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}


# [Note: bitwise cases of nadam]
# torch steps the parameter with two ``addcdiv_`` (and a ``mul_`` for decoupled weight decay):
# we return ``q - p`` for torch's result ``q``, exact except for the rare element where ``q``
# and ``p`` are more than a factor 2 apart. So the parameters are compared to tolerance; the
# state is bitwise equal where it does not depend on them (no coupled weight decay). mu_product
# is a float32 0-d tensor in both, multiplied alike (see [Note: nadam mu_product]).
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_nadam_matches_torch_nadam_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.02 if lr_kind == "float" else torch.tensor(0.02, dtype=dtype)
    run = equivalence(
        nadam(lr, **options), torch.optim.NAdam, {"lr": lr, **options}, dtype, skip=skip_every_third
    )
    run.assert_params_close()
    coupled = options.get("weight_decay", 0.0) != 0 and not options.get("decoupled_weight_decay")
    bitwise = ("step", "mu_product") if coupled else None
    run.assert_state_matches(run.state[-1], STATE_KEYS, bitwise=bitwise)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_nadam_matches_torch_nadam_with_every_grad_present(
    equivalence: Any, dtype: torch.dtype
) -> None:
    run = equivalence(nadam(), torch.optim.NAdam, {}, dtype)
    run.assert_params_close()
    run.assert_state_equal(tree_leaves(run.state[-1].mu_product), "mu_product")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_nadam_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(0.05, 5, 50)
    options = {"weight_decay": 0.1, "decoupled_weight_decay": True}
    cls = scheduled(torch.optim.NAdam, schedule)
    run = equivalence(nadam(schedule, **options), cls, {"lr": 0.0, **options}, dtype)
    run.assert_params_close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "nadam: expected 0 <= lr, got -0.1"),
        ({"eps": -1e-8}, "nadam: expected 0 <= eps, got -1e-08"),
        ({"betas": (1.0, 0.999)}, "nadam: expected 0 <= betas[0] < 1, got 1.0"),
        ({"betas": (0.9, 1.5)}, "nadam: expected 0 <= betas[1] < 1, got 1.5"),
        ({"weight_decay": -0.1}, "nadam: expected 0 <= weight_decay, got -0.1"),
        ({"momentum_decay": -4e-3}, "nadam: expected 0 <= momentum_decay, got -0.004"),
        ({"lr": torch.ones(2)}, "nadam: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_nadam_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(nadam, torch.optim.NAdam, kwargs, message)
