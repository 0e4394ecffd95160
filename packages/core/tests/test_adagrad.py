"""adagrad against torch.optim.Adagrad: a table of every option combination, schedules, checks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import adagrad, warmup_cosine_decay
from shardopt.core._adagrad import ScaleByAdagradState
from shardopt.core._fused import split_state
from shardopt.core._tree import tree_leaves

from _core_helpers import (
    assert_rejected_like_torch,
    assert_torch_signature,
    lambda_lr_scheduled,
    learning_rate_and_skip,
    option_id,
)

DTYPES = [torch.float64, torch.float32]


def assert_state_bitwise(run: Any) -> None:
    """Parameters, ``sum`` and ``step`` are torch's to the last bit."""
    state = split_state(run.state)[0]
    assert isinstance(state, ScaleByAdagradState)
    for key, tree in [("sum", state.sum), ("step", state.count)]:
        run.assert_state_close(tree_leaves(tree), key)
        for ours, theirs in zip(tree_leaves(tree), run.torch_state(key)):
            assert torch.equal(ours, theirs), key
    run.assert_params_close()
    run.assert_params_equal()


OPTIONS = [
    {"lr_decay": d, "weight_decay": w, "initial_accumulator_value": a, "maximize": m}
    for d, w, a, m in itertools.product((0.0, 0.05), (0.0, 0.1), (0.0, 0.2), (False, True))
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", ["float_lr", "tensor_lr_and_skips"])
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_adagrad_matches_torch_adagrad_bitwise_for_50_steps(
    equivalence: Any, options: dict[str, Any], lr_kind: str, dtype: torch.dtype
) -> None:
    """Same ops in the same order, ``clr`` rounded as torch's Python float (see
    [Note: scalar arithmetic of the count]): parameters and state are bitwise equal.

    The tensor-lr rows (a float32 0-d lr, also for float64 parameters) skip gradients: a None
    leaf every third step.
    """
    lr, skip = learning_rate_and_skip(lr_kind, 0.05)
    run = equivalence(
        adagrad(lr, **options), torch.optim.Adagrad, {"lr": lr, **options}, dtype, skip=skip
    )
    assert_state_bitwise(run)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adagrad_with_a_schedule_matches_torch_adagrad_with_lambda_lr_bitwise(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(0.05, 5, 50)
    options = {"lr_decay": 0.05, "weight_decay": 0.1}
    run = equivalence(
        adagrad(schedule, **options),
        lambda_lr_scheduled(torch.optim.Adagrad, schedule),
        options,
        dtype,
    )
    assert_state_bitwise(run)


def test_adagrad_has_torch_defaults() -> None:
    assert_torch_signature(adagrad, torch.optim.Adagrad)


INVALID = [
    ({"lr": -0.1}, "adagrad: expected 0 <= lr, got -0.1"),
    ({"lr": torch.tensor([0.1, 0.2])}, "adagrad: expected lr with 1 element, got shape (2,)"),
    ({"lr_decay": -1.0}, "adagrad: expected 0 <= lr_decay, got -1.0"),
    ({"weight_decay": -0.1}, "adagrad: expected 0 <= weight_decay, got -0.1"),
    ({"initial_accumulator_value": -1.0}, "adagrad: expected 0 <= initial_accumulator_value"),
    ({"eps": -1e-10}, "adagrad: expected 0 <= eps, got -1e-10"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m for _, m in INVALID])
def test_adagrad_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(adagrad, torch.optim.Adagrad, kwargs, message)
