"""Gradient shards ([Note: gradient shards]): compact, in the reduce dtype, filled bucket by
bucket in reverse order as each bucket and every later one are ready; the reducer launches."""

from __future__ import annotations

import pytest
import torch

from shardopt.core import plan_partition
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.functional.engine._reduction import GradShards


def test_gradient_shards_are_compact_and_in_the_reduce_dtype():
    params = [torch.randn(10, dtype=torch.bfloat16), torch.randn(3)]
    plan = plan_partition(params, 2, strategy="greedy", bucket_numel=4)
    plain = GradShards(build_param_buffers(plan, [p.clone() for p in params], 1)).shards
    assert [s.dtype for s in plain] == [torch.bfloat16, torch.float32]
    shards = GradShards(build_param_buffers(plan, params, 1, reduce_dtype=torch.float32)).shards
    assert [s.dtype for s in shards] == [torch.float32, torch.float32]
    assert [s.numel() for s in shards] == [g.shard_numels[1] for g in plan.groups]


def six_buckets_of_two(rank: int) -> tuple[GradShards, list[torch.Tensor]]:
    params = [torch.zeros(4) for _ in range(6)]
    plan = plan_partition(params, 2, strategy="flat", bucket_numel=8)
    grads = GradShards(build_param_buffers(plan, params, rank))
    assert len(grads.param_buffers.keys) == 3
    return grads, [torch.full((4,), float(t + rank)) for t in range(6)]


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_bucket_is_ready_once_its_gradients_and_every_later_bucket_are_and_shards_average(
    world,
):
    """Buckets become ready in reverse order, each once all its trainable tensors reported and
    every later bucket is ready; launched, the shards get the average."""
    grads, local = six_buckets_of_two(world.rank)
    param_buffers, keys = grads.param_buffers, grads.param_buffers.keys
    launched: list = []

    def ready(t):
        for key in grads.mark_ready(t):
            grads.start_reduce(key, local, accumulate=False)
            launched.append(key)

    first, middle, last = (param_buffers.bucket_tensors[k] for k in keys)
    grads.expect([True] * 6)
    for t in first:
        ready(t)
    assert launched == []  # ready, but the later buckets are not
    ready(last[0])
    assert launched == []
    ready(last[1])
    assert launched == [keys[2]]
    for t in middle:
        ready(t)
    assert launched == [keys[2], keys[1], keys[0]]  # the first bucket follows at once
    assert grads.unstarted() == []
    grads.finish_reduce()
    assert not grads.pending
    expected = torch.cat([torch.full((4,), t + 0.5) for t in range(6)])
    for p, shard in zip(param_buffers.pieces, param_buffers.piece_views(grads.shards)):
        start = p.tensor * 4 + p.start
        assert torch.equal(shard, expected[start : start + p.numel])


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_bucket_does_not_wait_for_a_frozen_tensor_and_the_rest_are_unstarted_at_the_end(world):
    grads, local = six_buckets_of_two(world.rank)
    keys = grads.param_buffers.keys
    frozen = grads.param_buffers.bucket_tensors[keys[2]][0]
    grads.expect([t != frozen for t in range(6)])
    ready = grads.mark_ready(grads.param_buffers.bucket_tensors[keys[2]][1])
    assert ready == [keys[2]]  # its frozen tensor is not waited for
    assert grads.unstarted() == [keys[1], keys[0]]
    assert grads.unstarted() == []  # counted as launched
    for key in [*ready, keys[1], keys[0]]:
        grads.start_reduce(key, local, accumulate=False)
    grads.finish_reduce()
