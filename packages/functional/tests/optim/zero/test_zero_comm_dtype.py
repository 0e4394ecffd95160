"""ZeroRedundancyOptimizer(partition="flat", comm_dtype=torch.bfloat16): the drop-in reduces each
rank's local gradients itself on a bfloat16 wire, each element rounded once and summed in float32
by its owner, as ``shard(..., comm_dtype=)`` does ([Note: wire dtype])."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import ZeroRedundancyOptimizer, local_gradients_hook
from shardopt.testing import count_collectives

from _functional_helpers import mlp_batch, small_mlp

BF16 = torch.bfloat16
SHAPES = [(7, 5), (5,), (13,), (6, 6)]  # flat slices cut tensors at W = 2, 3, 4


def local_grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def in_float32(rounded: list[torch.Tensor]) -> torch.Tensor:
    """The mean of bfloat16 tensors summed in float32 in their order, as one process would."""
    total = rounded[0].float()
    for x in rounded[1:]:
        total = total + x.float()
    return total / len(rounded)


def rounded_once(ranks: list[int]) -> list[torch.Tensor]:
    per = [local_grads(r) for r in ranks]
    return [in_float32([g[i].to(BF16) for g in per]) for i in range(len(SHAPES))]


def sgd_from_zero(rank: int, world: int, mesh_shape: tuple[int, int] | None) -> list[torch.Tensor]:
    """The averaged gradient, as ``-p`` after the drop-in's SGD(lr=1) from zero parameters."""
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    group = None
    if mesh_shape is not None:
        group = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    zero = ZeroRedundancyOptimizer(
        params, torch.optim.SGD, group, partition="flat", comm_dtype=BF16, lr=1.0
    )
    for p, g in zip(params, local_grads(rank), strict=True):
        p.grad = g
    zero.step()
    return [-p.detach() for p in params]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_local_gradient_element_is_rounded_once_and_summed_in_float32(run_world, world):
    expected = rounded_once(list(range(world)))
    for got in run_world(sgd_from_zero, world, None):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_a_hybrid_mesh_reduces_over_its_replicas_too(run_world):
    # shard groups {0, 1} and {2, 3}; replicas {0, 2} and {1, 3}: each shard group's average is
    # rounded once more into bfloat16 on the replicas' wire (shard's rule for hybrid meshes)
    first, second = rounded_once([0, 1]), rounded_once([2, 3])
    expected = [in_float32([a.to(BF16), b.to(BF16)]) for a, b in zip(first, second)]
    for got in run_world(sgd_from_zero, 4, (2, 2)):
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def wire_bytes(rank: int, world: int, comm_dtype: torch.dtype) -> int:
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    zero = ZeroRedundancyOptimizer(
        params, torch.optim.SGD, partition="flat", comm_dtype=comm_dtype, lr=1.0
    )
    for p, g in zip(params, local_grads(rank), strict=True):
        p.grad = g
    with count_collectives() as log:
        zero.step()
    return log.totals().reduce_scatter


def test_the_gradients_take_half_the_bytes_of_a_float32_wire(run_world):
    narrow = run_world(wire_bytes, 2, BF16)
    wide = run_world(wire_bytes, 2, torch.float32)
    for n, w in zip(narrow, wide, strict=True):
        assert n * 2 == w > 0


STEPS = 4


def ddp_training(rank: int, world: int, steps: int) -> list[torch.Tensor]:
    """AdamW through the drop-in behind DDP with ``local_gradients_hook``, under Join: rank r
    has ``steps - r`` batches."""
    model = small_mlp()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, local_gradients_hook)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="flat", comm_dtype=BF16, lr=1e-2
    )
    with Join([ddp, zero]):
        for step in range(steps - rank):
            zero.zero_grad()
            x, y = mlp_batch(step, rank)
            nn.functional.mse_loss(ddp(x), y).backward()
            zero.step()
    return [p.detach() for p in model.parameters()]


def adamw_fed_the_once_rounded_average(world: int, steps: int) -> list[torch.Tensor]:
    """torch.optim.AdamW in one process, fed at each step the rank average of the ranks'
    gradients each rounded once into bfloat16 (zeros from a rank out of batches)."""
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica = small_mlp()
    for step in range(steps):
        local = []
        for r in range(world):
            replica.load_state_dict(model.state_dict())
            replica.zero_grad()
            if step < steps - r:
                x, y = mlp_batch(step, r)
                nn.functional.mse_loss(replica(x), y).backward()
            local.append(
                [torch.zeros_like(p) if p.grad is None else p.grad for p in replica.parameters()]
            )
        for i, p in enumerate(model.parameters()):
            p.grad = in_float32([g[i].to(BF16) for g in local])
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_behind_ddp_with_the_local_hook_and_join_it_trains_like_torch_adamw_fed_the_rounded_average(
    run_world, world
):
    expected = adamw_fed_the_once_rounded_average(world, STEPS)
    for got in run_world(ddp_training, world, STEPS):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def refused(rank: int, world: int, case: str) -> str:
    kwargs = {
        "greedy": {"partition": "greedy", "comm_dtype": BF16},
        "integer": {"partition": "flat", "comm_dtype": torch.int32},
        "disagree": {"partition": "flat", "comm_dtype": BF16 if rank == 0 else None},
    }[case]
    try:
        ZeroRedundancyOptimizer(
            [torch.zeros(3, requires_grad=True)], torch.optim.SGD, lr=1.0, **kwargs
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("greedy", r"comm_dtype=torch.bfloat16 needs partition='flat'.*got partition='greedy'"),
        ("integer", r"expected comm_dtype None or a float dtype, got torch.int32"),
        ("disagree", r"comm_dtype"),
    ],
)
def test_a_bad_comm_dtype_is_refused_on_every_rank(run_world, case, message):
    for text in run_world(refused, 2, case):
        assert text.startswith("ZeroRedundancyOptimizer")
        assert re.search(message, text), text
