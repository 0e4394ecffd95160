"""Stage 2 with post-accumulate-grad hooks: reduction in backward, freed gradients, accumulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardopt.core import adam, plan_partition
from shardopt.functional import ShardedState, register_grad_hooks, shard


class Net(nn.Module):
    """float32 layers, a float64 layer, a frozen layer and a branch used at even steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(16, 12).double()
        self.branch = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        h = torch.tanh(self.mid(h.double())).float()
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def loss_of(net: Net, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return ((net(x, use_branch=step % 2 == 0) - y) ** 2).mean()


def train_with_hooks(
    rank: int, world: int, strategy: str, bucket: int | None, micro: int, algorithm: str
) -> tuple[float, bool, list[int], list[int]]:
    """``micro`` backward passes per step through the hooks; returns (max relative error against
    torch on the full batch, whether every .grad was freed, grad shard sizes, shard_numels)."""
    net, ref = make_net(), make_net()
    params = list(net.parameters())
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    plan = plan_partition(params, world, strategy=strategy)
    sharded = shard(adam(1e-2), plan, stage=2, bucket_numel=bucket, algorithm=algorithm)
    state: ShardedState = sharded.init(params)
    hooks = register_grad_hooks(params, state)
    freed = True
    for step in range(6):
        for k in range(micro):
            loss_of(net, micro * step + k, rank).backward()
            freed = freed and all(p.grad is None for p in params)
            full = sum(loss_of(ref, micro * step + k, r) for r in range(world)) / world
            full.backward()
        opt.step()
        opt.zero_grad()
        state = sharded.step(params, None, state)
    hooks.remove()
    err = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(params, ref.parameters())
    )
    sizes = [s.numel() for s in state.reducer.shards]
    return err, freed, sizes, [g.shard_numel for g in state.layout.plan.groups]


@pytest.mark.parametrize(
    ("world", "strategy", "bucket", "micro", "algorithm"),
    [
        (2, "flat", None, 2, "collective"),  # one chunk per group: one staging buffer
        (2, "greedy", 128, 1, "rooted"),  # bucket_numel / W: 64, 32, 16 elements per rank
        (3, "flat", 96, 2, "rooted"),
        (4, "flat", 64, 1, "collective"),
    ],
)
def test_hooks_match_torch_on_the_full_batch_and_free_every_gradient(
    run_world, world, strategy, bucket, micro, algorithm
):
    for err, freed, sizes, shard_numels in run_world(
        train_with_hooks, world, strategy, bucket, micro, algorithm
    ):
        assert err <= 1e-5
        assert freed, "a full gradient survived the backward pass"
        assert sizes == shard_numels  # gradient memory: 1/W of the padded buffer per rank


def hooks_then_plain(rank: int, world: int) -> str:
    net = make_net()
    params = list(net.parameters())
    sharded = shard(adam(1e-2), plan_partition(params, world), stage=2)
    state = sharded.init(params)
    hooks = register_grad_hooks(params, state)
    loss_of(net, 0, rank).backward()
    try:
        sharded.step(params, [torch.zeros_like(p) for p in params], state)
    except ValueError as exc:
        message = str(exc)
    state = sharded.step(params, None, state)  # the reduced gradients are still there
    hooks.remove()
    loss_of(net, 1, rank).backward()
    sharded.step(params, None, state)  # plain form again: takes each .grad
    return message


def test_step_refuses_gradients_while_hooks_reduce_them(run_world):
    for message in run_world(hooks_then_plain, 2):
        assert message.startswith("shard: expected grads=None in step when gradient hooks")


def not_stage2(rank: int, world: int) -> str:
    params = list(make_net().parameters())
    state = shard(adam(), plan_partition(params, world)).init(params)
    try:
        register_grad_hooks(params, state)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_hooks_need_the_state_of_a_stage2_shard(run_world):
    (message,) = run_world(not_stage2, 1)
    assert message.startswith("register_grad_hooks: expected the state of a stage 2 shard")
