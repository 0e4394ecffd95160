"""PeriodicModelAverager, HierarchicalModelAverager and average_parameters against torch's."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier
import torch.distributed.algorithms.model_averaging.utils as torch_utils
from torch import nn

from shardopt.optim._averagers import HierarchicalModelAverager, PeriodicModelAverager
from shardopt.optim._averaging import average_parameters
from shardopt.testing import spawn

STEPS = 30
_GROUP = object()  # stands in for a process group where none is touched


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    # A parameter that never gets a gradient, different on every rank: torch's averagers skip
    # it, and so must ours.
    model.register_parameter("unused", nn.Parameter(torch.full((3,), float(dist.get_rank()))))
    return model


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _ranks_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same trained parameters (the unused one excluded)."""
    flat = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if n != "unused"])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, flat) for g in gathered)


def _run_side_by_side(make_ours: Any, make_torch: Any, use_groups: bool) -> list[int]:
    """Trains twin models with our averager and torch's; checks they agree bitwise every step.

    Returns the steps after which all ranks held the same parameters.
    """
    ours, theirs = _model(), _model()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    averager_ours, averager_theirs = make_ours(), make_torch()
    agreed = []
    for step in range(STEPS):
        _train_step(ours, opt_ours, step)
        _train_step(theirs, opt_theirs, step)
        averager_ours.average_parameters(opt_ours.param_groups if use_groups else ours.parameters())
        averager_theirs.average_parameters(
            opt_theirs.param_groups if use_groups else theirs.parameters()
        )
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), f"step {step}: parameter {name} differs from torch's"
        assert averager_ours.step == averager_theirs.step == step + 1
        if _ranks_agree(ours):
            agreed.append(step)
    return agreed


def _periodic_world(rank: int, world_size: int) -> list[list[int]]:
    agreed = []
    for period, warmup, use_groups in [(4, 5, False), (3, 0, True), (2, 7, False)]:
        agreed.append(
            _run_side_by_side(
                lambda p=period, w=warmup: PeriodicModelAverager(p, w),
                lambda p=period, w=warmup: torch_averagers.PeriodicModelAverager(p, w),
                use_groups,
            )
        )
    return agreed


def test_periodic_averager_matches_torch_bitwise_for_30_steps_on_2_ranks() -> None:
    agreed = spawn(_periodic_world, 2, backend="gloo", timeout=120)[0]
    # The ranks agree exactly at the averaging steps: proof that averaging took place, there only.
    assert agreed == [
        list(range(5, STEPS, 4)),
        list(range(0, STEPS, 3)),
        list(range(7, STEPS, 2)),
    ]


HIERARCHIES = [
    (OrderedDict([(2, 2), (4, 4)]), 3),
    ({3: 2, 5: 4}, 0),
    ({2: 1, 4: 2, 8: 4}, 4),
]


def _hierarchical_world() -> list[list[int]]:
    agreed = []
    for i, (sizes, warmup) in enumerate(HIERARCHIES):
        agreed.append(
            _run_side_by_side(
                lambda s=sizes, w=warmup: HierarchicalModelAverager(s, w),
                lambda s=sizes, w=warmup: torch_hier.HierarchicalModelAverager(s, w),
                use_groups=i == 1,
            )
        )
    return agreed


def _four_rank_world(rank: int, world_size: int) -> dict[str, Any]:
    """One 4-rank world for the hierarchical, validation and average_parameters checks."""
    return {
        "hierarchical": _hierarchical_world(),
        "validation": _validation_world(),
        "average_parameters": _average_parameters_world(),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    """The results of every rank of :func:`_four_rank_world` (spawned once per module)."""
    return spawn(_four_rank_world, 4, backend="gloo", timeout=180)


def test_hierarchical_averager_matches_torch_bitwise_for_30_steps_on_4_ranks(
    four_ranks: list[dict[str, Any]],
) -> None:
    agreed = four_ranks[0]["hierarchical"]
    # Only the world-sized level makes all 4 ranks agree: steps >= warmup divisible by it.
    assert agreed == [
        [s for s in range(3, STEPS) if s % 4 == 0],
        [s for s in range(STEPS) if s % 5 == 0],
        [s for s in range(4, STEPS) if s % 8 == 0],
    ]


def _raises(fn: Any) -> type[BaseException] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except Exception as exc:
        return type(exc)
    return None


def _warns(fn: Any) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return any(issubclass(w.category, UserWarning) for w in caught)


def _validation_world() -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "empty": ({}, 0),
        "zero period": ({0: 4}, 0),
        "size not dividing": ({2: 3, 4: 4}, 0),
        "last size not world": ({2: 2, 4: 2}, 0),
        "negative warmup": ({2: 2, 4: 4}, -1),
    }
    for name, (sizes, warmup) in cases.items():
        ours = _raises(lambda s=sizes, w=warmup: HierarchicalModelAverager(s, w))
        theirs = _raises(lambda s=sizes, w=warmup: torch_hier.HierarchicalModelAverager(s, w))
        out[f"hierarchical {name}"] = (ours, theirs)
    for name, (period, warmup) in {"period 0": (0, 0), "warmup -1": (2, -1)}.items():
        ours = _raises(lambda p=period, w=warmup: PeriodicModelAverager(p, w))
        theirs = _raises(lambda p=period, w=warmup: torch_averagers.PeriodicModelAverager(p, w))
        out[f"periodic {name}"] = (ours, theirs)
    out["periodic warns at period 1"] = (
        _warns(lambda: PeriodicModelAverager(1)),
        _warns(lambda: torch_averagers.PeriodicModelAverager(1)),
    )
    out["hierarchical warns at max period 1"] = (
        _warns(lambda: HierarchicalModelAverager({1: 4})),
        _warns(lambda: torch_hier.HierarchicalModelAverager({1: 4})),
    )
    return out


