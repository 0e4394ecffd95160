"""A step's host cost per bucket: operators and Python calls that do not grow with the tensors,
and prepared bucket updates that compute the piece rule's bits ([Note: prepared bucket updates]).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardopt.core import adagrad, adam, adamw, plan_partition, sgd
from shardopt.functional import load_torch_state_dict, register_grad_hooks, shard
from shardopt.optim import ZeroRedundancyOptimizer

NUMEL = 8192  # elements in all: 16 tensors of 512, or 512 tensors of 16 (64 bytes each)
FEW, MANY = 16, 512


class _Operators(TorchDispatchMode):
    """Counts aten operators (on a GPU, each is a kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _operators(fn: Callable[[], Any]) -> int:
    with _Operators() as mode:
        fn()
    return mode.count


def _calls(fn: Callable[[], Any]) -> int:
    """Python function calls made by ``fn`` (``sys.setprofile`` "call" events)."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def _model(tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(NUMEL // tensors, generator=gen)) for _ in range(tensors)
    ]


def _loss(params: list[torch.nn.Parameter], weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(p * w).sum() for p, w in zip(params, weights)]).sum()


def _step_of(variant: str, tensors: int, world: int) -> tuple[Callable[[], Any], int]:
    """A step of ``variant`` over a model of ``tensors`` tensors with gradients set, and the
    number of buckets; a warm-up step already taken."""
    params = _model(tensors)
    weights = [torch.full_like(p, 0.5) for p in params]
    if variant == "dropin_flat":
        opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3, partition="flat")
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt.step, 1
    plan = plan_partition(params, world, bucket_numel=NUMEL)
    stage = 2 if variant == "stage2_hooks" else 1
    sharded = shard(adamw(lr=1e-3), plan, stage=stage)
    box = [sharded.init(params)]
    if stage == 1:
        for p in params:
            p.grad = torch.ones_like(p)

        def step() -> None:
            box[0] = sharded.step(params, None, box[0])

    else:
        register_grad_hooks(params, box[0])

        def step() -> None:  # the hooks' work (in backward) and the step
            _loss(params, weights).backward()
            box[0] = sharded.step(params, None, box[0])

    step()
    return step, len(plan.groups[0].buckets)


def _backward_alone(tensors: int) -> Callable[[], Any]:
    params = _model(tensors)
    weights = [torch.full_like(p, 0.5) for p in params]

    def backward() -> None:
        _loss(params, weights).backward()
        for p in params:
            p.grad = None

    backward()
    return backward


def operator_counts(rank: int, world: int, variant: str) -> dict[int, tuple[int, int]]:
    """{tensors: (operators of a step, buckets)}, stage 2 net of the same backward alone."""
    out = {}
    for tensors in (FEW, MANY):
        step, buckets = _step_of(variant, tensors, world)
        count = _operators(step)
        if variant == "stage2_hooks":
            count -= _operators(_backward_alone(tensors))
        out[tensors] = (count, buckets)
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("variant", ["stage1", "stage2_hooks", "dropin_flat"])
def test_a_step_issues_as_many_operators_for_512_tensors_as_for_16(run_world, variant, world):
    """At most 8 more operators on 512 tensors than on 16, at most 12 per bucket at W = 1, and
    the same counts on every rank (a TorchDispatchMode counts them; stage 2: backward with the hooks
    minus the same backward without, plus the step)."""
    results = run_world(operator_counts, world, variant)
    for rank, counts in enumerate(results):
        (few, buckets), (many, _) = counts[FEW], counts[MANY]
        where = f"{variant}, rank {rank} of {world}"
        assert many <= few + 8, f"{where}: {few} operators on {FEW} tensors, {many} on {MANY}"
        # (beyond one rank, gloo's exchange gathers by one broadcast, and its slice, per rank)
        per_bucket = 12 if world == 1 else 12 + 2 * world
        assert few <= per_bucket * buckets, f"{where}: {few} operators for {buckets} bucket(s)"
    assert all(r == results[0] for r in results), f"{variant}: counts differ by rank: {results}"


def call_counts(rank: int, world: int, variant: str) -> dict[int, int]:
    out = {}
    for tensors in (FEW, MANY):
        step, _ = _step_of(variant, tensors, world)
        out[tensors] = _calls(step)
        if variant == "stage2_hooks":
            out[tensors] -= _calls(_backward_alone(tensors))
    return out


@pytest.mark.parametrize("variant", ["stage1", "dropin_flat"])
def test_step_makes_at_most_half_again_the_python_calls_on_512_tensors(run_world, variant):
    """``step()`` calls no Python per tensor: on 512 tensors at most 1.5x its calls on 16."""
    (counts,) = run_world(call_counts, 1, variant)
    assert counts[MANY] <= 1.5 * counts[FEW], f"{variant}: {counts}"


def test_gradient_hooks_make_at_most_two_python_calls_per_gradient(run_world):
    """Backward with the hooks, minus the same backward without them, plus the step: at most
    2 calls per gradient beyond the step's own (measured on 16 tensors)."""
    (counts,) = run_world(call_counts, 1, "stage2_hooks")
    assert counts[MANY] - counts[FEW] <= 2 * (MANY - FEW), counts


# -- exactness --------------------------------------------------------------------------------

# Bucket 0 holds a 10-element tensor (updated over its pieces); bucket 1 (tensors 3 to 5, 128
# elements) is aligned to 64 bytes in every dtype here, updated over the bucket at W = 1. Tensor
# 4 has no gradient at steps 3 and 4: bucket 1 then takes the rule, its counts differ afterwards.
SHAPES = [(10,), (64,), (16,), (32,), (16, 4), (32,)]
BUCKET = 128
ALIGNED, SKIPPING = (0, 1), 4
OPTIMIZERS = {
    "adamw": lambda: adamw(1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda: adam(1e-2, amsgrad=True, maximize=True),
    "sgd_nesterov": lambda: sgd(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda: adagrad(5e-2),
}


def _grads(step: int, rank: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    out: list[torch.Tensor | None] = [
        (torch.randint(-64, 65, s, generator=gen) / 64).to(dtype) for s in SHAPES
    ]
    if step in (3, 4):
        out[SKIPPING] = None
    return out


def prepared_against_rule(
    rank: int, world: int, name: str, stage: int, dtype: torch.dtype
) -> tuple[bool, set[str]]:
    """8 steps of the same sharded optimizer with its prepared updates and without (the piece
    rule alone), from the same state; (bitwise equal after every step, the forms seen)."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    runs = []
    for prepared in (True, False):
        params = [p.clone() for p in base]
        plan = plan_partition(params, world, bucket_numel=BUCKET)
        sharded = shard(OPTIMIZERS[name](), plan, stage=stage)
        state = sharded.init(params)
        runs.append([sharded, params, state if prepared else state._replace(updates=None)])
    equal, forms = True, set()
    for step in range(8):
        for run in runs:
            run[2] = run[0].step(run[1], _grads(step, rank, dtype), run[2])
        forms |= set(runs[0][2].updates.forms.values())
        equal = equal and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    return equal, forms


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_prepared_bucket_updates_compute_the_piece_rules_bits(run_world, name, dtype, stage, world):
    """Over the bucket, over its pieces, and through the rule when a piece has no gradient: the
    parameters equal those of the piece rule alone, to the bit, after every step."""
    for rank, (equal, forms) in enumerate(
        run_world(prepared_against_rule, world, name, stage, dtype)
    ):
        assert equal, f"{name}, {dtype}, stage {stage}, rank {rank} of {world}: not bitwise"
        if world == 1:  # whole tensors, aligned (at W = 2 the cuts may not be, in bfloat16)
            assert "bucket" in forms, f"{name}: no bucket was updated over the bucket: {forms}"


def after_a_load(rank: int, world: int) -> tuple[bool, list[str]]:
    """torch.optim.AdamW(fused=True) with a parameter a step behind, loaded into a sharded AdamW
    (the aligned bucket then holds unequal counts), then 3 more steps of both: (bitwise, the
    aligned bucket's forms)."""
    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    params = [p.detach().clone() for p in ref]
    sharded = shard(adamw(1e-2, weight_decay=0.1), plan_partition(params, 1, bucket_numel=BUCKET))
    state = sharded.init(params)
    state = sharded.step(params, _grads(0, 0, torch.float32), state)  # prepared, counts equal
    assert state.updates.forms[ALIGNED] == "bucket", state.updates.forms
    for step in range(3):  # tensor 4 skips step 1: its count falls behind
        for i, (p, g) in enumerate(zip(ref, _grads(step, 0, torch.float32))):
            p.grad = None if (step == 1 and i == SKIPPING) else g
        opt.step()
    with torch.no_grad():
        for p, r in zip(params, ref):
            p.copy_(r)
    load_torch_state_dict(state, opt.state_dict())
    forms = []
    for step in range(3, 6):
        grads = _grads(10 + step, 0, torch.float32)
        for p, g in zip(ref, grads):
            p.grad = g
        opt.step()
        state = sharded.step(params, grads, state)
        forms.append(state.updates.forms[ALIGNED])
    return all(torch.equal(a, b.detach()) for a, b in zip(params, ref)), forms


def test_a_load_of_unequal_step_counts_is_read_before_a_bucket_update(run_world):
    """A load writes the per-piece counts behind the prepared updates' back: the next step
    reads them again and, finding them unequal, updates that bucket over its pieces; the result
    is torch's fused AdamW to the bit."""
    ((equal, forms),) = run_world(after_a_load, 1)
    assert equal, forms
    assert forms[0] == "pieces", forms


def large_at_one_rank(rank: int, world: int) -> tuple[bool, list[str], int]:
    """Stage 1 at W = 1 on large tensors against torch's fused AdamW, a gradient missing at
    step 2: (bitwise after every step, the forms, gradient shards allocated)."""
    shapes = [(256, 512), (70_000,), (7,)]  # 67,026 elements on average
    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    params = [p.detach().clone() for p in ref]
    sharded = shard(adamw(1e-2, weight_decay=0.1), plan_partition(params, 1))
    state = sharded.init(params)
    equal, forms = True, []
    for step in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads[1] = None if step == 2 else grads[1]
        for p, g in zip(ref, grads):
            p.grad = g
        opt.step()
        state = sharded.step(params, grads, state)
        forms += list(state.updates.forms.values())
        equal = equal and all(torch.equal(a, b.detach()) for a, b in zip(params, ref))
    return equal, forms, len(state.reducer.grads.allocated_shards)


def test_one_rank_steps_large_gradients_where_they_are_like_torch(run_world):
    """At W = 1, stage 1 on tensors of 2**16 elements or more on average takes the gradients as
    they are (no gradient shard is even allocated: [Note: one rank's gradients]) and equals
    torch's fused AdamW to the bit, a step with a missing gradient included."""
    ((equal, forms, shards),) = run_world(large_at_one_rank, 1)
    assert equal, forms
    assert "pieces" in forms, forms
    assert "rule" in forms, forms
    assert shards == 0
