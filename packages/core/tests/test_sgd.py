"""sgd against torch.optim.SGD: a table of every option combination, schedules and validation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import sgd, warmup_cosine_decay
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


# Every combination torch accepts (nesterov needs momentum > 0 and dampening == 0).
OPTIONS = [
    {"momentum": m, "dampening": d, "nesterov": n, "weight_decay": w, "maximize": x}
    for m, d, n, w, x in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.1), (False, True)
    )
    if not n or (m > 0 and d == 0)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", ["float_lr", "tensor_lr_and_skips"])
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_sgd_matches_torch_sgd_for_50_steps(
    equivalence: Any, options: dict[str, Any], lr_kind: str, dtype: torch.dtype
) -> None:
    """Parameters and momentum buffers agree to 1e-12 (float64) / 1e-6 (float32).

    The tensor-lr rows also skip gradients (a None leaf every third step). The momentum buffer is
    bitwise equal without weight decay, where it does not depend on the parameters; parameters are
    torch's to the last bit nearly always (see [Note: torch's step as a delta]), not always.
    """
    lr, skip = learning_rate_and_skip(lr_kind, 0.05)
    run = equivalence(sgd(lr, **options), torch.optim.SGD, {"lr": lr, **options}, dtype, skip=skip)
    run.assert_params_close()
    if options["momentum"] == 0:
        assert split_state(run.state)[0] is None
        return
    buffers = tree_leaves(split_state(run.state)[0].momentum)
    run.assert_state_close(buffers, "momentum_buffer")
    if options["weight_decay"] == 0:
        for ours, theirs in zip(buffers, run.torch_state("momentum_buffer")):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "options", [{}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}], ids=option_id
)
def test_sgd_with_a_schedule_matches_torch_sgd_with_lambda_lr(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype
) -> None:
    schedule = warmup_cosine_decay(0.1, 5, 50)
    run = equivalence(
        sgd(schedule, **options), lambda_lr_scheduled(torch.optim.SGD, schedule), options, dtype
    )
    run.assert_params_close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sgd_with_a_tensor_weight_decay_matches_torch_sgd(
    equivalence: Any, dtype: torch.dtype
) -> None:
    options = {"momentum": 0.9, "weight_decay": torch.tensor(0.1), "maximize": True}
    run = equivalence(sgd(0.05, **options), torch.optim.SGD, {"lr": 0.05, **options}, dtype)
    run.assert_params_close()


def test_sgd_has_torch_defaults() -> None:
    assert_torch_signature(sgd, torch.optim.SGD)


INVALID = [
    ({"lr": -0.1}, "sgd: expected 0 <= lr, got -0.1"),
    ({"lr": torch.tensor([0.1, 0.2])}, "sgd: expected lr with 1 element, got shape (2,)"),
    ({"momentum": -0.5}, "sgd: expected 0 <= momentum, got -0.5"),
    ({"weight_decay": -1.0}, "sgd: expected 0 <= weight_decay, got -1.0"),
    (
        {"nesterov": True},
        "sgd: expected momentum > 0 and dampening == 0 with nesterov, got momentum=0.0",
    ),
    (
        {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
        "sgd: expected momentum > 0 and dampening == 0 with nesterov, got momentum=0.9, "
        "dampening=0.1",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m for _, m in INVALID])
def test_sgd_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(sgd, torch.optim.SGD, kwargs, message)