def test_averager_validation_raises_and_warns_where_torch_does(
    four_ranks: list[dict[str, Any]],
) -> None:
    results = four_ranks[0]["validation"]
    for case, (ours, theirs) in results.items():
        assert ours == theirs, f"{case}: ours {ours}, torch {theirs}"
        assert ours in (ValueError, True), case


def _average_parameters_world() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32, torch.float64]
    params = [torch.randn(3, 2, generator=gen).to(dt) for dt in dtypes]
    inputs = [p.clone() for p in params]
    calls: list[torch.dtype] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.dtype)
        return real_all_reduce(tensor, *args, **kwargs)

    ptrs = [p.data_ptr() for p in params]
    dist.all_reduce = counting_all_reduce
    try:
        average_parameters(params)
    finally:
        dist.all_reduce = real_all_reduce
    out: dict[str, Any] = {"calls": calls, "in place": [p.data_ptr() for p in params] == ptrs}
    errors = []
    for x, p in zip(inputs, params):
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        mean = torch.stack([g.double() for g in gathered]).mean(0)
        errors.append(((p.double() - mean).abs().max() / mean.abs().max()).item())
    out["relative errors"] = errors
    # One dtype: bitwise the result of torch's average_parameters.
    single = [x.clone() for x in inputs if x.dtype == torch.float32]
    reference = [x.clone() for x in single]
    average_parameters([{"params": single}])
    torch_utils.average_parameters(iter(reference), dist.group.WORLD)  # type: ignore[arg-type]
    out["equals torch"] = all(torch.equal(a, b) for a, b in zip(single, reference))
    return {**out, **_average_parameters_edge_cases(rank)}


def _average_parameters_edge_cases(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A subgroup: ranks 0 and 1 average between them, the others keep their values.
    sub = dist.new_group([0, 1])
    mine = torch.full((4,), float(rank))
    buffer = torch.zeros(6)
    view = buffer[1:5]
    view.copy_(mine)
    average_parameters([view], sub)
    out["subgroup"] = buffer[1:5].tolist()
    # only_with_grad leaves the parameters without a gradient alone.
    with_grad, without = torch.full((2,), float(rank)), torch.full((2,), float(rank))
    with_grad.grad = torch.zeros(2)
    average_parameters([with_grad, without], only_with_grad=True)
    out["only_with_grad"] = (with_grad.tolist(), without.tolist())
    return out


def test_average_parameters_does_one_all_reduce_per_dtype_and_equals_the_mean(
    four_ranks: list[dict[str, Any]],
) -> None:
    results = [out["average_parameters"] for out in four_ranks]
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-15, torch.bfloat16: 1e-2}
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32, torch.float64]
    for rank, out in enumerate(results):
        assert out["calls"] == [torch.float32, torch.float64, torch.bfloat16], rank
        assert out["in place"], rank
        for i, (dt, err) in enumerate(zip(dtypes, out["relative errors"])):
            assert err <= tolerance[dt], f"rank {rank} param {i} ({dt}): error {err:.2e}"
        assert out["equals torch"], rank
        expected = [0.5] * 4 if rank < 2 else [float(rank)] * 4
        assert out["subgroup"] == expected, rank
        assert out["only_with_grad"] == ([1.5, 1.5], [float(rank)] * 2), rank


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: PeriodicModelAverager(0),
            ValueError,
            "PeriodicModelAverager: expected period >= 1, got 0",
        ),
        (lambda: PeriodicModelAverager(4, -2), ValueError, "expected warmup_steps >= 0, got -2"),
        (
            lambda: PeriodicModelAverager(2.5),  # type: ignore[arg-type]
            TypeError,
            "expected an integer period, got 2.5",
        ),
        (
            lambda: HierarchicalModelAverager(),
            ValueError,
            "expected a non-empty period_group_size_dict",
        ),
        (
            lambda: HierarchicalModelAverager({}),
            ValueError,
            "non-empty period_group_size_dict, got {}",
        ),
        (
            lambda: HierarchicalModelAverager({4: 2, 2: 4}),
            ValueError,
            "in increasing order, got [4, 2]",
        ),
        (lambda: HierarchicalModelAverager({0: 2}), ValueError, "expected periods >= 1, got 0"),
        (lambda: HierarchicalModelAverager({2: 0}), ValueError, "expected group sizes >= 1, got 0"),
        (lambda: HierarchicalModelAverager({2: 2}, -1), ValueError, "warmup_steps >= 0, got -1"),
        (
            lambda: HierarchicalModelAverager([(2, 2)]),  # type: ignore[arg-type]
            TypeError,
            "to be a mapping",
        ),
    ],
)
def test_averager_rejects_bad_arguments_naming_the_class_the_rule_and_the_value(
    make: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=__import__("re").escape(message)):
        make()


def test_averager_without_a_process_group_asks_for_init_process_group() -> None:
    with pytest.raises(RuntimeError, match="PeriodicModelAverager: expected an initialized"):
        PeriodicModelAverager(4)


def test_periodic_averager_warns_at_period_1_like_torch() -> None:
    with pytest.warns(UserWarning, match="period of 1"):
        PeriodicModelAverager(1, process_group=_GROUP)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (torch.ones(2), TypeError, "got a tensor"),
        (
            [torch.ones(2, dtype=torch.int64)],
            ValueError,
            "floating-point or complex tensors, got torch.int64",
        ),
        ([3.0], TypeError, "got float"),
        ([{"lr": 0.1}], ValueError, "with a 'params' key"),
    ],
)
def test_average_parameters_rejects_bad_input(
    params: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        average_parameters(params)
