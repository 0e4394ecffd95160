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

from _functional_helpers import full_batch_adamw, mlp_batch, small_mlp

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
