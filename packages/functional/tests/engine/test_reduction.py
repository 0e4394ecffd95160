"""Gradient shards ([Note: gradient shards]): compact, in the reduce dtype, filled bucket by
bucket in reverse order as each bucket and every later one are ready; the reducer launches."""

from __future__ import annotations

import pytest
import torch

from shardopt.core import plan_partition
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.functional.engine._reduction import GradShards


def test_gradient_shards_are_compact_and_in_the_reduce_dtype():
    params = [torch.randn(10, dtype=torch.bfloat16), torch.randn(3)]
    plan = plan_partition(params, 2, strategy="greedy", bucket_numel=4)
    plain = GradShards(build_param_buffers(plan, [p.clone() for p in params], 1)).shards
    assert [s.dtype for s in plain] == [torch.bfloat16, torch.float32]
    shards = GradShards(build_param_buffers(plan, params, 1, reduce_dtype=torch.float32)).shards
    assert [s.dtype for s in shards] == [torch.float32, torch.float32]
    assert [s.numel() for s in shards] == [g.shard_numels[1] for g in plan.groups]


def six_buckets_of_two(rank: int) -> tuple[GradShards, list[torch.Tensor]]:
    params = [torch.zeros(4) for _ in range(6)]
    plan = plan_partition(params, 2, strategy="flat", bucket_numel=8)
    grads = GradShards(build_param_buffers(plan, params, rank))
    assert len(grads.param_buffers.keys) == 3
    return grads, [torch.full((4,), float(t + rank)) for t in range(6)]


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_bucket_is_ready_once_its_gradients_and_every_later_bucket_are_and_shards_average(
    world,
):
    """Buckets become ready in reverse order, each once all its trainable tensors reported and
    every later bucket is ready; launched, the shards get the average."""
    grads, local = six_buckets_of_two(world.rank)
    param_buffers, keys = grads.param_buffers, grads.param_buffers.keys
    launched: list = []

    def ready(t):
        for key in grads.mark_ready(t):
            grads.start_reduce(key, local, accumulate=False)
            launched.append(key)

    first, middle, last = (param_buffers.bucket_tensors[k] for k in keys)
    grads.expect([True] * 6)
    for t in first:
        ready(t)
    assert launched == []  # ready, but the later buckets are not
    ready(last[0])
    assert launched == []
    ready(last[1])
    assert launched == [keys[2]]
    for t in middle:
        ready(t)
    assert launched == [keys[2], keys[1], keys[0]]  # the first bucket follows at once
    assert grads.unstarted() == []
    grads.finish_reduce()
    assert not grads.pending
    expected = torch.cat([torch.full((4,), t + 0.5) for t in range(6)])
    for p, shard in zip(param_buffers.pieces, param_buffers.piece_views(grads.shards)):
        start = p.tensor * 4 + p.start
        assert torch.equal(shard, expected[start : start + p.numel])


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_bucket_does_not_wait_for_a_frozen_tensor_and_the_rest_are_unstarted_at_the_end(world):
    grads, local = six_buckets_of_two(world.rank)
    keys = grads.param_buffers.keys
    frozen = grads.param_buffers.bucket_tensors[keys[2]][0]
    grads.expect([t != frozen for t in range(6)])
    ready = grads.mark_ready(grads.param_buffers.bucket_tensors[keys[2]][1])
    assert ready == [keys[2]]  # its frozen tensor is not waited for
    assert grads.unstarted() == [keys[1], keys[0]]
    assert grads.unstarted() == []  # counted as launched
    for key in [*ready, keys[1], keys[0]]:
        grads.start_reduce(key, local, accumulate=False)
    grads.finish_reduce()


# -- [Note: gradients in the shard] ------------------------------------------------------------

LOOPS = ("kept", "set_to_none", "micro_batches", "hooks_after", "explicit_after")


def _is_view_of(grads: list, shard: torch.Tensor) -> list[bool]:
    base = shard.untyped_storage().data_ptr()
    return [g is not None and g.untyped_storage().data_ptr() == base for g in grads]


def _train_both(loop: str, steps: int = 4):
    """One W = 1 training loop through stage 1 and through torch's fused AdamW, with real
    backward passes: per step (parameters and .grad bitwise alike, .grad views of the shard,
    the step's operator names)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardopt.core import adamw
    from shardopt.functional import register_grad_hooks, shard

    class Names(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(16, generator=gen)) for _ in range(64)]
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    sharded = shard(adamw(1e-2, weight_decay=0.1), plan_partition(params, 1), stage=1)
    state = sharded.init(params)
    rows = []
    for step in range(steps):
        if loop == "hooks_after" and step == 2:
            register_grad_hooks(params, state)
        xs = [torch.randn(16, generator=gen) for _ in range(2 if loop == "micro_batches" else 1)]
        for ps in (ref, params):  # zero_grad, as torch.optim's does
            for p in ps:
                if loop == "set_to_none":
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            for x in xs:
                torch.stack([(p * x * (i + 1)).sum() for i, p in enumerate(ps)]).sum().backward()
        explicit = loop == "explicit_after" and step >= 2
        grads = [p.grad * 2 for p in params] if explicit else None  # not .grad's values
        if explicit:
            for r in ref:
                r.grad.mul_(2)
        before = [p.grad.clone() for p in params]
        opt.step()
        with Names() as names:
            state = sharded.step(params, grads, state)
        alike = all(torch.equal(a, b) for a, b in zip(params, ref))
        grads_alike = all(torch.equal(p.grad, b) for p, b in zip(params, before))
        views = _is_view_of([p.grad for p in params], state.reducer.shards[0])
        rows.append((alike and grads_alike, all(views), not any(views), names.names))
    return rows


@pytest.mark.world(1, backend="gloo", timeout=120)
@pytest.mark.parametrize("loop", LOOPS)
def test_one_ranks_kept_gradients_become_views_of_the_shard_and_train_like_torch(world, loop):
    """At W = 1, stage 1 makes ``.grad`` views of its gradient shard (DDP's
    ``gradient_as_bucket_view``): a loop that keeps its gradients (zeroed in place, or summed
    over micro-batches, with hooks registered later too) then packs nothing, a loop that sets
    ``.grad`` to None has its gradients copied and no views made again, and gradients passed
    explicitly leave ``.grad`` its own values. Every loop equals torch's fused AdamW to the bit,
    parameters and ``.grad`` alike, after every step."""
    rows = _train_both(loop)
    assert all(row[0] for row in rows), loop
    copies = ["aten._foreach_copy_.default" in row[3] for row in rows]
    views = [row[1] for row in rows]
    if loop in ("kept", "micro_batches", "hooks_after"):
        assert views == [True] * 4
        assert copies == [True, False, False, False]
    elif loop == "set_to_none":
        assert views == [True, False, False, False]  # made once, replaced, not made again
        assert all(copies)
        assert [row[2] for row in rows] == [False, True, True, True]  # none is a view
    else:
        assert views == [True, True, False, False]
        assert copies == [True, False, True, True]
        assert [row[2] for row in rows] == [False, False, True, True]
