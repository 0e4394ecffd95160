"""Flat storage: parameters become views of one buffer per group; chunks cover every slice."""

from __future__ import annotations

import pytest
import torch

from shardopt.core import plan_partition
from shardopt.functional._layout import build_layout, make_chunks


def mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 4),
        torch.randn(5, dtype=torch.float64),
        torch.randn(7),
        torch.randn(2, 2, dtype=torch.float64),
    ]


@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_params_become_views_of_one_buffer_per_group_with_their_values(strategy, world, rank):
    params = mixed()
    values = [p.clone() for p in params]
    plan = plan_partition(params, world, strategy=strategy)
    layout = build_layout(plan, params, rank, None)
    assert [b.dtype for b in layout.buffers] == [torch.float32, torch.float64]
    for g, group in enumerate(plan.groups):
        for t, offset in zip(group.tensors, group.offsets):
            view = layout.buffers[g][offset : offset + params[t].numel()]
            assert params[t].data_ptr() == view.data_ptr()
            assert torch.equal(params[t], values[t])
    assert layout.check_views(params) is None


def test_a_param_moved_out_of_its_buffer_is_reported():
    params = mixed()
    layout = build_layout(plan_partition(params, 2), params, 0, None)
    params[2].data = params[2].data.clone()
    assert layout.check_views(params) == (
        "the parameters given to init (views of the flat buffers), got params[2] elsewhere"
    )


def test_gradient_and_piece_views_alias_the_right_elements():
    params = mixed()
    plan = plan_partition(params, 2, strategy="flat", align=1)
    layout = build_layout(plan, params, 1, None)
    grads = [torch.arange(p.numel(), dtype=p.dtype).view(p.shape) for p in params]
    shards = [layout.shard(g) for g in range(len(plan.groups))]
    for piece, gv, pv in zip(layout.pieces, layout.grad_views(grads), layout.piece_views(shards)):
        expected = torch.arange(piece.start, piece.stop, dtype=gv.dtype)  # type: ignore[union-attr]
        assert torch.equal(gv, expected)  # type: ignore[arg-type]
        assert torch.equal(pv, params[piece.tensor].view(-1)[piece.start : piece.stop])


@pytest.mark.parametrize(
    ("bucket", "expected"), [(None, [(0, 6)]), (12, [(0, 6)]), (8, [(0, 4), (4, 6)])]
)
def test_chunks_split_each_slice_into_buckets(bucket, expected):
    """bucket_numel counts all ranks: the 12-element buffer fits 12, and 8 is 4 per rank."""
    plan = plan_partition([((11,), "float32"), ((3,), "float64")], 2, align=1)
    chunks = make_chunks(plan, bucket)
    assert [(c.start, c.stop) for c in chunks if c.group == 0] == expected
    assert [(c.start, c.stop) for c in chunks if c.group == 1] == [(0, 2)]


@pytest.mark.parametrize(
    ("world", "align", "bucket", "width"),
    [
        (2, 1, 40, 20),  # bucket_numel // W
        (3, 1, 40, 13),
        (3, 16, 200, 64),  # 66 rounded down to the align
        (7, 16, 1000, 128),  # 142: chunks stay aligned at any W
        (64, 16, 100, 16),  # less than one align per rank: one align
    ],
)
def test_chunks_hold_bucket_numel_over_w_elements_per_rank_aligned_as_the_plan(
    world, align, bucket, width
):
    plan = plan_partition([((100_000,), "float32")], world, align=align)
    chunks = make_chunks(plan, bucket)
    assert {c.numel for c in chunks[:-1]} == {width}
    assert all(c.start % align == 0 for c in chunks)
    assert chunks[-1].stop == plan.groups[0].shard_numel


@pytest.mark.parametrize("world", [2, 7, 64, 1024])
def test_staging_is_bounded_by_bucket_numel_at_any_world_size(world):
    """Two buffers of W chunks: at most 2 * bucket_numel elements, however many ranks (a
    per-rank bucket would make them 2 * W * bucket, growing with W)."""
    bucket = 1 << 15  # at least W * align, so every chunk holds bucket_numel // W elements
    params = [torch.zeros(200_000)]
    plan = plan_partition(params, world)
    layout = build_layout(plan, params, 0, bucket, needs_staging=lambda device, split: True)
    staging = layout.staging[0]
    assert staging is not None
    assert len(layout.chunks) > 1
    assert staging.numel() <= 2 * bucket


def test_staging_exists_only_where_a_collective_cannot_be_in_place():
    params = [torch.zeros(40), torch.zeros(4, dtype=torch.float64)]
    plan = plan_partition(params, 2, align=1)
    layout = build_layout(plan, params, 0, 16)
    assert layout.staging[0] is not None
    assert layout.staging[0].shape == (2, 16)  # two in turn: chunks of 8 per rank
    assert layout.staging[1] is None  # one chunk: gathered in place
    again = [torch.zeros(40), torch.zeros(4, dtype=torch.float64)]
    staged = build_layout(plan, again, 0, 16, needs_staging=lambda device, split: True)
    assert staged.staging[1] is not None
    assert staged.staging[1].shape == (1, 4)  # one chunk: a single buffer, W * shard_numel
