"""Tensor and optimizer-state comparisons: per-dtype tolerances, bitwise mode, located errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardopt.testing import DEFAULT_RTOL
from shardopt.testing._compare import Tolerance, compare_state_dicts, compare_tensors


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 2**-5)],
)
def test_default_tolerances_per_dtype(dtype: torch.dtype, rtol: float) -> None:
    assert Tolerance().for_dtype(dtype) == rtol == DEFAULT_RTOL[dtype]
    assert Tolerance(exact=True).for_dtype(dtype) == 0.0
    assert Tolerance(rtol={dtype: 0.5}).for_dtype(dtype) == 0.5
    assert Tolerance().for_dtype(torch.int64) == 0.0


def test_error_is_measured_on_the_reference_tensors_scale() -> None:
    reference = torch.tensor([[100.0, 1e-3], [2.0, -4.0]], dtype=torch.float64)
    candidate = reference.clone()
    candidate[0, 1] += 1e-9  # a huge error for that element, tiny for the tensor
    error = compare_tensors(candidate, reference, 1e-10)
    assert error.ok
    assert error.max_abs == pytest.approx(1e-9)
    assert error.max_rel == pytest.approx(1e-11)


def test_a_mismatch_names_the_worst_element_and_both_values() -> None:
    reference = torch.zeros(3, 4)
    candidate = reference.clone()
    candidate[2, 1] = 0.5
    error = compare_tensors(candidate, reference + 1.0, 1e-6)
    assert not error.ok
    assert "float32, shape (3, 4): max abs error 1.000e+00" in error.detail
    assert "beyond rtol 1.0e-06" in error.detail
    assert "worst at (0, 0): candidate 0.0, reference 1.0" in error.detail


def test_bitwise_mode_refuses_a_one_ulp_difference() -> None:
    reference = torch.tensor([1.0, 2.0])
    candidate = torch.nextafter(reference, torch.tensor(3.0))
    assert compare_tensors(candidate, reference, 1e-6).ok
    assert not compare_tensors(candidate, reference, 0.0).ok
    assert compare_tensors(reference.clone(), reference, 0.0).ok


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_candidates_never_match(bad: float) -> None:
    reference = torch.tensor([1.0, 2.0])
    assert not compare_tensors(torch.tensor([1.0, bad]), reference, 1.0).ok


def test_shape_and_dtype_differences_are_mismatches() -> None:
    error = compare_tensors(torch.zeros(3), torch.zeros(4), 1.0)
    assert not error.ok
    assert error.detail == "float32, shape (3,) differs from the reference's float32, shape (4,)"
    assert not compare_tensors(torch.zeros(3, dtype=torch.float64), torch.zeros(3), 1.0).ok


def adam_state(exp_avg: float, step: float = 1.0, lr: float = 0.1) -> dict[str, Any]:
    return {
        "state": {0: {"step": torch.tensor(step), "exp_avg": torch.full((2,), exp_avg)}},
        "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": [0, 1]}],
    }


@pytest.mark.parametrize(
    ("candidate", "what"),
    [
        (adam_state(0.5), "state 'exp_avg' of parameter 'w' (index 0): float32, shape (2,)"),
        (adam_state(0.0, step=2.0), "state 'step' of parameter 'w' (index 0)"),
        (adam_state(0.0, lr=0.2), "param_groups[0]['lr']: candidate 0.2, torch.optim 0.1"),
        (
            {**adam_state(0.0), "state": {}},
            "state of parameter 'w' (index 0): the candidate has none",
        ),
        (
            {**adam_state(0.0), "state": {0: {"step": torch.tensor(1.0)}}},
            "state 'exp_avg' of parameter 'w' (index 0): missing in the candidate",
        ),
    ],
    ids=["value", "step", "hyperparameter", "missing-parameter", "missing-key"],
)
def test_state_dict_mismatches_are_located(candidate: dict[str, Any], what: str) -> None:
    found = compare_state_dicts(candidate, adam_state(0.0), ["w", "b"], Tolerance(), step=3, rank=1)
    assert [m.describe() for m in found if m.describe().startswith(what)], found
    assert all((m.step, m.rank) == (3, 1) for m in found)


def test_equal_state_dicts_match() -> None:
    assert (
        compare_state_dicts(
            adam_state(0.25), adam_state(0.25), ["w", "b"], Tolerance(exact=True), step=1, rank=0
        )
        == []
    )


def test_tolerance_refuses_negative_bounds() -> None:
    with pytest.raises(
        ValueError, match=r"Tolerance: expected rtol to map torch.dtype to a value >= 0"
    ):
        Tolerance(rtol={torch.float32: -1.0})
