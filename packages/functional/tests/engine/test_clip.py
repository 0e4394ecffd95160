"""Global-norm clipping over shards, and the step that every rank skips on an inf or nan."""

from __future__ import annotations

import math

import pytest
import torch

from shardopt.core import adam, plan_partition
from shardopt.functional import shard
from shardopt.functional.engine._clip import clip_coefficient, local_sq_norm, scale_grads

SHAPES = [(7, 5), (5,), (13,), (6, 6)]


def make_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def local_grads(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(-64, 65, s, generator=gen) / 16.0 for s in SHAPES]


def averaged(step: int, world: int) -> list[torch.Tensor]:
    per_rank = [local_grads(step, r) for r in range(world)]
    return [torch.stack(gs).sum(0) / world for gs in zip(*per_rank)]


def clipped_training(
    rank: int, world: int, stage: int, strategy: str, grads_averaged: bool
) -> tuple[float, list[float], list[float]]:
    """Ours with max_norm=1 against clip_grad_norm_ + Adam on the full batch: (max relative
    error, our norms, torch's norms). ``step`` gets local gradients, or their average with
    ``grads_averaged``."""
    params = make_params()
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adam(ref, lr=1e-2)
    sharded = shard(
        adam(1e-2),
        plan_partition(params, world, strategy=strategy, bucket_numel=16),  # many buckets
        stage=stage,
        grads_averaged=grads_averaged,
        max_norm=1.0,
    )
    state = sharded.init(params)
    ours, theirs = [], []
    for step in range(10):
        avg = averaged(step, world)
        for p, g in zip(ref, avg):
            p.grad = g.clone()
        theirs.append(torch.nn.utils.clip_grad_norm_(ref, 1.0).item())
        opt.step()
        state = sharded.step(params, avg if grads_averaged else local_grads(step, rank), state)
        ours.append(state.stats.grad_norm.item())
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(params, ref))
    return err, ours, theirs


@pytest.mark.parametrize(
    ("world", "stage", "strategy", "grads_averaged"),
    [(2, 1, "flat", False), (2, 1, "greedy", True), (3, 2, "greedy", False)],
)
def test_clipping_uses_the_norm_of_the_full_gradient_like_torch(
    run_world, world, stage, strategy, grads_averaged
):
    for err, ours, theirs in run_world(clipped_training, world, stage, strategy, grads_averaged):
        assert err <= 1e-5
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ours, theirs))
        assert min(theirs) > 1.0  # the gradients really were clipped


def skip_nonfinite(
    rank: int, world: int, stage: int, grads_averaged: bool, bad: float
) -> tuple[bool, bool, bool]:
    """A bad value in one rank's local gradient at step 1 (with ``grads_averaged``: in the
    averaged gradient every rank gets, at a place only one rank owns): every rank skips that
    step (params and state unchanged), and training goes on like torch trained without it."""
    params = make_params()
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adam(ref, lr=1e-2)
    sharded = shard(
        adam(1e-2),
        plan_partition(params, world),
        stage=stage,
        grads_averaged=grads_averaged,
        skip_nonfinite=True,
    )
    state = sharded.init(params)
    skipped = []
    unchanged = True
    for step in range(4):
        grads = averaged(step, world) if grads_averaged else local_grads(step, rank)
        if step == 1:
            if grads_averaged:
                grads[2][-1] = bad  # the end of the buffer: one rank owns it
            elif rank == world - 1:
                grads[0][0, 0] = bad
            before = [p.clone() for p in params]
            counts = [b.clone() for f in state.fields for b in f.buffers]
        else:
            for p, g in zip(ref, averaged(step, world)):
                p.grad = g
            opt.step()
        state = sharded.step(params, grads, state)
        skipped.append(state.stats.skipped)
        if step == 1:
            after = [b for f in state.fields for b in f.buffers]
            unchanged = all(torch.equal(a, b) for a, b in zip(before, params)) and all(
                torch.equal(a, b) for a, b in zip(counts, after)
            )
    close = all(torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-7) for a, b in zip(params, ref))
    return skipped == [False, True, False, False], unchanged, close


@pytest.mark.parametrize(
    ("stage", "grads_averaged", "bad"),
    [(1, True, math.inf), (1, False, math.nan), (2, False, math.nan), (2, False, -math.inf)],
)
def test_an_inf_or_nan_on_one_rank_makes_every_rank_skip_the_step(
    run_world, stage, grads_averaged, bad
):
    for skipped, unchanged, close in run_world(skip_nonfinite, 3, stage, grads_averaged, bad):
        assert skipped, "the ranks did not all skip exactly step 1"
        assert unchanged, "the skipped step changed parameters or state"
        assert close, "training after the skipped step differs from torch without that step"


def test_local_sq_norm_sums_the_squares_of_present_gradients_in_float64():
    grads = [torch.full((3,), 2.0), None, torch.full((2,), 1e20, dtype=torch.float64)]
    assert local_sq_norm(grads).item() == pytest.approx(12.0 + 2e40)


def test_clip_coefficient_is_capped_at_one_like_torch():
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(4.0), 2.0).item() == pytest.approx(2.0 / (4.0 + 1e-6))


def test_scale_grads_copies_unless_asked_to_scale_in_place():
    g = torch.ones(2)
    (copied,) = scale_grads([g], torch.tensor(0.5), in_place=False)
    assert torch.equal(g, torch.ones(2))
    assert torch.equal(copied, torch.full((2,), 0.5))  # type: ignore[arg-type]
    scale_grads([g], torch.tensor(0.5), in_place=True)
    assert torch.equal(g, torch.full((2,), 0.5))
