"""Bad input raises a ValueError on every rank before any data collective, never a hang."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.core import adam, plan_partition, sgd
from shardopt.functional import shard
from shardopt.functional.engine._validate import fingerprint

SHAPES = [(4, 3), (5,), (2, 2)]


def params_for(rank: int, case: str) -> list[torch.Tensor]:
    shapes = list(SHAPES)
    if case == "fewer_params" and rank == 1:
        shapes = shapes[:-1]
    if case == "other_shape" and rank == 1:
        shapes[1] = (6,)
    params = [torch.ones(s) for s in shapes]
    if case == "other_dtype" and rank == 1:
        params[0] = params[0].double()
    return params


def attempt(rank: int, world: int, case: str) -> str:
    """Runs one bad-input case on this rank and returns what it raised."""
    params = params_for(rank, case)
    common = [torch.ones(s) for s in SHAPES]
    tx: Any = adam()
    plan = plan_partition(common, world)
    kwargs: dict[str, Any] = {}
    if case in ("other_shape", "other_dtype"):
        plan = plan_partition(params, world)  # each rank plans its own parameters
    if case == "other_strategy" and rank == 1:
        plan = plan_partition(common, world, strategy="greedy")
    if case == "other_world_size":
        plan = plan_partition(common, world + 1)
    if case == "other_stage" and rank == 1:
        kwargs["stage"] = 2
    if case == "other_optimizer" and rank == 1:
        tx = sgd(0.1, momentum=0.9)
    try:
        shard(tx, plan, **kwargs).init(params)
    except ValueError as exc:
        return str(exc)
    return "no error"


def grads_case(rank: int, world: int, case: str) -> str:
    params = [torch.ones(s) for s in SHAPES]
    sharded = shard(
        adam(), plan_partition(params, world), max_norm=1.0 if "one_rank" in case else None
    )
    state = sharded.init(params)
    grads = [torch.ones(s) for s in SHAPES]
    if case.startswith("noncontiguous") and (rank == 1 or "one_rank" not in case):
        grads[0] = torch.ones(3, 4).t()
    if case == "sparse":
        grads[1] = torch.ones(5).to_sparse()
    try:
        sharded.step(params, grads, state)
    except ValueError as exc:
        return str(exc)
    return "no error"


def all_cases(rank: int, world: int) -> dict[str, str]:
    """Every case in turn, then a good init and step: the group is still in step afterwards."""
    out = {}
    for case in CASES:
        out[case] = attempt(rank, world, case)
    for case in GRAD_CASES:
        out[case] = grads_case(rank, world, case)
    params = [torch.ones(s) for s in SHAPES]
    sharded = shard(adam(), plan_partition(params, world))
    state = sharded.init(params)
    sharded.step(params, [torch.ones(s) for s in SHAPES], state)
    out["good"] = "no error"
    return out


MISMATCH = "shard: expected the same parameters, plan, options and optimizer state structure"
ELSEWHERE = "shard: expected valid input on every rank, got an error on rank(s) [1]"
# case: (message start on rank 0, on rank 1)
CASES: dict[str, tuple[str, str]] = {
    "fewer_params": (ELSEWHERE, "shard: expected 3 parameters (as in the plan), got 2"),
    "other_shape": (MISMATCH, MISMATCH),
    "other_dtype": (MISMATCH, MISMATCH),
    "other_strategy": (MISMATCH, MISMATCH),
    "other_stage": (MISMATCH, MISMATCH),
    "other_optimizer": (MISMATCH, MISMATCH),
    "other_world_size": ("shard: expected a plan for world_size=2, got a plan for 3",) * 2,
}
GRAD_CASES: dict[str, tuple[str, str]] = {
    "noncontiguous": ("shard: expected grads[0] to be contiguous, got strides (1, 4)",) * 2,
    "sparse": ("shard: expected grads[1] to be dense, got a torch.sparse_coo gradient",) * 2,
    "noncontiguous_one_rank": (
        "shard: expected valid gradients on every rank, got errors on 1 rank(s)",
        "shard: expected grads[0] to be contiguous, got strides (1, 4)",
    ),
}


def test_every_bad_input_raises_on_every_rank_and_leaves_the_group_usable(run_world):
    results = run_world(all_cases, 2, timeout=90)
    for case, expected in {**CASES, **GRAD_CASES}.items():
        for rank, want in enumerate(expected):
            got = results[rank][case]
            assert got.startswith(want), f"{case}, rank {rank}: {got}"
    assert all(r["good"] == "no error" for r in results)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 3}, "shard: expected stage 1 or 2, got 3"),
        ({"stage": 2, "grads_averaged": True}, "shard: expected grads_averaged=False with stage=2"),
        ({"grads_averaged": 1}, "shard: expected grads_averaged a bool, got 1"),
        (
            {"grads_averaged": True, "reduce_dtype": torch.float32},
            "shard: expected reduce_dtype=None with grads_averaged=True",
        ),
        ({"reduce_dtype": torch.int32}, "shard: expected reduce_dtype None or a float dtype"),
        ({"master_dtype": torch.int32}, "shard: expected master_dtype None or a float dtype"),
        ({"max_norm": -1.0}, "shard: expected max_norm None or > 0, got -1.0"),
    ],
)
def test_bad_options_raise_when_shard_is_called(kwargs, message):
    plan = plan_partition([torch.ones(2)], 1)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        shard(adam(), plan, **kwargs)


def test_fingerprints_ignore_device_indices_but_not_the_layout():
    def on(device: str, world: int) -> Any:
        return plan_partition([((3, 2), "float32", device)], world)

    assert fingerprint(on("cuda:0", 2), 0) == fingerprint(on("cuda:1", 2), 0)
    assert fingerprint(on("cuda:0", 2), 0) != fingerprint(on("cuda:0", 3), 0)
    assert fingerprint(on("cpu", 2), 0) != fingerprint(on("cuda:0", 2), 0)


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_a_mismatch_names_the_first_field_that_differs_with_each_rank_s_value(world):
    from shardopt.core import plan_partition, sgd
    from shardopt.functional import shard
    from shardopt.optim import ZeroRedundancyOptimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"got param_groups\[0\]\.lr: rank 0 0\.1, rank 1 0\.2$"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1 * (world.rank + 1))
    mine = [torch.nn.Parameter(torch.zeros(3 + world.rank))]
    with pytest.raises(ValueError, match=r"params\[0\]: rank 0 '\(3,\) float32 cpu', rank 1 '\(4,"):
        ZeroRedundancyOptimizer(mine, torch.optim.SGD, lr=0.1)
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"got to: rank 0 0, rank 1 1$"):
        zero.consolidate_state_dict(to=world.rank)
    plan = plan_partition(params, 2)
    stage = r"got options\.stage: rank 0 <Stage\.OPTIMIZER_STATE: 1>, rank 1 <Stage\.GRADIENTS"
    with pytest.raises(ValueError, match=stage):
        shard(sgd(0.1), plan, stage=1 + world.rank).init(params)
    shape = r"got plan\.tensors\[0\]\.shape: rank 0 \[3\], rank 1 \[4\]$"
    with pytest.raises(ValueError, match=shape):
        shard(sgd(0.1), plan_partition(mine, 2)).init(mine)
