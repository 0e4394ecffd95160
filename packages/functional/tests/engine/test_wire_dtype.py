"""Gradients on a bfloat16 wire, summed in float32 ([Note: wire dtype]): each element is rounded
once into bfloat16, and the owner's sum of the W copies equals one process's float32 sum of the
rounded gradients, bit for bit, at half the bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardopt.core import plan_partition, sgd
from shardopt.functional import register_grad_hooks, shard
from shardopt.testing import count_collectives

from _functional_helpers import mlp_batch, small_mlp

SHAPES = [(7, 5), (5,), (13,), (6, 6)]
BF16 = torch.bfloat16
STEPS = 5


def local_grads(rank: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def in_float32(rounded: list[torch.Tensor]) -> torch.Tensor:
    """The mean of bfloat16 tensors summed in float32 in their order, as one process would."""
    total = rounded[0].float()
    for x in rounded[1:]:
        total = total + x.float()
    return total / len(rounded)


def rounded_once(ranks: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The rank average of the ranks' gradients each rounded once into bfloat16, summed in
    float32 in rank order."""
    per = [local_grads(r, dtype) for r in ranks]
    return [in_float32([g[i].to(BF16) for g in per]) for i in range(len(SHAPES))]


def averaged(
    rank: int, world: int, strategy: str, algorithm: str, stage: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The averaged gradient shard's values, as ``-p`` after SGD(lr=1) from zero parameters."""
    params = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=40)
    sharded = shard(sgd(1.0), plan, stage=stage, algorithm=algorithm, comm_dtype=BF16)
    sharded.step(params, local_grads(rank, dtype), sharded.init(params))
    return [-p for p in params]


@pytest.mark.parametrize(
    ("world", "strategy", "algorithm", "stage"),
    [
        (1, "flat", "auto", 1),
        (2, "flat", "collective", 1),
        (3, "greedy", "exchange", 2),  # buckets of unequal shards
        (3, "flat", "collective", 2),
        (4, "flat", "exchange", 2),
    ],
)
def test_each_gradient_element_is_rounded_once_and_summed_in_float32(
    run_world, world, strategy, algorithm, stage
):
    expected = rounded_once(list(range(world)))
    for got in run_world(averaged, world, strategy, algorithm, stage, torch.float32):
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == torch.float32
            assert torch.equal(g, e)


def test_a_bfloat16_model_sums_in_float32_and_keeps_bfloat16_shards(run_world):
    expected = [e.to(BF16) for e in rounded_once([0, 1, 2], BF16)]
    for got in run_world(averaged, 3, "flat", "auto", 2, BF16):
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == BF16
            assert torch.equal(g, e)


def wire_bytes(rank: int, world: int, comm: torch.dtype | None) -> tuple[int, list[str]]:
    params = [torch.zeros(s) for s in SHAPES]
    sharded = shard(sgd(1.0), plan_partition(params, world), stage=2, comm_dtype=comm)
    state = sharded.init(params)
    with count_collectives() as log:
        sharded.step(params, local_grads(rank), state)
    reductions = [c.name for c in log.calls if c.name not in ("all_gather_single", "broadcast")]
    return log.totals().reduce_scatter, reductions


def test_gradients_on_the_wire_take_half_the_bytes_of_float32_in_one_all_to_all(run_world):
    narrow = run_world(wire_bytes, 2, BF16)
    wide = run_world(wire_bytes, 2, None)
    for (n, calls), (w, _) in zip(narrow, wide, strict=True):
        assert n * 2 == w > 0
        assert calls == ["all_to_all_single"]


def hybrid(rank: int, world: int) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    params = [torch.zeros(s) for s in SHAPES]
    sharded = shard(
        sgd(1.0), plan_partition(params, 2), process_group=mesh, stage=2, comm_dtype=BF16
    )
    sharded.step(params, local_grads(rank), sharded.init(params))
    return [-p for p in params]


def test_a_hybrid_mesh_rounds_once_per_level_and_sums_in_float32(run_world):
    # shard groups {0, 1} and {2, 3}; replicas {0, 2} and {1, 3}: each replica's average is
    # rounded once more into bfloat16 on the replicas' wire
    first, second = rounded_once([0, 1]), rounded_once([2, 3])
    expected = [in_float32([a.to(BF16), b.to(BF16)]) for a, b in zip(first, second)]
    for got in run_world(hybrid, 4):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def accumulated(rank: int, world: int) -> list[torch.Tensor]:
    """Two micro-steps through stage 2's gradient hooks, then one SGD(lr=1) step."""
    model = small_mlp()
    params = list(model.parameters())
    sharded = shard(sgd(1.0), plan_partition(params, world), stage=2, comm_dtype=BF16)
    state = sharded.init(params)
    register_grad_hooks(params, state)
    for micro in range(2):
        x, y = mlp_batch(micro, rank)
        nn.functional.mse_loss(model(x), y).backward()
    sharded.step(params, None, state)
    return [p.detach() for p in params]


def micro_grads(micro: int, rank: int) -> list[torch.Tensor]:
    model = small_mlp()
    x, y = mlp_batch(micro, rank)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_gradient_hooks_round_each_micro_steps_gradient_once_and_accumulate_in_float32(
    run_world,
):
    world = 3
    start = [p.detach() for p in small_mlp().parameters()]
    per = [[micro_grads(m, r) for r in range(world)] for m in range(2)]
    expected = []
    for i, p in enumerate(start):
        avg = [in_float32([per[m][r][i].to(BF16) for r in range(world)]) for m in range(2)]
        expected.append(p - (avg[0] + avg[1]))
    for got in run_world(accumulated, world):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_comm_dtype_with_averaged_gradients_is_refused():
    with pytest.raises(ValueError, match=r"^shard: expected comm_dtype=None with grads_averaged"):
        shard(sgd(1.0), plan_partition([torch.zeros(2)], 1), grads_averaged=True, comm_dtype=BF16)


def wire_training(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    from shardopt.core import adamw

    model = small_mlp()
    params = list(model.parameters())
    sharded = shard(adamw(1e-2), plan_partition(params, world), stage=stage, comm_dtype=BF16)
    state = sharded.init(params)
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


@pytest.mark.parametrize(("world", "stage"), [(2, 1), (3, 2)])
def test_training_on_the_wire_matches_torch_adamw_fed_the_once_rounded_average(
    run_world, world, stage
):
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replicas = [small_mlp() for _ in range(world)]  # each rank's model, to get its gradients
    for step in range(STEPS):
        local = []
        for r, m in enumerate(replicas):
            m.load_state_dict(model.state_dict())
            m.zero_grad()
            x, y = mlp_batch(step, r)
            nn.functional.mse_loss(m(x), y).backward()
            local.append([p.grad for p in m.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = in_float32([g[i].to(BF16) for g in local])
        opt.step()
    for params in run_world(wire_training, world, stage):
        for p, e in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(p, e.detach(), rtol=1e-5, atol=1e-6)
