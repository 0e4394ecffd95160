"""Gradient hooks: reduction in backward (stage 2 frees the gradients, stage 1 keeps them),
accumulation, and how much of the reduction backward hides."""

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
    rank: int,
    world: int,
    stage: int,
    strategy: str,
    bucket: int | None,
    micro: int,
    algorithm: str,
) -> tuple[float, bool, list[int], list[int]]:
    """``micro`` backward passes per step through the hooks; returns (max relative error against
    torch on the full batch, whether every .grad was freed (stage 2) or kept (stage 1), grad
    shard sizes, shard_numels)."""
    net, ref = make_net(), make_net()
    params = list(net.parameters())
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(adam(1e-2), plan, stage=stage, algorithm=algorithm)
    state: ShardedState = sharded.init(params)
    hooks = register_grad_hooks(params, state)
    as_promised = True
    for step in range(6):
        for k in range(micro):
            loss_of(net, micro * step + k, rank).backward()
            if stage == 2:
                as_promised = as_promised and all(p.grad is None for p in params)
            else:  # the local gradients stay, for the caller
                used = [p.grad is not None for p in params if p.requires_grad]
                as_promised = as_promised and sum(used) >= len(used) - 2  # branch: odd steps
            full = sum(loss_of(ref, micro * step + k, r) for r in range(world)) / world
            full.backward()
        opt.step()
        opt.zero_grad()
        state = sharded.step(params, None, state)
        if stage == 1:
            net.zero_grad()
    hooks.remove()
    err = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(params, ref.parameters())
    )
    sizes = [s.numel() for s in state.reducer.shards]
    return err, as_promised, sizes, [g.shard_numels[rank] for g in state.param_buffers.plan.groups]


@pytest.mark.parametrize(
    ("world", "stage", "strategy", "bucket", "micro", "algorithm"),
    [
        (2, 2, "flat", None, 2, "collective"),  # one bucket per group: one staging buffer
        (2, 2, "greedy", 128, 1, "exchange"),  # unequal shards, several buckets
        (3, 2, "flat", 96, 2, "exchange"),
        (4, 2, "flat", 64, 1, "collective"),
        (1, 1, "flat", None, 1, "auto"),
        (2, 1, "greedy", 128, 1, "collective"),
        (3, 1, "flat", 96, 2, "exchange"),  # stage 1: .grad accumulates across micro-steps
        (4, 1, "greedy", 1 << 24, 1, "auto"),
    ],
)
def test_hooks_match_torch_on_the_full_batch_and_free_or_keep_every_gradient(
    run_world, world, stage, strategy, bucket, micro, algorithm
):
    for err, as_promised, sizes, shard_numels in run_world(
        train_with_hooks, world, stage, strategy, bucket, micro, algorithm
    ):
        assert err <= 1e-5
        assert as_promised, "stage 2 kept a full gradient, or stage 1 lost one"
        assert sizes == shard_numels  # gradient memory: the rank's compact shard


def loop_without_zero_grad(
    rank: int, world: int, hooked: bool, micro: int
) -> tuple[list[torch.Tensor], bool]:
    """Stage 2, ``micro`` backward passes a step and never a ``zero_grad``; returns the final
    parameters and whether every ``.grad`` was None after each step."""
    net = make_net()
    params = list(net.parameters())
    sharded = shard(adam(1e-2), plan_partition(params, world, bucket_numel=128), stage=2)
    state = sharded.init(params)
    hooks = register_grad_hooks(params, state) if hooked else None
    freed = True
    for step in range(5):
        for k in range(micro):
            loss_of(net, micro * step + k, rank).backward()
        state = sharded.step(params, None, state)
        freed = freed and all(p.grad is None for p in params)
    if hooks is not None:
        hooks.remove()
    return [p.detach().clone() for p in params], freed


