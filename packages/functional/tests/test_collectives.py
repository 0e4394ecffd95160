"""The collectives: bucketed gathers equal whole ones, and the bytes every step moves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.core import adam, plan_partition
from shardopt.functional import all_gather_params, reduce_scatter_grads, register_grad_hooks, shard
from shardopt.testing import CollectiveCall, count_collectives

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
SHAPES = [((7, 5), F32), ((5,), BF16), ((3, 4, 2), F64), ((13,), F32), ((6, 6), BF16)]


def traffic(calls: list[CollectiveCall], rank: int, world: int) -> tuple[int, int, set[str]]:
    """(bytes this rank sends into gradient reductions, bytes it receives from parameter syncs,
    the names called), counted as the payload of the collective's semantics: a ring
    reduce-scatter or all-gather moves (W-1)/W of its buffer per rank; a reduce to rank d takes
    the block of every other rank, a broadcast from rank s gives its block to every other rank."""
    sent = received = 0
    for c in calls:
        if c.name == "reduce_scatter_single":
            sent += c.second * (world - 1) // world
        elif c.name == "all_gather_single":
            received += c.first * (world - 1) // world
        elif c.name == "reduce" and c.root != rank:
            sent += c.first
        elif c.name == "broadcast" and c.root != rank:
            received += c.first
    return sent, received, {c.name for c in calls}


def make_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(d) for s, d in SHAPES]


def grads_of(params: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def padded_bytes(plan: Any) -> int:
    """Bytes of all flat buffers, padding included: of the parameters and of the gradients."""
    return sum(g.padded_numel * getattr(torch, g.dtype).itemsize for g in plan.groups)


def stage2_traffic(
    rank: int, world: int, strategy: str, hooked: bool, bucket: int | None, algorithm: str
) -> tuple[int, int, set[str], int]:
    """What two stage 2 steps move: (sent, received, names) of :func:`traffic`, padded bytes."""
    params = [p.requires_grad_(True) for p in make_params()]
    plan = plan_partition(params, world, strategy=strategy)
    sharded = shard(adam(1e-3), plan, stage=2, bucket_numel=bucket, algorithm=algorithm)
    state = sharded.init(params)
    if hooked:
        register_grad_hooks(params, state)
    with count_collectives() as counted:
        for _ in range(2):
            if hooked:
                sum((p.double() ** 2).sum() * (rank + 1) for p in params).backward()
                state = sharded.step(params, None, state)
            else:
                state = sharded.step(params, grads_of(params, rank), state)
    return (*traffic(counted.calls, rank, world), padded_bytes(plan))


NAMES = {
    "collective": {"reduce_scatter_single", "all_gather_single"},
    "rooted": {"reduce", "broadcast"},
}


@pytest.mark.parametrize(
    ("world", "strategy", "hooked", "bucket", "algorithm"),
    [
        (2, "flat", False, None, "collective"),
        (3, "greedy", False, 24, "collective"),  # bucket_numel / W: 8, 16, 8 elements per rank
        (4, "flat", True, 64, "collective"),
        (3, "flat", True, None, "rooted"),
        (4, "greedy", False, 32, "rooted"),
    ],
)
def test_stage2_moves_w_minus_1_over_w_of_the_gradients_and_of_the_params_and_nothing_else(
    run_world, world, strategy, hooked, bucket, algorithm
):
    for sent, received, names, padded in run_world(
        stage2_traffic, world, strategy, hooked, bucket, algorithm
    ):
        assert names == NAMES[algorithm]
        assert sent == 2 * (world - 1) * padded // world  # two steps of gradients, padding too
        assert received == 2 * (world - 1) * padded // world  # two steps of parameters


def stage1_traffic(rank: int, world: int, algorithm: str) -> tuple[int, int, set[str], int]:
    params = make_params()
    plan = plan_partition(params, world)
    sharded = shard(adam(1e-3), plan, bucket_numel=16, algorithm=algorithm)
    state = sharded.init(params)
    with count_collectives() as counted:
        state = sharded.step(params, grads_of(params, 0), state)
    return (*traffic(counted.calls, rank, world), plan.sync_cost().recv_bytes_per_rank)


@pytest.mark.parametrize("algorithm", ["collective", "rooted"])
def test_stage1_moves_only_the_parameter_sync(run_world, algorithm):
    for sent, received, names, recv in run_world(stage1_traffic, 3, algorithm):
        assert names == NAMES[algorithm] - {"reduce", "reduce_scatter_single"}
        assert sent == 0
        assert received == recv  # what the plan's sync cost predicts


def overlap(rank: int, world: int) -> tuple[int, int]:
    """(reductions launched before the last gradient arrived, reductions in backward)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(6)]
    params = [p for layer in layers for p in layer.parameters()]
    sharded = shard(adam(), plan_partition(params, world), stage=2, bucket_numel=8)
    state = sharded.init(params)
    register_grad_hooks(params, state)
    log: list[str] = []
    x = torch.randn(4, 8)
    for layer in layers:
        x = torch.tanh(layer(x))
    with count_collectives() as counted:
        calls = counted.calls
        for p in params:  # after the recording hooks: log where reductions start
            p.register_post_accumulate_grad_hook(lambda p: log.append(f"grad {len(calls)}"))
        x.sum().backward()
    sharded.step(params, None, state)
    # reductions launched when the next-to-last gradient had arrived: they overlap backward
    return int(log[-2].split()[1]), len(calls)


def test_gradient_reduction_starts_before_backward_ends(run_world):
    for early, total in run_world(overlap, 2):
        assert 0 < early < total


def buckets_equal_whole(rank: int, world: int, algorithm: str) -> tuple[bool, bool]:
    """A bucketed gather gives the whole one; reduce_scatter_grads averages and accumulates."""
    shard_numel = 7
    buf = torch.full((world * shard_numel,), -1.0)
    buf[rank * shard_numel : (rank + 1) * shard_numel] = torch.arange(shard_numel) + 10.0 * rank
    whole = buf.clone()
    all_gather_params(whole, shard_numel, algorithm=algorithm)
    staging = torch.empty(world * 3)
    for start in range(0, shard_numel, 3):
        stop = min(start + 3, shard_numel)
        bucket = (start, stop)
        all_gather_params(buf, shard_numel, bucket=bucket, staging=staging, algorithm=algorithm)
    packed = torch.arange(world * 2, dtype=torch.float32) * (rank + 1)
    out = torch.ones(2)
    reduce_scatter_grads(packed, out, accumulate=True, algorithm=algorithm)
    triangle = world * (world + 1) / 2
    expected = 1 + torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) * triangle / world
    return torch.equal(buf, whole), torch.allclose(out, expected)


@pytest.mark.parametrize("algorithm", ["collective", "rooted"])
@pytest.mark.parametrize("world", [1, 3])
def test_bucketed_gathers_equal_the_whole_gather_and_grads_are_averaged(
    run_world, world, algorithm
):
    assert all(all(r) for r in run_world(buckets_equal_whole, world, algorithm))


def test_all_gather_params_refuses_a_buffer_of_another_size(run_world):
    (message,) = run_world(bad_buffer, 1)
    assert message == "all_gather_params: expected a buffer of 1 * 4 elements, got 5"


def bad_buffer(rank: int, world: int) -> str:
    try:
        all_gather_params(torch.zeros(5), 4)
    except ValueError as exc:
        return str(exc)
    return "no error"
