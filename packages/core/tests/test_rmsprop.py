"""rmsprop against torch.optim.RMSprop: the option table, schedules and invalid hyperparameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import rmsprop, warmup_cosine_decay
from shardopt.core.blocks import tree_leaves

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

# Every option combination torch has (weight decay, momentum, centered, maximize).
OPTIONS = [
    {"weight_decay": wd, "momentum": m, "centered": c, "maximize": mx}
    for wd, m, c, mx in itertools.product([0.0, 0.1], [0.0, 0.9], [False, True], [False, True])
]
STATE_KEYS = {"step": "count", "square_avg": "square_avg"}


def learning_rate(kind: str, dtype: torch.dtype) -> float | torch.Tensor:
    return 0.01 if kind == "float" else torch.tensor(0.01, dtype=dtype)


def state_keys(options: dict[str, Any]) -> dict[str, str]:
    """torch's state key -> our state field, for the buffers torch creates with ``options``."""
    keys = dict(STATE_KEYS)
    if options.get("centered"):
        keys["grad_avg"] = "grad_avg"
    if options.get("momentum", 0.0) > 0:
        keys["momentum_buffer"] = "momentum"
    return keys


# [Note: bitwise cases of rmsprop]
# Without momentum torch's step is ``param.addcdiv_(grad, avg, value=-lr)``, which is
# ``p + (-lr * g) / avg``: we return that update, so parameters and state are bitwise equal to
# torch's. With momentum the step is a fused ``param.add_(buf, alpha=-lr)``; we return ``q - p``
# for torch's result ``q``, exact except for the rare element where ``q`` and ``p`` are more than
# a factor 2 apart, so the parameters are compared to tolerance, and the state bitwise where it
# does not depend on them (no weight decay).
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_rmsprop_matches_torch_rmsprop_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = learning_rate(lr_kind, dtype)
    run = equivalence(
        rmsprop(lr, **options),
        torch.optim.RMSprop,
        {"lr": lr, **options},
        dtype,
        skip=skip_every_third,
    )
    run.assert_params_close()
    bitwise_params = options["momentum"] == 0
    if bitwise_params:
        run.assert_params_equal()
    bitwise_state = bitwise_params or options["weight_decay"] == 0
    run.assert_state_matches(
        run.state[-1], state_keys(options), bitwise=None if bitwise_state else ()
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rmsprop_matches_torch_rmsprop_with_every_grad_present(
    equivalence: Any, dtype: torch.dtype
) -> None:
    run = equivalence(rmsprop(), torch.optim.RMSprop, {}, dtype)
    run.assert_params_equal()
    run.assert_state_equal(tree_leaves(run.state[-1].square_avg), "square_avg")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rmsprop_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype, momentum: float
) -> None:
    schedule = warmup_cosine_decay(0.02, 5, 50)
    cls = scheduled(torch.optim.RMSprop, schedule)
    run = equivalence(
        rmsprop(schedule, momentum=momentum), cls, {"lr": 0.0, "momentum": momentum}, dtype
    )
    run.assert_params_close()
    if momentum == 0:
        run.assert_params_equal()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "rmsprop: expected 0 <= lr, got -0.1"),
        ({"alpha": -0.5}, "rmsprop: expected 0 <= alpha, got -0.5"),
        ({"eps": -1e-8}, "rmsprop: expected 0 <= eps, got -1e-08"),
        ({"weight_decay": -0.1}, "rmsprop: expected 0 <= weight_decay, got -0.1"),
        ({"momentum": -0.9}, "rmsprop: expected 0 <= momentum, got -0.9"),
        ({"lr": torch.ones(2)}, "rmsprop: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_rmsprop_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(rmsprop, torch.optim.RMSprop, kwargs, message)
