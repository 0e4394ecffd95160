"""rprop against torch.optim.Rprop: the option table and invalid hyperparameters."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch

from shardopt.core import constant, rprop

from _core_helpers import assert_rejected_like_torch, option_id, skip_every_third

# maximize x etas x step_sizes; the tight step sizes make the clamp bind both ways.
OPTIONS = [
    {"etas": etas, "step_sizes": sizes, "maximize": mx}
    for etas, sizes, mx in itertools.product(
        [(0.5, 1.2), (0.3, 1.5)], [(1e-6, 50), (5e-3, 0.05)], [False, True]
    )
]
STATE_KEYS = {"step": "count", "prev": "prev", "step_size": "step_size"}


# [Note: bitwise cases of rprop]
# torch's step is ``param.addcmul_(sign(g), step_size, value=-1)``: a sign times a size, exact,
# so ``p - sign(g) * step_size`` is bitwise torch's result; the step sizes are updated with the
# same kernels (mul, clamp). Parameters and state are bitwise equal in every case.
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_rprop_matches_torch_rprop_bitwise_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.01 if lr_kind == "float" else torch.tensor(0.01, dtype=dtype)
    run = equivalence(
        rprop(lr, **options), torch.optim.Rprop, {"lr": lr, **options}, dtype, skip=skip_every_third
    )
    run.assert_params_close()
    run.assert_params_equal()
    run.assert_state_matches(run.state[-2], STATE_KEYS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rprop_matches_torch_rprop_with_every_grad_present(
    equivalence: Any, dtype: torch.dtype
) -> None:
    run = equivalence(rprop(), torch.optim.Rprop, {}, dtype)
    run.assert_params_equal()


def test_rprop_step_size_starts_at_lr_and_is_differentiable_in_a_tensor_lr() -> None:
    lr = torch.tensor(0.25, requires_grad=True)
    tx = rprop(lr)
    (size,) = tx.init([torch.zeros(3, dtype=torch.float64)])[-2].step_size
    assert size.dtype == torch.float64
    assert torch.equal(size.detach(), torch.full((3,), 0.25, dtype=torch.float64))
    (grad,) = torch.autograd.grad(size.sum(), lr)
    assert grad.item() == 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "rprop: expected 0 <= lr, got -0.1"),
        ({"etas": (1.5, 1.2)}, "rprop: expected 0 < etas[0] < 1 < etas[1], got (1.5, 1.2)"),
        ({"etas": (0.5, 0.9)}, "rprop: expected 0 < etas[0] < 1 < etas[1], got (0.5, 0.9)"),
        ({"etas": (0.0, 1.2)}, "rprop: expected 0 < etas[0] < 1 < etas[1], got (0.0, 1.2)"),
        ({"lr": torch.ones(2)}, "rprop: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_rprop_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(rprop, torch.optim.Rprop, kwargs, message)


def test_rprop_rejects_a_schedule_since_lr_is_only_the_initial_step_size() -> None:
    message = "rprop: expected lr a float or a 0-d tensor (the initial step size), got a schedule"
    with pytest.raises(ValueError, match=re.escape(message)):
        rprop(constant(0.01))
