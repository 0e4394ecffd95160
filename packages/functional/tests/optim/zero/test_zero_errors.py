"""ZeroRedundancyOptimizer's errors: torch's types, our messages, raised on every rank together
after the one small agreement collective and before any data moves."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "broadcast",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "send",
)


class CollectiveCalledError(AssertionError):
    pass


@contextlib.contextmanager
def only_the_agreement() -> Iterator[list[int]]:
    """Inside, one all-gather of two int64 per rank (the agreement) runs; any other collective
    fails the test. Yields the list of agreement calls made."""
    real = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    made: list[int] = []

    def fail(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> None:
            raise CollectiveCalledError(f"dist.{name} was called before the error")

        return call

    def agreement(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        if made or input.dtype != torch.int64 or input.numel() != 2:
            raise CollectiveCalledError("a collective besides the agreement was called")
        made.append(output.numel())
        return real(output, input, **kwargs)

    present = {n: fail(n) for n in COLLECTIVES if hasattr(dist, n)}
    present[real.__name__] = agreement
    with mock.patch.multiple(dist, **present):
        yield made


class SGDSubclass(torch.optim.SGD):
    """SGD on gradients scaled to unit norm per tensor: not elementwise."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(p.grad.norm())
        return super().step(closure)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


# (name, build, error type, message pattern)
CONSTRUCTOR_CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "empty",
        lambda: ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1),
        ValueError,
        r"ZeroRedundancyOptimizer: expected at least one parameter, got an empty parameter list",
    ),
    (
        "a_tensor",
        lambda: ZeroRedundancyOptimizer(torch.zeros(2), torch.optim.SGD, lr=0.1),
        TypeError,
        r"expected params to be an iterable of tensors or param-group dicts, got torch\.Float",
    ),
    (
        "a_float",
        lambda: ZeroRedundancyOptimizer(1.5, torch.optim.SGD, lr=0.1),
        TypeError,
        r"iterable of tensors or param-group dicts, got float",
    ),
    (
        "tensors_and_an_int",
        lambda: ZeroRedundancyOptimizer([*model().parameters(), 42], torch.optim.SGD, lr=0.1),
        TypeError,
        r"got an element of type int",
    ),
    (
        "group_without_params",
        lambda: ZeroRedundancyOptimizer([{"lr": 0.1}], torch.optim.SGD, lr=0.1),
        ValueError,
        r"expected param group 0 to have a 'params' key",
    ),
    (
        "mixed_dtypes",
        lambda: ZeroRedundancyOptimizer(
            [torch.zeros(2), torch.zeros(2, dtype=torch.float64)], torch.optim.SGD, lr=0.1
        ),
        ValueError,
        r"expected parameters of one dtype \(pass allow_mixed_dtypes=True .*\), got float32 "
        r"and float64",
    ),
    (
        "flat_with_a_class_that_is_not_elementwise",
        lambda: ZeroRedundancyOptimizer(
            model().parameters(), SGDSubclass, lr=0.1, partition="flat"
        ),
        ValueError,
        r"ZeroRedundancyOptimizer: partition='flat' cannot step SGDSubclass on slices of flat "
        r"buffers: its update of an element depends on other elements",
    ),
    (
        "flat_with_lbfgs",
        lambda: ZeroRedundancyOptimizer(model().parameters(), torch.optim.LBFGS, partition="flat"),
        ValueError,
        r"partition='flat' cannot step LBFGS on slices of flat buffers: the probe could not "
        r"step it on two small tensors \(TypeError: ",
    ),
    (
        "coupled_class",
        lambda: ZeroRedundancyOptimizer(model().parameters(), torch.optim.LBFGS),
        ValueError,
        r"ZeroRedundancyOptimizer: cannot shard LBFGS over 2 ranks: the probe could not step "
        r"it on two small tensors .*; pass allow_coupled=True to accept a result that differs "
        r"from one process's",
    ),
    (
        "flat_without_a_core_form",
        lambda: ZeroRedundancyOptimizer(
            model().parameters(), torch.optim.Adam, differentiable=True, partition="flat"
        ),
        ValueError,
        r"partition='flat' has no shardopt.core form of Adam with differentiable=True",
    ),
    (
        "unknown_partition",
        lambda: ZeroRedundancyOptimizer(model().parameters(), torch.optim.SGD, partition="ring"),
        ValueError,
        r"expected partition in \('greedy', 'flat'\), got 'ring'",
    ),
    (
        "flat_with_overlap",
        lambda: ZeroRedundancyOptimizer(
            model().parameters(),
            torch.optim.SGD,
            lr=0.1,
            overlap_with_ddp=True,
            partition="flat",
        ),
        ValueError,
        r"overlap_with_ddp=True needs partition='greedy'",
    ),
    (
        "torch_rejects_the_lr_greedy",
        lambda: ZeroRedundancyOptimizer(model().parameters(), torch.optim.Adam, lr=-1.0),
        ValueError,
        r"Invalid learning rate",
    ),
    (
        "torch_rejects_the_lr_flat",
        lambda: ZeroRedundancyOptimizer(
            model().parameters(), torch.optim.Adam, lr=-1.0, partition="flat"
        ),
        ValueError,
        r"Invalid learning rate",
    ),
]


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_bad_constructor_input_raises_on_every_rank_after_only_the_agreement(world: World) -> None:
    failures = []
    for name, build, error, pattern in CONSTRUCTOR_CASES:
        try:
            with only_the_agreement():
                build()
        except error as exc:
            if not re.search(pattern, str(exc)):
                failures.append(f"{name}: message {exc}")
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{name}: did not raise")
        dist.barrier()  # the ranks are still in step: nothing was left half-started
    assert not failures, failures


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_add_param_group_and_consolidation_check_in_only_the_agreement(
    world: World, partition: str
) -> None:
    o = ZeroRedundancyOptimizer(model().parameters(), torch.optim.Adam, partition=partition)
    with (
        only_the_agreement(),
        pytest.raises(ValueError, match=r"one dtype .* got float32 and float64"),
    ):
        o.add_param_group({"params": [torch.zeros(3, dtype=torch.float64)]})
    with (
        only_the_agreement(),
        pytest.raises(ValueError, match=r"consolidate_state_dict: expected 0 <= to"),
    ):
        o.consolidate_state_dict(to=-1)
    assert len(o.param_groups) == 1


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_different_parameters_on_different_ranks_raise_on_every_rank(world: World) -> None:
    params = [torch.zeros(3 + world.rank)]
    with pytest.raises(ValueError, match=r"expected the same parameters, plan, options"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"expected the same parameters"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, partition="flat")


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_flat_hyperparameters_that_change_the_state_layout_raise(world: World) -> None:
    """An lr change is fine (see test_zero_flat); weight_decay from 0 would add a state element
    to the chain: the flat partition says so rather than silently resetting the state."""
    m = model()
    o = ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, partition="flat")
    m(torch.ones(2, 4)).sum().backward()
    o.step()
    o.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"partition='flat' cannot change momentum of SGD"):
        o.step()
    with pytest.raises(TypeError, match=r"partition='flat' takes no extra step arguments"):
        o.step(kwarg=1)
