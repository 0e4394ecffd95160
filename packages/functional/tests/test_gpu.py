"""One CUDA device over NCCL (skipped without one): shard and its checkpoints on CUDA tensors."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from shardopt.core import adamw, plan_partition
from shardopt.functional import (
    consolidate_state_dict,
    load_checkpoint,
    register_grad_hooks,
    register_param_hooks,
    save_checkpoint,
    shard,
    wait_params,
)
from shardopt.testing import World, reference_problem


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| in float64 (the absolute difference where ref is zero)."""
    diff = (ours.detach().double() - ref.detach().double()).abs().max().item()
    top = ref.detach().double().abs().max().item()
    return diff / top if top > 0 else diff


LR = 1e-3
STEPS = 5
# float32, 5 steps, the same fused kernel as torch's on gradients equal up to the order of
# backward's reductions: 1e-5 of each tensor's largest value (a stale parameter is off by ~LR)
TOL = 1e-5


def train_gpt(world: World, stage: int, strategy: str) -> tuple[list[torch.Tensor], float, float]:
    """shard(adamw) with both overlaps beside torch.optim.AdamW(fused=True) on the reference
    GPT; returns the initial parameters, the worst error and how far torch's moved."""
    problem = reference_problem("gpt", dtype=torch.float32)
    model, ref = problem.model().to(world.device), problem.model().to(world.device)
    initial = [p.detach().clone() for p in ref.parameters()]
    params = list(model.parameters())
    plan = plan_partition(params, world.world_size, strategy=strategy, bucket_numel=8192)
    sharded = shard(adamw(LR), plan, stage=stage)
    state = sharded.init(params)
    hooks = [register_grad_hooks(params, state), register_param_hooks(model, state)]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    for step in range(STEPS):
        batch = tuple(t.to(world.device) for t in problem.data(step))
        model.zero_grad(set_to_none=True)  # stage 1 keeps the full gradients, as torch.optim
        problem.loss(model, batch).backward()
        state = sharded.step(params, None, state)
        opt.zero_grad()
        problem.loss(ref, batch).backward()
        opt.step()
    wait_params(state)
    for hook in hooks:
        hook.remove()
    error = max(rel_error(a, b) for a, b in zip(params, ref.parameters()))
    moved = max(rel_error(a, b) for a, b in zip(ref.parameters(), initial))
    return params, error, moved


@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_shard_with_both_overlaps_on_cuda_matches_fused_adamw(
    world: World, stage: int, strategy: str
) -> None:
    params, error, moved = train_gpt(world, stage, strategy)
    assert all(p.is_cuda for p in params)
    assert moved > 100 * TOL  # torch's parameters moved, so agreeing means something
    assert error <= TOL


@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_a_cuda_state_saved_and_loaded_consolidates_to_the_same_dict_bitwise(
    world: World, tmp_path
):
    problem = reference_problem("gpt", dtype=torch.float32)
    states = []
    for _ in range(2):
        params = list(problem.model().to(world.device).parameters())
        sharded = shard(adamw(LR), plan_partition(params, 1), stage=2)
        states.append((params, sharded, sharded.init(params)))
    params, sharded, state = states[0]
    for _ in range(STEPS):
        grads = [torch.randn_like(p) for p in params]
        state = sharded.step(params, grads, state)
    path = os.path.join(tmp_path, "checkpoint")
    save_checkpoint(state, path)
    load_checkpoint(states[1][2], path)
    saved, loaded = consolidate_state_dict(state), consolidate_state_dict(states[1][2])
    assert saved is not None
    assert loaded is not None
    assert saved["state"].keys() == loaded["state"].keys() == set(range(len(params)))
    for index, entry in saved["state"].items():
        assert entry["exp_avg"].abs().max() > 0
        for key, value in entry.items():
            assert torch.equal(value, loaded["state"][index][key]), (index, key)
    assert all(b.is_cuda for b in states[1][2].param_buffers.buffers)


@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_a_bfloat16_wire_on_cuda_rounds_each_gradient_once_and_sums_in_float32(world: World):
    from shardopt.core import sgd

    params = [torch.zeros(s, device=world.device) for s in ((7, 5), (13,), (6, 6))]
    sharded = shard(sgd(1.0), plan_partition(params, 1), stage=2, comm_dtype=torch.bfloat16)
    grads = [torch.randn_like(p) for p in params]
    sharded.step(params, grads, sharded.init(params))
    for p, g in zip(params, grads):
        assert p.is_cuda
        assert torch.equal(-p, g.to(torch.bfloat16).float())


@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_the_drop_in_on_a_bfloat16_wire_on_cuda_rounds_each_gradient_once(world: World):
    from shardopt.optim import ZeroRedundancyOptimizer

    params = [torch.zeros(s, device=world.device, requires_grad=True) for s in ((7, 5), (13,))]
    zero = ZeroRedundancyOptimizer(
        params, torch.optim.SGD, partition="flat", comm_dtype=torch.bfloat16, lr=1.0
    )
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    zero.step()
    for p, g in zip(params, grads):
        assert p.is_cuda
        assert torch.equal(-p.detach(), g.to(torch.bfloat16).float())


