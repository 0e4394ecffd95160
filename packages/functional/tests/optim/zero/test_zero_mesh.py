"""ZeroRedundancyOptimizer over a device mesh: a 1-D mesh is its group; a 2-D ("replicate",
"shard") mesh shards the state over "shard", and behind DDP it matches one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import ZeroRedundancyOptimizer

from _functional_helpers import (
    dtensor_type,
    full_batch_adamw,
    full_tensors,
    mlp_batch,
    small_mlp,
    tensor_parallel_mlp,
)

DTensor = dtensor_type()
STEPS = 10


def train(rank: int, world: int, kind: str, partition: str) -> tuple[list[torch.Tensor], int, int]:
    """(final parameters, elements of this rank's optimizer state, the model's elements)."""
    if kind == "1d":
        mesh: Any = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = small_mlp()
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, process_group=mesh, partition=partition, lr=1e-2
    )
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    held = sum(
        t.numel() for entry in opt.optim.state.values() for key, t in entry.items() if key != "step"
    )
    return (
        [p.detach() for p in model.parameters()],
        held,
        sum(p.numel() for p in model.parameters()),
    )


@pytest.mark.parametrize(("kind", "partition"), [("2d", "greedy"), ("2d", "flat"), ("1d", "flat")])
def test_the_drop_in_over_a_mesh_matches_one_process_and_holds_its_share(
    run_world, kind, partition
):
    expected = full_batch_adamw(4, STEPS)
    results = run_world(train, 4, kind, partition)
    for params, _, _ in results:
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
    held, total = [h for _, h, _ in results], results[0][2]
    replicas = [held] if kind == "1d" else [held[:2], held[2:]]
    assert all(sum(r) == 2 * total for r in replicas), (held, total)
    assert all(h > 0 for h in held)


def train_tensor_parallel(rank: int, world: int, partition: str, views: bool) -> list[torch.Tensor]:
    """(dp=2, tp=2): the first two layers tensor-parallel over "tp", DDP and the drop-in over
    "dp"; the full parameters after STEPS steps."""
    mesh, model = tensor_parallel_mlp()
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        process_group=mesh["dp"],
        partition=partition,
        parameters_as_bucket_view=views,
        lr=1e-2,
    )
    dp_group = mesh.get_group("dp")
    for step in range(STEPS):
        x, y = mlp_batch(step, mesh.get_local_rank("dp"))
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # what DDP over "dp" does
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.distributed.all_reduce(local, group=dp_group)
            local.div_(2)
        opt.step()
        opt.zero_grad()
    return full_tensors(model.parameters())


@pytest.mark.parametrize(
    ("partition", "views"), [("greedy", False), ("greedy", True), ("flat", False)]
)
def test_the_drop_in_over_dp_with_tensor_parallel_dtensors_matches_one_process(
    run_world, partition, views
):
    expected = full_batch_adamw(2, STEPS)
    for params in run_world(train_tensor_parallel, 4, partition, views):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
