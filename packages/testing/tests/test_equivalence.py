"""assert_matches_torch: correct candidates pass, deliberately wrong ones are caught and located."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardopt.testing import (
    PROBLEM_NAMES,
    Problem,
    RankError,
    World,
    assert_matches_torch,
    cuda_device_count,
    mean_squared_error,
    reference_problem,
    regression_batch,
    torch_optimizer_candidate,
    with_gradient_averaging,
    zero_redundancy_candidate,
)

LR = 1e-2
Adam, AdamW, SGD = torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD

# Deliberately wrong candidates. Module-level, so that the ranks can unpickle them.


def adam_without_first_parameter(model: nn.Module, world: World, lr: float) -> Any:
    return Adam(list(model.parameters())[1:], lr=lr)


def adam_on_local_gradients(model: nn.Module, world: World) -> Any:
    return Adam(model.parameters(), lr=LR)  # never averages: each rank steps on its shard


def adam_with_lr_off_on_rank_one(model: nn.Module, world: World) -> Any:
    return Adam(model.parameters(), lr=LR * 1.01 if world.rank == 1 else LR)


class SummingSGD:
    """All-reduces the gradients but forgets to divide by the world size."""

    def __init__(self, model: nn.Module, world: World) -> None:
        self.params = list(model.parameters())
        self.optimizer = SGD(self.params, lr=LR)

    def step(self) -> None:
        for param in self.params:
            dist.all_reduce(param.grad)
        self.optimizer.step()


class ForgetfulZero:
    """torch's ZeroRedundancyOptimizer whose rank 1 loses its optimizer state after step 2."""

    def __init__(self, model: nn.Module, world: World) -> None:
        self.inner: Any = zero_redundancy_candidate(Adam, lr=LR)(model, world)
        self.rank = world.rank
        self.steps = 0

    def step(self) -> None:
        self.inner.step()
        self.steps += 1
        if self.rank == 1 and self.steps == 2:
            self.inner.inner.optimizer.optim.state.clear()

    def consolidated_state_dict(self) -> Any:
        return self.inner.consolidated_state_dict()


class StateDroppingZero:
    """Steps correctly, but its consolidated state lacks the last parameter's entry."""

    def __init__(self, model: nn.Module, world: World) -> None:
        self.inner: Any = zero_redundancy_candidate(Adam, lr=LR)(model, world)

    def step(self) -> None:
        self.inner.step()

    def consolidated_state_dict(self) -> Any:
        state = self.inner.consolidated_state_dict()
        if state is not None:
            state["state"].pop(max(state["state"]))
        return state


def broken_candidate(model: nn.Module, world: World) -> Any:
    raise RuntimeError(f"candidate broke on rank {world.rank}")


def build_unseeded_linear() -> nn.Module:
    return nn.Linear(8, 4)


def check(candidate: Any, world_size: int, **kwargs: Any) -> Any:
    """assert_matches_torch against Adam(lr=LR) on the float64 MLP unless told otherwise."""
    options: dict[str, Any] = {"problem": reference_problem("mlp"), "world_size": world_size}
    options.update(kwargs)
    reference = options.pop("reference", (Adam, {"lr": LR}))
    return assert_matches_torch(candidate, *reference, **options)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_torch_zero_redundancy_optimizer_matches_adam_on_the_imbalanced_gpt(
    world_size: int,
) -> None:
    report = check(
        zero_redundancy_candidate(Adam, lr=LR),
        world_size,
        problem=reference_problem("gpt"),
        compare_state=True,
    )
    assert report.world_size == world_size
    gpus = cuda_device_count() >= world_size and dist.is_nccl_available()
    assert report.backend == ("nccl" if gpus else "gloo")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("optimizer", "kwargs"),
    [
        (Adam, {"lr": LR}),
        (AdamW, {"lr": LR, "weight_decay": 0.1}),
        (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
    ids=["adam", "adamw", "sgd-nesterov"],
)
def test_all_reduce_then_torch_optimizer_matches_the_single_process_optimizer(
    optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any], world_size: int
) -> None:
    candidate = torch_optimizer_candidate(optimizer, **kwargs)
    check(candidate, world_size, reference=(optimizer, kwargs), compare_state=True)


@pytest.mark.parametrize("name", PROBLEM_NAMES)
def test_all_reduce_adam_matches_bitwise_on_every_problem_at_two_ranks(name: str) -> None:
    candidate = torch_optimizer_candidate(Adam, lr=LR)
    report = check(
        candidate, 2, problem=reference_problem(name), exact=True, compare_state=True, steps=4
    )
    assert report.max_abs_error == 0.0


@pytest.mark.parametrize("name", ["mlp", "conv", "gpt", "frozen", "sometimes_unused"])
def test_zero_redundancy_optimizer_matches_bitwise_at_one_and_two_ranks(name: str) -> None:
    for world_size in (1, 2):
        candidate = zero_redundancy_candidate(Adam, lr=LR)
        problem = reference_problem(name)
        check(candidate, world_size, problem=problem, exact=True, compare_state=True, steps=4)


@pytest.mark.parametrize("name", ["conv", "frozen", "sometimes_unused"])
def test_zero_redundancy_optimizer_matches_within_float64_tolerance_at_four_ranks(
    name: str,
) -> None:
    candidate = zero_redundancy_candidate(Adam, lr=LR)
    check(candidate, 4, problem=reference_problem(name), compare_state=True, steps=4)


