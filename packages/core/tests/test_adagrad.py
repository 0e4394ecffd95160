"""adagrad against torch.optim.Adagrad: a table of every option combination, schedules, checks."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
import torch

from shardopt.core import adagrad, warmup_cosine_decay
from shardopt.core._adagrad import ScaleByAdagradState
from shardopt.core._fused import split_state
from shardopt.core._tree import tree_leaves

DTYPES = [torch.float64, torch.float32]


def no_skip(step: int, leaf: int) -> bool:
    return False


def skip_every_third(step: int, leaf: int) -> bool:
    """Each leaf has a None gradient every third step, the leaves out of phase."""
    return (step + leaf) % 3 == 0


def options_id(options: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def scheduled(torch_cls: type[torch.optim.Optimizer], schedule: Any) -> Any:
    """``torch_cls`` with ``lr=1`` and a LambdaLR setting the lr to ``schedule(step)`` each step."""

    class Scheduled(torch_cls):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, lr=1.0, **kwargs)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self, lambda step: float(schedule(torch.tensor(float(step))))
            )

        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            self.scheduler.step()
            return loss

    return Scheduled


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
@pytest.mark.parametrize("options", OPTIONS, ids=options_id)
def test_adagrad_matches_torch_adagrad_bitwise_for_50_steps(
    equivalence: Any, options: dict[str, Any], lr_kind: str, dtype: torch.dtype
) -> None:
    """Same ops in the same order, ``clr`` rounded as torch's Python float (see
    [Note: scalar arithmetic of the count]): parameters and state are bitwise equal.

    The tensor-lr rows (a float32 0-d lr, also for float64 parameters) skip gradients: a None
    leaf every third step.
    """
    lr: Any = 0.05 if lr_kind == "float_lr" else torch.tensor(0.05)
    skip = no_skip if lr_kind == "float_lr" else skip_every_third
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
        adagrad(schedule, **options), scheduled(torch.optim.Adagrad, schedule), options, dtype
    )
    assert_state_bitwise(run)


def test_adagrad_has_torch_defaults() -> None:
    torch_params = inspect.signature(torch.optim.Adagrad).parameters
    for name, param in inspect.signature(adagrad).parameters.items():
        assert param.default == torch_params[name].default, name


INVALID = [
    ({"lr": -0.1}, "adagrad: expected 0 <= lr, got -0.1"),
    ({"lr": torch.tensor([0.1, 0.2])}, r"adagrad: expected lr with 1 element, got shape \(2,\)"),
    ({"lr_decay": -1.0}, "adagrad: expected 0 <= lr_decay, got -1.0"),
    ({"weight_decay": -0.1}, "adagrad: expected 0 <= weight_decay, got -0.1"),
    ({"initial_accumulator_value": -1.0}, "adagrad: expected 0 <= initial_accumulator_value"),
    ({"eps": -1e-10}, "adagrad: expected 0 <= eps, got -1e-10"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m for _, m in INVALID])
def test_adagrad_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        adagrad(**kwargs)
    with pytest.raises(ValueError):
        torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], **kwargs)
