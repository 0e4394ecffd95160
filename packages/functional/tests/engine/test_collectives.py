"""The collectives: bucketed gathers equal whole ones, and the bytes every step moves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.core import Bucket, adam, plan_partition
from shardopt.functional import (
    all_gather_bucket,
    reduce_scatter_bucket,
    register_grad_hooks,
    shard,
)
from shardopt.testing import CollectiveCall, count_collectives

from _functional_helpers import GATHER, SCATTER

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
SHAPES = [((7, 5), F32), ((5,), BF16), ((3, 4, 2), F64), ((13,), F32), ((6, 6), BF16)]


def traffic(calls: list[CollectiveCall], rank: int, world: int) -> tuple[int, int, set[str]]:
    """(bytes this rank sends into gradient reductions, bytes it receives from parameter syncs,
    the names called), counted as the payload of the collective's semantics: a ring
    reduce-scatter or all-gather moves (W-1)/W of its buffer per rank, and so does an all-to-all
    of equal blocks; a reduce to rank d takes the block of every other rank, a broadcast from
    rank s gives its block to every other rank."""
    sent = received = 0
    for c in calls:
        if c.name in (SCATTER, "all_to_all_single"):
            sent += c.second * (world - 1) // world
        elif c.name == GATHER:
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


def expected_traffic(plan: Any, rank: int, algorithm: str) -> tuple[int, set[str]]:
    """(bytes of one sync of every bucket less this rank's own shard, the calls it needs): a
    bucket is reduced and gathered by the algorithm's calls only where its shards are equal
    (greedy shards may not be), else by a reduce and a broadcast per owner."""
    moved, names = 0, set()
    for g in plan.groups:
        size = getattr(torch, g.dtype).itemsize
        for bucket in g.buckets:
            moved += (bucket.numel - bucket.shards[rank]) * size
            if plan.world_size > 1 and bucket.numel:
                names |= NAMES[algorithm if bucket.uniform else "unequal"]
    return moved, names


def step_traffic(
    rank: int,
    world: int,
    stage: int,
    grads_averaged: bool,
    strategy: str,
    hooked: bool,
    bucket: int | None,
    algorithm: str,
) -> tuple[int, int, set[str], int, set[str]]:
    """What two steps move: (sent, received, names) of :func:`traffic`, and the bytes and
    names :func:`expected_traffic` predicts for one sync."""
    params = [p.requires_grad_(True) for p in make_params()]
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(
        adam(1e-3), plan, stage=stage, grads_averaged=grads_averaged, algorithm=algorithm
    )
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
    return (*traffic(counted.calls, rank, world), *expected_traffic(plan, rank, algorithm))


NAMES = {
    "collective": {SCATTER, GATHER},
    "exchange": {"all_to_all_single", "broadcast"},
    "unequal": {"reduce", "broadcast"},
}


@pytest.mark.parametrize(
    ("world", "stage", "strategy", "hooked", "bucket", "algorithm"),
    [
        (2, 2, "flat", False, None, "collective"),
        (3, 2, "greedy", False, 24, "collective"),  # unequal greedy shards: per-owner calls too
        (4, 2, "flat", True, 64, "collective"),
        (3, 2, "flat", True, None, "exchange"),
        (4, 2, "greedy", False, 32, "exchange"),
        (3, 1, "flat", False, 16, "collective"),  # stage 1 averages local gradients too
        (2, 1, "greedy", True, None, "exchange"),
    ],
)
def test_each_step_moves_every_bucket_less_the_own_shard_of_gradients_and_params_only(
    run_world, world, stage, strategy, hooked, bucket, algorithm
):
    """A reduction and a gather per step: (W-1)/W of the buffers, padding included, for equal
    shards; everything but the rank's own shard in general."""
    for sent, received, names, moved, expected in run_world(
        step_traffic, world, stage, False, strategy, hooked, bucket, algorithm
    ):
        assert names == expected
        assert sent == 2 * moved  # two steps of gradients
        assert received == 2 * moved  # two steps of parameters


@pytest.mark.parametrize("algorithm", ["collective", "exchange"])
def test_stage1_with_averaged_gradients_moves_only_the_parameter_sync(run_world, algorithm):
    for sent, received, names, moved, expected in run_world(
        step_traffic, 3, 1, True, "flat", False, 16, algorithm
    ):
        assert names == expected - {"reduce", SCATTER, "all_to_all_single"}
        assert sent == 0
        assert received == 2 * moved


def overlap(rank: int, world: int) -> tuple[int, int]:
    """(reductions launched before the last gradient arrived, reductions in backward)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(6)]
    params = [p for layer in layers for p in layer.parameters()]
    sharded = shard(adam(), plan_partition(params, world, bucket_numel=8), stage=2)
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


def buckets_gather_and_average(rank: int, world: int, algorithm: str) -> tuple[bool, bool]:
    """Each bucket gathered in place gives every rank every shard, equal shards or not;
    reduce_scatter_bucket averages a bucket into the rank's shard and accumulates."""
    buckets = [Bucket(0, (7,) * world), Bucket(7 * world, tuple(range(1, world + 1)))]
    total = buckets[-1].stop
    whole = torch.arange(total, dtype=torch.float32)
    buf = torch.full((total,), -1.0)
    for bucket in buckets:
        lo = bucket.shard_start(rank)
        buf[lo : lo + bucket.shards[rank]] = whole[lo : lo + bucket.shards[rank]]
    for bucket in buckets:
        all_gather_bucket(buf, bucket, algorithm=algorithm).wait()
    averaged = True
    for bucket in buckets:
        staging = torch.arange(bucket.numel, dtype=torch.float32) * (rank + 1)
        out = torch.ones(bucket.shards[rank])
        scratch = torch.full((bucket.numel + 3,), float("nan"))  # larger than needed: a prefix
        reduce_scatter_bucket(
            staging, bucket, out, accumulate=True, algorithm=algorithm, scratch=scratch
        ).wait()
        lo = bucket.shard_start(rank) - bucket.start
        base = torch.arange(lo, lo + bucket.shards[rank], dtype=torch.float32)
        triangle = world * (world + 1) / 2
        averaged = averaged and torch.allclose(out, 1 + base * triangle / world)
    return torch.equal(buf, whole), averaged


@pytest.mark.parametrize("algorithm", ["collective", "exchange"])
@pytest.mark.parametrize("world", [1, 3])
def test_bucket_gathers_fill_every_shard_and_bucket_reductions_average(run_world, world, algorithm):
    assert all(all(r) for r in run_world(buckets_gather_and_average, world, algorithm))


def test_bucket_collectives_refuse_buffers_of_another_size(run_world):
    (messages,) = run_world(bad_buffers, 1)
    assert messages == [
        "all_gather_bucket: expected a 1-D buffer of at least 8 elements and a bucket of 1 "
        "shards, got (5,) and 1 shards",
        "reduce_scatter_bucket: expected staging of 8 and output of 8 elements, got 5 and 8",
    ]


def test_exchange_refuses_a_scratch_smaller_than_the_bucket(run_world):
    for message in run_world(bad_scratch, 2):
        assert message == (
            "reduce_scatter_bucket: expected a scratch of at least 8 torch.float32 elements, "
            "got 7 torch.float32"
        )


def bad_scratch(rank: int, world: int) -> str:
    bucket = Bucket(0, (4, 4))
    try:
        reduce_scatter_bucket(
            torch.zeros(8), bucket, torch.zeros(4), algorithm="exchange", scratch=torch.zeros(7)
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def bad_buffers(rank: int, world: int) -> list[str]:
    out = []
    for call in (
        lambda: all_gather_bucket(torch.zeros(5), Bucket(0, (8,))),
        lambda: reduce_scatter_bucket(torch.zeros(5), Bucket(0, (8,)), torch.zeros(8)),
    ):
        try:
            call()
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append("no error")
    return out