def test_full_batch_reference_agrees_with_data_parallel_adam_at_four_ranks() -> None:
    check(torch_optimizer_candidate(Adam, lr=LR), 4, reference_grads="full_batch", steps=4)


def test_float32_candidates_match_bitwise_at_one_rank() -> None:
    problem = reference_problem("gpt", dtype=torch.float32)
    for candidate in (
        zero_redundancy_candidate(Adam, lr=LR),
        torch_optimizer_candidate(Adam, lr=LR),
    ):
        check(candidate, 1, problem=problem, exact=True, compare_state=True)


@pytest.mark.parametrize(
    ("candidate", "world_size", "first_step", "what"),
    [
        (
            torch_optimizer_candidate(Adam, lr=LR * 1.01),
            2,
            1,
            "ranks 0, 1: parameter 'layers.0.weight'",
        ),
        (zero_redundancy_candidate(Adam, lr=LR * 1.01), 4, 1, "ranks 0, 1, 2, 3: parameter"),
        (
            with_gradient_averaging(functools.partial(adam_without_first_parameter, lr=LR)),
            2,
            1,
            "ranks 0, 1: parameter 'layers.0.weight': float64, shape (16, 8)",
        ),
        (ForgetfulZero, 2, 3, "ranks 0, 1: parameter"),
        (adam_on_local_gradients, 2, 1, "parameter 'layers.0.weight'"),
        (adam_on_local_gradients, 3, 1, "parameter 'layers.0.weight'"),
    ],
    ids=[
        "lr-off-by-1%",
        "zero-lr-off-by-1%",
        "one-parameter-skipped",
        "state-of-rank-1-lost",
        "no-gradient-averaging-2-ranks",
        "no-gradient-averaging-3-ranks",
    ],
)
def test_wrong_optimizers_are_caught_at_their_first_wrong_step(
    candidate: Any, world_size: int, first_step: int, what: str
) -> None:
    with pytest.raises(AssertionError) as info:
        check(candidate, world_size, steps=4)
    message = str(info.value)
    assert message.startswith("assert_matches_torch: the candidate differs from torch.optim.Adam")
    assert f"after step {first_step} of 4" in message
    assert what in message
    assert "max abs error" in message
    assert "max rel error" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_summing_instead_of_averaging_gradients_is_caught_with_sgd(world_size: int) -> None:
    # Adam hardly sees a gradient's scale (m / sqrt(v)); plain SGD sees it fully.
    with pytest.raises(AssertionError, match="after step 1 of 3"):
        check(SummingSGD, world_size, reference=(SGD, {"lr": LR}))


def test_a_bug_on_one_rank_is_reported_on_that_rank_only() -> None:
    with pytest.raises(AssertionError) as info:
        check(with_gradient_averaging(adam_with_lr_off_on_rank_one), 3)
    message = str(info.value)
    assert "\n  rank 1: parameter 'layers.0.weight'" in message
    assert "ranks matching at this step: [0, 2]" in message


def test_lost_state_is_caught_a_step_earlier_with_compare_state() -> None:
    with pytest.raises(AssertionError) as info:
        check(ForgetfulZero, 2, steps=4, compare_state=True)
    message = str(info.value)
    assert "after step 2 of 4" in message
    assert "the candidate has none" in message


def test_a_wrong_consolidated_state_is_caught_although_parameters_match() -> None:
    with pytest.raises(AssertionError) as info:
        check(StateDroppingZero, 2, compare_state=True)
    message = str(info.value)
    assert "after step 1 of 3" in message
    assert "state of parameter 'layers.2.bias' (index 5): the candidate has none" in message
    assert "ranks matching at this step: [1]" in message  # only rank 0 holds the state


def test_a_raising_candidate_surfaces_as_the_ranks_error() -> None:
    with pytest.raises(RankError, match="candidate broke on rank"):
        check(broken_candidate, 2)


def test_an_unseeded_model_factory_is_refused() -> None:
    problem = Problem("unseeded", build_unseeded_linear, regression_batch, mean_squared_error)
    with pytest.raises(RankError, match="builds different weights on each call"):
        check(torch_optimizer_candidate(Adam, lr=LR), 1, problem=problem)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reference": (nn.Linear, {})}, TypeError, "expected reference to be a torch.optim"),
        ({"steps": 0}, ValueError, "expected an int steps >= 1, got 0"),
        (
            {"world_size": 5},
            ValueError,
            r"expected every tensor .* divisible by world_size=5, got leading dims \[\(12,\)",
        ),
        ({"world_size": 0}, ValueError, "expected an int world_size >= 1, got 0"),
        ({"reference_grads": "mean"}, ValueError, "expected reference_grads in"),
        ({"rtol": -1.0}, ValueError, "expected rtol >= 0, got -1.0"),
        ({"problem": "mlp"}, TypeError, "expected problem to be a Problem, got 'mlp'"),
    ],
)
def test_bad_arguments_are_refused_with_the_rule_and_the_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=f"assert_matches_torch: {match}"):
        check(torch_optimizer_candidate(Adam, lr=LR), kwargs.pop("world_size", 2), **kwargs)
