"""The sharded state layout: fields in flat shards at the pieces' offsets, sliceable by pieces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardopt.core import Transformation, adagrad, adam, chain, plan_partition, sgd
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.functional.engine._state import (
    FieldGranularity,
    flatten_state,
    probe_fields,
    slice_state,
)

from _functional_helpers import mlp_batch, small_mlp


def param_buffers_for(
    world: int, rank: int, strategy: str = "flat", bucket_numel: int | None = None
):
    params = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(9)]
    plan = plan_partition(params, world, strategy=strategy, align=1, bucket_numel=bucket_numel)
    return build_param_buffers(plan, params, rank)


def probes(param_buffers) -> list[torch.Tensor]:
    return [torch.zeros(2, dtype=b.dtype) for b in param_buffers.buffers]


def test_adam_fields_are_two_elementwise_moments_and_a_per_piece_count():
    param_buffers = param_buffers_for(2, 0)
    fields = probe_fields(adam(), probes(param_buffers))
    kinds = sorted((kind.value, dtypes) for kind, dtypes in fields.values())
    f32, f64 = torch.float32, torch.float64
    assert kinds == [
        ("elementwise", (f32, f64)),
        ("elementwise", (f32, f64)),
        ("per_piece", (f32, f32)),
    ]


@pytest.mark.parametrize("bucket_numel", [None, 8])  # one bucket per group; one per tensor
@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1), (3, 1)])
def test_every_field_leaf_is_a_view_at_its_piece_offset(strategy, world, rank, bucket_numel):
    """Compact shards: ``shard_numels[rank]`` elements per group, piece k at its offset."""
    param_buffers = param_buffers_for(world, rank, strategy, bucket_numel)
    tx = adagrad(initial_accumulator_value=0.5)
    shards = [param_buffers.copy_shard_out(g) for g in range(len(param_buffers.buffers))]
    pieces = param_buffers.piece_views(shards)
    inner, fields, sliceable = flatten_state(
        tx.init(pieces), param_buffers, probe_fields(tx, probes(param_buffers))
    )
    assert sliceable
    elementwise = [f for f in fields if f.granularity is FieldGranularity.ELEMENTWISE]
    assert elementwise, "adagrad's sum of squares should be elementwise"
    for f in elementwise:
        assert [b.numel() for b in f.buffers] == [
            g.shard_numels[rank] for g in param_buffers.plan.groups
        ]
        for p in param_buffers.pieces:
            assert torch.all(f.buffers[p.group][p.offset : p.offset + p.numel] == 0.5)
    count = next(f for f in fields if f.granularity is FieldGranularity.PER_PIECE)
    n_per_group = [
        sum(p.group == g for p in param_buffers.pieces) for g in range(len(param_buffers.buffers))
    ]
    assert [b.numel() for b in count.buffers] == n_per_group
    # the leaves are the views: writing a leaf writes the buffer
    leaves = [x for x in torch.utils._pytree.tree_leaves(inner) if x.dim() == 1]
    for leaf in leaves:
        leaf.fill_(3.0)
    assert all(
        torch.all(f.buffers[p.group][p.offset : p.offset + p.numel] == 3.0)
        for f in elementwise
        for p in param_buffers.pieces
    )


def test_slices_share_the_tensors_of_the_whole_state():
    param_buffers = param_buffers_for(1, 0)
    tx = sgd(0.1, momentum=0.9)
    shards = [param_buffers.copy_shard_out(g) for g in range(len(param_buffers.buffers))]
    inner, _, _ = flatten_state(
        tx.init(param_buffers.piece_views(shards)),
        param_buffers,
        probe_fields(tx, probes(param_buffers)),
    )
    whole = torch.utils._pytree.tree_leaves(inner)
    part = torch.utils._pytree.tree_leaves(slice_state(inner, len(param_buffers.pieces), 1, 2))
    assert part
    assert all(any(x is y for y in whole) for x in part)


def test_a_global_state_tensor_makes_the_state_unsliceable():
    def init(params):
        return (adam().init(params), torch.zeros(()))

    tx = Transformation(init, adam().update)
    param_buffers = param_buffers_for(1, 0)
    shards = [param_buffers.copy_shard_out(g) for g in range(len(param_buffers.buffers))]
    _, _, sliceable = flatten_state(
        tx.init(param_buffers.piece_views(shards)),
        param_buffers,
        probe_fields(tx, probes(param_buffers)),
    )
    assert not sliceable


def test_chained_states_have_paths_that_name_their_place():
    param_buffers = param_buffers_for(2, 0)
    tx = chain(sgd(0.1, momentum=0.9), adam())
    paths = sorted(probe_fields(tx, probes(param_buffers)))
    assert all(p.startswith(("[0]", "[1]")) for p in paths)


# bfloat16 optimizer state under shard (core's with_state_dtype): half the bytes, same training.
STATE_STEPS = 12


def train_steps(model: Any, step: Callable[[], None]) -> None:
    """STATE_STEPS steps of ``step`` after a backward on :func:`mlp_batch`'s batch of rank 0 (the
    same on every rank: equal gradients)."""
    for i in range(STATE_STEPS):
        x, y = mlp_batch(i, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()
        model.zero_grad()


def bf16_state_run(rank: int, world: int, stage: int, state_dtype: torch.dtype | None) -> tuple:
    """The parameters after the steps, the moments' bytes and their dtypes."""
    from shardopt.core import adamw, with_state_dtype
    from shardopt.functional import register_grad_hooks, shard

    model = small_mlp()
    params = list(model.parameters())
    tx = adamw(lr=0.01) if state_dtype is None else with_state_dtype(adamw(lr=0.01), state_dtype)
    sharded = shard(tx, plan_partition(params, world, bucket_numel=64), stage=stage)
    held = [sharded.init(params)]
    if stage == 2:
        register_grad_hooks(params, held[0])

    def step() -> None:
        held[0] = sharded.step(params, None, held[0])

    train_steps(model, step)
    moments = [f for f in held[0].fields if f.granularity is FieldGranularity.ELEMENTWISE]
    dtypes = {b.dtype for f in moments for b in f.buffers}
    nbytes = sum(b.nbytes for f in moments for b in f.buffers)
    return [p.detach().clone() for p in params], nbytes, dtypes