@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_master_remainders_on_cuda_give_the_float32_masters_bitwise(world: World):
    params = [
        torch.randn(s, device=world.device).to(torch.bfloat16) for s in ((64, 33), (33,), (5000,))
    ]
    twins = [p.clone() for p in params]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    runs = []
    for ps, remainders in ((params, True), (twins, False)):
        plan = plan_partition(ps, 1)
        sharded = shard(adamw(LR), plan, master_dtype=torch.float32, master_remainders=remainders)
        state = sharded.init(ps)
        for _ in range(STEPS):
            state = sharded.step(ps, grads, state)
        runs.append(state.master.fulls())
    for a, b in zip(*runs):
        if a is not None:
            assert a.is_cuda
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def composed_on_cuda(name: str) -> Any:
    """The composition table's cases that reduce across shards or resolve labels (W = 1)."""
    from shardopt.core import (
        adam,
        adaptive_grad_clip,
        chain,
        clip_by_global_norm,
        lamb,
        lars,
        muon,
        partition,
        scale,
    )

    def by_dim(ps: Any) -> Any:
        return ["m" if p.dim() == 2 else "v" for p in ps]

    return {
        "clip_by_global_norm then adam": lambda: chain(clip_by_global_norm(0.5), adam(LR)),
        "lamb": lambda: lamb(LR, weight_decay=0.01),
        "lars": lambda: lars(LR, weight_decay=0.01),
        "adaptive_grad_clip then adam": lambda: chain(adaptive_grad_clip(0.05), adam(LR)),
        "partition by dim: muon and adamw": lambda: partition(
            {"m": muon(lr=0.02), "v": adamw(LR)}, by_dim
        ),
        "partition by dim: lamb and scale": lambda: partition(
            {"m": lamb(LR), "v": scale(-LR)}, by_dim
        ),
    }[name]()


COMPOSED = [
    "clip_by_global_norm then adam",
    "lamb",
    "lars",
    "adaptive_grad_clip then adam",
    "partition by dim: muon and adamw",
    "partition by dim: lamb and scale",
]


@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=180)
def test_the_composition_table_on_cuda_matches_one_process(world: World, strategy: str) -> None:
    from shardopt.core import apply_updates
    from shardopt.core.blocks import Kind, kind_of

    failures = {}
    for name in COMPOSED:
        tx = composed_on_cuda(name)
        shapes = ((6, 5), (7,), (3, 4), (9, 2))
        params = [torch.randn(s, device=world.device, generator=None) for s in shapes]
        grads = [[torch.randn_like(p) for p in params] for _ in range(STEPS)]
        ref_params, ref_state = [p.clone() for p in params], None
        ref_tx = composed_on_cuda(name)
        ref_state = ref_tx.init(ref_params)
        for g in grads:
            updates, ref_state = ref_tx.update(list(g), ref_state, ref_params)
            ref_params = apply_updates(ref_params, updates)
        plan = plan_partition(params, 1, strategy=strategy, bucket_numel=16)
        sharded = shard(tx, plan)
        if strategy == "flat" and Kind.SHAPED in (kind_of(tx) or Kind.ELEMENTWISE):
            with pytest.raises(ValueError, match="needs each tensor in its shape"):
                sharded.init(params)
            continue
        state = sharded.init(params)
        for g in grads:
            state = sharded.step(params, list(g), state)
        worst = max(float((a - b).norm() / b.norm()) for a, b in zip(params, ref_params))
        if not (worst <= 1e-5 and all(p.is_cuda for p in params)):
            failures[name] = worst
    assert not failures, failures


@pytest.mark.gpu(1)
@pytest.mark.world(1, backend="nccl", timeout=300)
def test_compiled_updates_on_cuda_stay_within_a_few_ulps_of_eager_and_never_recompile(
    world: World,
) -> None:
    """compile=True (Triton) against the eager path, step by step from the same state: a
    composed AdamW with a global-norm clip and a schedule (one graph, its all-reduce inside),
    Lion, and built-in AdamW on bfloat16 parameters with master remainders."""
    from shardopt.core import (
        add_decayed_weights,
        chain,
        clip_by_global_norm,
        lion,
        scale_by_adam,
        scale_by_learning_rate,
        warmup_cosine_decay,
    )
    from shardopt.functional.engine._compiled import compiled_update

    cases = {
        "adamw chain": (
            lambda: chain(
                clip_by_global_norm(1.0),
                scale_by_adam(),
                add_decayed_weights(1e-2),
                scale_by_learning_rate(warmup_cosine_decay(1e-2, 3, 20)),
            ),
            torch.float32,
        ),
        "lion": (lambda: lion(1e-2), torch.float32),
        "adamw, master remainders": (lambda: adamw(1e-2), torch.bfloat16),
    }
    failures = {}
    for name, (make, dtype) in cases.items():
        gen = torch.Generator(device=world.device).manual_seed(0)
        shapes = ((300, 7), (50,), (1000,))
        start = [torch.randn(s, device=world.device, generator=gen).to(dtype) for s in shapes]
        opts: dict[str, Any] = {}
        if dtype is torch.bfloat16:
            opts = {"master_dtype": torch.float32, "master_remainders": True}
        runs = []
        for mode in (False, True):
            params = [p.clone() for p in start]
            sharded = shard(make(), plan_partition(params, 1), compile=mode, **opts)
            runs.append([sharded, sharded.init(params), params])
        for _ in range(10):
            grads = [torch.randn(s, device=world.device, generator=gen).to(dtype) for s in shapes]
            for run in runs:
                run[1] = run[0].step(run[2], grads, run[1])
        # float32 masters where the parameters are bfloat16 (a one-ulp difference of a master
        # may round the parameter the other way)
        ours, eager = ([m for m in run[1].master.fulls() if m is not None] for run in runs[::-1])
        if not ours:
            ours, eager = runs[1][2], runs[0][2]
        worst = max(rel_error(a, b) for a, b in zip(ours, eager))
        update = compiled_update(runs[1][1].param_buffers)
        if update is None or update.fallback is not None or update.recompiles or worst > 1e-5:
            failures[name] = (worst, None if update is None else update.fallback)
    assert not failures, failures
