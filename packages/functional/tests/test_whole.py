"""Muon and Adafactor sharded whole-matrix: each rank owns whole matrices of a greedy plan
balanced by cost, and the sharded run matches torch.optim.Muon / Adafactor in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardopt.core import adafactor, muon, newton_schulz_flops, plan_partition
from shardopt.functional import register_grad_hooks, shard

STEPS = 20
OPTIMIZERS = {
    "muon": (lambda: muon(lr=0.02), lambda ps: torch.optim.Muon(ps, lr=0.02)),
    "adafactor": (lambda: adafactor(lr=0.01), lambda ps: torch.optim.Adafactor(ps, lr=0.01)),
}


def matrices() -> nn.Module:
    """Three bias-free layers: 2-D parameters only (what torch.optim.Muon takes)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16, bias=False), nn.Tanh(), nn.Linear(16, 12, bias=False), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(12, 3, bias=False))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def reference(name: str, ranks: list[int]) -> list[torch.Tensor]:
    """torch.optim's optimizer in one process on the batches of ``ranks`` at once."""
    model = matrices()
    opt = OPTIMIZERS[name][1](list(model.parameters()))
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in ranks))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def train(rank: int, world: int, name: str, stage: int, same_batch: bool) -> list[torch.Tensor]:
    model = matrices()
    params = list(model.parameters())
    plan = plan_partition(
        params, world, strategy="greedy", cost=lambda t: newton_schulz_flops(t.shape)
    )
    sharded = shard(OPTIMIZERS[name][0](), plan, stage=stage)
    state = sharded.init(params)
    if stage == 2:
        register_grad_hooks(params, state)
    for step in range(STEPS):
        x, y = batch(step, 0 if same_batch else rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("world", "stage"), [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)])
def test_sharded_whole_matrices_match_torch_on_equal_gradients(run_world, name, world, stage):
    """Every rank has the same batch, so the averaged gradient is exactly one process's."""
    expected = reference(name, [0])
    for params in run_world(train, world, name, stage, True):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "atol"), [("muon", 1e-2), ("adafactor", 1e-5)])
def test_sharded_whole_matrices_match_torch_on_the_full_batch(run_world, name, atol):
    """Different batches: the average is the full batch's up to float32 rounding, which Muon's
    bfloat16 Newton-Schulz iterations turn into bfloat16 differences of its updates."""
    expected = reference(name, [0, 1])
    for params in run_world(train, 2, name, 2, False):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=0, atol=atol)


def flat_plan(rank: int, world: int) -> str:
    params = list(matrices().parameters())
    try:
        shard(muon(), plan_partition(params, world)).init(params)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_flat_plan_is_refused_for_whole_matrices(run_world: Any) -> None:
    for message in run_world(flat_plan, 2):
        assert message.startswith("shard: expected a plan of whole tensors (strategy='greedy')")


def with_biases() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def muon_and_adamw(rank: int, world: int) -> list[torch.Tensor]:
    """The recipe: Muon on the matrices, AdamW on the biases, through core's partition."""
    from shardopt.core import adamw, partition

    model = with_biases()
    params = list(model.parameters())
    tx = partition(
        {"muon": muon(lr=0.02), "adamw": adamw(lr=1e-3)},
        lambda ps: ["muon" if p.dim() == 2 else "adamw" for p in ps],
    )
    plan = plan_partition(
        params, world, strategy="greedy", cost=lambda t: newton_schulz_flops(t.shape)
    )
    sharded = shard(tx, plan, stage=2)
    state = sharded.init(params)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


def test_muon_for_matrices_and_adamw_for_the_rest_matches_torchs_two_optimizers(run_world):
    model = with_biases()
    matrices_, rest = [[p for p in model.parameters() if (p.dim() == 2) == m] for m in (1, 0)]
    opts = [torch.optim.Muon(matrices_, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for params in run_world(muon_and_adamw, 2):
        for p, e in zip(params, model.parameters()):
            torch.testing.assert_close(p, e.detach(), rtol=1e-5, atol=1e-6)