def torch_adamw_rounded(dtype: torch.dtype) -> list[torch.Tensor]:
    """torch.optim.AdamW on one process, its moments rounded to ``dtype`` after every step."""
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step() -> None:
        opt.step()
        for s in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                s[key].copy_(s[key].to(dtype))

    train_steps(model, step)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(("world", "stage"), [(1, 1), (2, 1), (2, 2), (3, 2), (4, 1), (4, 2)])
def test_bfloat16_state_holds_half_the_bytes_and_trains_as_torch_with_rounded_state(
    run_world, world, stage
):
    expected = torch_adamw_rounded(torch.bfloat16)
    narrow = run_world(bf16_state_run, world, stage, torch.bfloat16)
    wide = run_world(bf16_state_run, world, stage, None)
    for (params, nbytes, dtypes), (_, wide_bytes, wide_dtypes) in zip(narrow, wide):
        assert dtypes == {torch.bfloat16}
        assert wide_dtypes == {torch.float32}
        assert 2 * nbytes == wide_bytes
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-4, atol=1e-5)


def labelled(rank: int, world: int, rule: str) -> Any:
    """A partition over a flat plan that cuts a 10-element tensor 8 + 2 between two ranks."""
    from shardopt.core import partition
    from shardopt.functional import shard

    params = [torch.zeros(10), torch.zeros(6)]
    by = {
        "dim": lambda ps: ["a" if p.dim() == 1 else "b" for p in ps],
        "numel": lambda ps: ["a" if p.numel() > 4 else "b" for p in ps],
    }[rule]
    tx = partition({"a": sgd(0.1), "b": adam(0.1)}, by)
    try:
        state = shard(tx, plan_partition(params, world, align=1)).init(params)
    except ValueError as exc:
        return str(exc)
    assert state.labels is not None
    return state.labels.of_tensor, sorted(state.labels.fields["b"])


def test_a_partition_records_every_tensors_label_on_every_rank(run_world):
    for labels, fields in run_world(labelled, 2, "dim"):
        assert labels == ("a", "a")
        assert fields == ["[0].count", "[0].mu", "[0].nu"]


def test_the_pieces_of_a_cut_tensor_take_its_whole_tensors_label(run_world):
    # numel > 4 of the pieces (8 and 2 elements) would split tensor 0 between "a" and "b";
    # labels are resolved on the whole tensors (10 and 6 elements), so both are "a"
    for labels, fields in run_world(labelled, 2, "numel"):
        assert labels == ("a", "a")
        assert fields == ["[0].count", "[0].mu", "[0].nu"]
