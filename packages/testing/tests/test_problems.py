"""Reference models and data: deterministic from a seed, and each with the property it is for."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from shardopt.testing import (
    PROBLEM_NAMES,
    Problem,
    build_gated_mlp,
    build_gpt,
    gated_batch,
    mean_squared_error,
    reference_problem,
    regression_batch,
)


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_each_problem_builds_the_same_weights_and_data_for_the_same_seed(name: str) -> None:
    first, second = reference_problem(name, seed=5), reference_problem(name, seed=5)
    for a, b in zip(parameters(first.model()), parameters(second.model()), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first.data(3), second.data(3), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_seeds_and_steps_change_the_weights_and_the_data(name: str) -> None:
    seed0, seed1 = reference_problem(name, seed=0), reference_problem(name, seed=1)
    assert not torch.equal(parameters(seed0.model())[0], parameters(seed1.model())[0])
    assert not torch.equal(seed0.data(0)[0], seed1.data(0)[0])
    assert not torch.equal(seed0.data(0)[0], seed0.data(1)[0])


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_each_problem_trains_and_pickles(name: str) -> None:
    problem = pickle.loads(pickle.dumps(reference_problem(name)))
    model = problem.model()
    loss = problem.loss(model, problem.data(0))
    loss.backward()
    assert loss.dim() == 0
    assert torch.isfinite(loss)


def test_building_a_model_leaves_the_callers_random_state_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    reference_problem("gpt").model()
    assert torch.equal(torch.rand(3), expected)


def test_problems_default_to_float64_and_take_a_dtype() -> None:
    assert {p.dtype for p in reference_problem("mlp").model().parameters()} == {torch.float64}
    float32 = reference_problem("conv", dtype=torch.float32)
    assert {p.dtype for p in float32.model().parameters()} == {torch.float32}
    assert float32.data(0)[0].dtype == torch.float32


def test_gpt_embedding_holds_most_parameters() -> None:
    model: Any = build_gpt()
    total = sum(p.numel() for p in model.parameters())
    assert model.embed.weight.numel() > 0.6 * total


def test_frozen_problem_has_parameters_without_gradients() -> None:
    problem = reference_problem("frozen")
    model = problem.model()
    problem.loss(model, problem.data(0)).backward()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert len(frozen) == 2
    assert all(p.grad is None for p in frozen)


def test_mixed_dtype_problem_holds_bfloat16_and_float32_parameters() -> None:
    model = reference_problem("mixed_dtypes").model()
    dtypes = [p.dtype for p in model.parameters()]
    assert dtypes.count(torch.bfloat16) == 2
    assert dtypes.count(torch.float32) == 4


@pytest.mark.parametrize(("step", "extra_has_grad"), [(0, False), (1, True), (2, False)])
def test_gated_layer_gets_a_gradient_in_odd_steps_only(step: int, extra_has_grad: bool) -> None:
    model: Any = build_gated_mlp(dtype=torch.float64)
    mean_squared_error(model, gated_batch(step, dtype=torch.float64)).backward()
    assert (model.extra.weight.grad is not None) == extra_has_grad
    assert model.out.weight.grad is not None


def test_batch_splits_evenly_over_one_to_four_ranks() -> None:
    for tensor in reference_problem("gpt").data(0):
        assert all(tensor.shape[0] % world_size == 0 for world_size in (1, 2, 3, 4))


def test_unknown_problem_names_and_non_callables_are_refused() -> None:
    with pytest.raises(ValueError, match=r"reference_problem: expected a name in .* got 'rnn'"):
        reference_problem("rnn")
    with pytest.raises(TypeError, match="Problem: expected model to be callable, got 3"):
        Problem("bad", 3, regression_batch, mean_squared_error)  # type: ignore[arg-type]