@pytest.mark.parametrize("micro", [1, 2])
def test_stage_2_asks_the_same_loop_with_or_without_gradient_hooks(run_world, micro):
    hooked = run_world(loop_without_zero_grad, 2, True, micro)
    plain = run_world(loop_without_zero_grad, 2, False, micro)
    for (ours, freed), (theirs, freed_plain) in zip(hooked, plain):
        assert freed, "stage 2 with hooks left a .grad for the loop to clear"
        assert freed_plain, "stage 2 without hooks left a .grad for the loop to clear"
        for a, b in zip(ours, theirs):
            if micro == 1:  # the same reductions of the same gradients
                assert torch.equal(a, b)
            else:  # reduced per micro-step with hooks, summed first without: rounding apart
                assert (a - b).abs().max() <= 1e-6


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


def reduced_when_backward_returns(rank: int, world: int, stage: int) -> tuple[bool, float]:
    """(whether a reduction was in flight when backward returned, the largest difference of the
    shards from the rank-averaged gradients then)."""
    net, ref = MLP(), MLP()
    ref.load_state_dict(net.state_dict())
    params = list(net.parameters())
    plan = plan_partition(params, world, bucket_numel=272)
    state = shard(adam(1e-2), plan, stage=stage).init(params)
    register_grad_hooks(params, state)
    gen = torch.Generator().manual_seed(rank)
    net(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
    pending = state.reducer.grads.pending
    shards = [s.clone() for s in state.reducer.shards]  # read before anything else waits
    for r in range(world):
        gen = torch.Generator().manual_seed(r)
        (ref(torch.randn(8, 16, generator=gen)).pow(2).mean() / world).backward()
    expected = state.param_buffers.grad_views([p.grad for p in ref.parameters()])
    got = state.param_buffers.piece_views(shards)
    return pending, max((a - b).abs().max().item() for a, b in zip(got, expected))


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_returns_with_the_gradient_shards_reduced_as_ddp_does(run_world, stage):
    for pending, err in run_world(reduced_when_backward_returns, 2, stage):
        assert not pending
        assert err < 1e-6


def already_averaged(rank: int, world: int) -> str:
    params = list(make_net().parameters())
    state = shard(adam(), plan_partition(params, world), grads_averaged=True).init(params)
    try:
        register_grad_hooks(params, state)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_hooks_need_the_state_of_a_shard_that_reduces_gradients(run_world):
    (message,) = run_world(already_averaged, 1)
    assert message.startswith(
        "register_grad_hooks: expected the state of a shard(...) that reduces gradients"
    )


class MLP(nn.Module):
    """Four layers of 16 x 16 (272 elements each): one bucket per layer at bucket_numel=272."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def launched_early(
    rank: int, world: int, stage: int, strategy: str, bucket: int | None
) -> tuple[float, int]:
    """(``launched_early`` after each of two backward passes, the smaller, number of buckets)."""
    torch.manual_seed(0)
    net = MLP()
    params = list(net.parameters())
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(adam(1e-2), plan, stage=stage)
    state = sharded.init(params)
    hooks = register_grad_hooks(params, state)
    seen = []
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + rank)
        net(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        seen.append(hooks.launched_early)
        state = sharded.step(params, None, state)
        net.zero_grad()
    hooks.remove()
    return min(seen), sum(len(g.buckets) for g in plan.groups)


@pytest.mark.parametrize(
    ("world", "stage", "strategy", "bucket"),
    [
        (2, 2, "flat", 272),
        (2, 1, "greedy", 272),
        (4, 2, "greedy", 272),
        (4, 1, "flat", 272),
        (2, 2, "flat", None),
        (4, 1, "greedy", None),
        (2, 2, "greedy", 1 << 24),
    ],
)
def test_with_several_buckets_most_of_the_reduction_is_launched_during_backward(
    run_world, world, stage, strategy, bucket
):
    """One bucket per layer: the last three layers' buckets (3/4 of the elements) are launched
    before the first layer's gradients arrive; a single bucket can only start at the end."""
    for early, buckets in run_world(launched_early, world, stage, strategy, bucket):
        if bucket == 272:
            assert buckets >= 4
            assert early >= 0.5
        else:
            assert buckets == 1
            assert early == 0
