"""Flat storage: parameters become views of one buffer per group, cut into buckets whose
shards the ranks own; compact shards put a rank's shards of a group end to end."""

from __future__ import annotations

import pytest
import torch

from shardopt.core import plan_partition
from shardopt.functional import Algorithm
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.functional.engine._staging import staging_numel


def mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 4),
        torch.randn(5, dtype=torch.float64),
        torch.randn(7),
        torch.randn(2, 2, dtype=torch.float64),
    ]


@pytest.mark.parametrize("bucket_numel", [None, 6])
@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_params_become_views_of_one_buffer_per_group_with_their_values(
    strategy, world, rank, bucket_numel
):
    params = mixed()
    values = [p.clone() for p in params]
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket_numel)
    param_buffers = build_param_buffers(plan, params, rank)
    assert [b.dtype for b in param_buffers.buffers] == [torch.float32, torch.float64]
    for g, group in enumerate(plan.groups):
        for t, offset in zip(group.tensors, group.offsets):
            view = param_buffers.buffers[g][offset : offset + params[t].numel()]
            assert params[t].data_ptr() == view.data_ptr()
            assert torch.equal(params[t], values[t])
    assert param_buffers.check_views(params) is None


def test_a_param_moved_out_of_its_buffer_is_reported():
    params = mixed()
    param_buffers = build_param_buffers(plan_partition(params, 2), params, 0)
    params[2].data = params[2].data.clone()
    assert param_buffers.check_views(params) == (
        "the parameters given to init (views of the flat buffers), got params[2] elsewhere"
    )


@pytest.mark.parametrize(("strategy", "reported"), [("greedy", True), ("flat", False)])
def test_a_param_reshaped_at_its_place_is_reported_only_where_the_plan_owns_it_whole(
    strategy, reported
):
    """[Note: views still in place]: a greedy plan's updates may read a tensor in its shape, a
    flat plan's are elementwise over the buffer, where the address is all that matters."""
    params = mixed()
    param_buffers = build_param_buffers(plan_partition(params, 2, strategy=strategy), params, 0)
    params[0].data = params[0].data.view(4, 3)  # the same elements, at the same place
    expected = "the parameters given to init (views of the flat buffers), got params[0] elsewhere"
    assert param_buffers.check_views(params) == (expected if reported else None)


@pytest.mark.parametrize("bucket_numel", [None, 6])
@pytest.mark.parametrize("strategy", ["flat", "greedy"])
def test_gradient_and_piece_views_alias_the_right_elements(strategy, bucket_numel):
    params = mixed()
    plan = plan_partition(params, 2, strategy=strategy, align=1, bucket_numel=bucket_numel)
    param_buffers = build_param_buffers(plan, params, 1)
    grads = [torch.arange(p.numel(), dtype=p.dtype).view(p.shape) for p in params]
    shards = [param_buffers.copy_shard_out(g) for g in range(len(plan.groups))]
    for piece, gv, pv in zip(
        param_buffers.pieces, param_buffers.grad_views(grads), param_buffers.piece_views(shards)
    ):
        expected = torch.arange(piece.start, piece.stop, dtype=gv.dtype)  # type: ignore[union-attr]
        assert torch.equal(gv, expected)  # type: ignore[arg-type]
        assert torch.equal(pv, params[piece.tensor].view(-1)[piece.start : piece.stop])


def many() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n) for n in (5, 3, 8, 2, 7, 1, 4)] + [torch.randn(6, dtype=torch.float64)]


@pytest.mark.parametrize("bucket_numel", [None, 1, 8, 1 << 24])
@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_tensor_is_in_one_bucket_and_each_rank_owns_one_shard_of_each(
    world, strategy, bucket_numel
):
    """Buckets are runs of whole tensors; rank r's shard of bucket k is the buffer's
    ``[shard_start(r), + shards[r])``; its compact shard is its bucket shards end to end."""
    plan = plan_partition(many(), world, strategy=strategy, bucket_numel=bucket_numel)
    for rank in range(world):
        params = many()
        param_buffers = build_param_buffers(plan, params, rank)
        assert sorted(
            t for k in param_buffers.keys for t in param_buffers.bucket_tensors[k]
        ) == list(range(len(params)))
        for key in param_buffers.keys:
            bucket = param_buffers.bucket(key)
            for t in param_buffers.bucket_tensors[key]:
                g, _, offset = plan.locate(t)
                assert g == key[0]
                assert bucket.start <= offset
                assert offset + params[t].numel() <= bucket.stop
            shard = param_buffers.bucket_shard(key)
            assert shard.numel() == bucket.shards[rank]
            base = param_buffers.buffers[key[0]].data_ptr()
            size = param_buffers.buffers[key[0]].element_size()
            assert shard.numel() == 0 or shard.data_ptr() == base + bucket.shard_start(rank) * size
        shards = [param_buffers.copy_shard_out(g) for g in range(len(plan.groups))]
        assert [s.numel() for s in shards] == [g.shard_numels[rank] for g in plan.groups]
        for key in param_buffers.keys:
            assert torch.equal(param_buffers.compact(shards, key), param_buffers.bucket_shard(key))
        # every piece sits at its offset of the compact shard, and writes back in place
        for piece, view in zip(param_buffers.pieces, param_buffers.piece_views(shards)):
            assert torch.equal(view, params[piece.tensor].view(-1)[piece.start : piece.stop])
        for g, shard in enumerate(shards):
            param_buffers.copy_shard_in(g, shard + 1)
        for piece in param_buffers.pieces:
            want = many()[piece.tensor].view(-1)[piece.start : piece.stop] + 1
            assert torch.equal(params[piece.tensor].view(-1)[piece.start : piece.stop], want)


@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize("world", [2, 7, 64, 1024])
def test_gradient_staging_holds_two_of_the_largest_buckets_whatever_the_world_size(world, strategy):
    """Staging is two buckets (one for a single-bucket group), and a bucket is bounded by
    bucket_numel plus its last tensor and the flat plan's padding: it does not grow with W."""
    bucket = 1 << 14
    specs = [((1000,), "float32")] * 100
    plan = plan_partition(specs, world, strategy=strategy, bucket_numel=bucket)
    largest = max(b.numel for b in plan.groups[0].buckets)
    assert staging_numel(plan, 0) == 2 * largest
    pad = world * plan.align - 1 if strategy == "flat" else 0
    assert largest <= bucket + 1000 + pad
    single = plan_partition(specs, world, strategy=strategy, bucket_numel=None)
    assert staging_numel(single, 0) == single.groups[0].numel
    # the exchange's all-to-all receives into a scratch of the bucket's size, equal shards only
    with_scratch = max(b.numel * (1 + b.uniform) for b in plan.groups[0].buckets)
    assert staging_numel(plan, 0, Algorithm.EXCHANGE) == 2 * with_scratch
    if strategy == "flat":
        assert with_scratch == 2 * largest
