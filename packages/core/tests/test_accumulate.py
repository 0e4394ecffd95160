"""multi_steps: k micro-steps equal one inner step on the mean gradient, as k backward passes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    MultiStepsState,
    Transformation,
    add_decayed_weights,
    apply_updates,
    chain,
    multi_steps,
    scale,
    scale_by_learning_rate,
)
from shardopt.core.blocks import tree_leaves

INNERS: dict[str, Callable[[], Transformation]] = {
    "decay+lr": lambda: chain(add_decayed_weights(0.01), scale_by_learning_rate(0.1)),
    "sgd-momentum": lambda: shardopt.core.sgd(0.1, momentum=0.9),
    "adam-amsgrad": lambda: shardopt.core.adam(1e-2, amsgrad=True),
}


def micro_grads(params: Any, count: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """``count`` lists of random gradients, one per leaf of ``params``."""
    gen = torch.Generator().manual_seed(seed)
    leaves = pytree.tree_leaves(params)
    return [
        [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in leaves] for _ in range(count)
    ]


def same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(INNERS))
def test_multi_steps_equals_inner_steps_on_window_means_bitwise(
    mixed_params: Callable[..., Any], name: str, dtype: torch.dtype
) -> None:
    k, windows = 4, 5
    tx, inner = multi_steps(INNERS[name](), k), INNERS[name]()
    params = ref = mixed_params(dtype)
    spec = pytree.tree_structure(params)
    state, ref_state = tx.init(params), inner.init(ref)
    grads = micro_grads(params, k * windows)
    for w in range(windows):
        window = grads[w * k : (w + 1) * k]
        for i, g in enumerate(window):
            before = params
            updates, state = tx.update(pytree.tree_unflatten(g, spec), state, params)
            params = apply_updates(params, updates)
            if i < k - 1:
                assert same(params, before), f"params moved at micro-step {i} of window {w}"
        sums = [sum(gs[1:], gs[0]) for gs in zip(*window)]
        means = pytree.tree_unflatten([s / k for s in sums], spec)
        updates, ref_state = inner.update(means, ref_state, ref)
        ref = apply_updates(ref, updates)
        assert same(params, ref), f"params differ after window {w}"
        assert same(state.inner_state, ref_state), f"inner state differs after window {w}"


@pytest.mark.parametrize(
    ("name", "torch_cls", "kwargs"),
    [
        ("adam", torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ],
    ids=["adam-amsgrad", "sgd-momentum-weight_decay"],
)
def test_multi_steps_matches_torch_gradient_accumulation(
    mixed_params: Callable[..., Any],
    name: str,
    torch_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
) -> None:
    # torch: k backward passes of loss / k add g_i / k into p.grad, then one step. Leaf 1 gets no
    # gradient in every other micro-step: it adds nothing, in torch and in multi_steps.
    k, windows = 3, 6
    params = mixed_params(torch.float64)
    spec = pytree.tree_structure(params)
    torch_params = [p.clone().requires_grad_(True) for p in pytree.tree_leaves(params)]
    opt = torch_cls(torch_params, **kwargs)
    tx = multi_steps(getattr(shardopt.core, name)(**kwargs), k)
    state = tx.init(params)
    for n, leaves in enumerate(micro_grads(params, k * windows)):
        grads: list[torch.Tensor | None] = [
            None if i == 1 and n % 2 else g for i, g in enumerate(leaves)
        ]
        for p, g in zip(torch_params, grads):
            if g is not None:
                p.grad = g / k if p.grad is None else p.grad + g / k
        if n % k == k - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
        updates, state = tx.update(pytree.tree_unflatten(grads, spec), state, params)
        params = apply_updates(params, updates)
    for ours, ref in zip(pytree.tree_leaves(params), torch_params):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=1e-14)


def test_multi_steps_with_every_k_1_equals_the_inner_transformation_bitwise(
    mixed_params: Callable[..., Any],
) -> None:
    params = ref = mixed_params(torch.float32)
    spec = pytree.tree_structure(params)
    tx, inner = multi_steps(shardopt.core.adam(1e-2), 1), shardopt.core.adam(1e-2)
    state, ref_state = tx.init(params), inner.init(ref)
    for leaves in micro_grads(params, 4):
        grads = pytree.tree_unflatten(leaves, spec)
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
        updates, ref_state = inner.update(grads, ref_state, ref)
        ref = apply_updates(ref, updates)
    assert same(params, ref)


def test_multi_steps_state_counts_the_window_and_resets_after_an_emit() -> None:
    tx = multi_steps(scale(-1.0), 3)
    params = {"w": torch.zeros(2), "b": None}
    state = tx.init(params)
    assert isinstance(state, MultiStepsState)
    assert state.mini_step.dtype == torch.int64
    assert state.mini_step.shape == ()
    assert state.acc_grads["b"] is None
    seen = []
    for n in range(4):
        updates, state = tx.update({"w": torch.full((2,), float(n + 1)), "b": None}, state, params)
        seen.append((int(state.mini_step), updates["w"].tolist()))
        assert updates["b"] is None
    assert seen == [(1, [0.0, 0.0]), (2, [0.0, 0.0]), (0, [-2.0, -2.0]), (1, [0.0, 0.0])]
    assert torch.equal(state.acc_grads["w"], torch.full((2,), 4.0))


def test_multi_steps_gives_a_zero_update_to_a_leaf_without_gradient_in_the_window() -> None:
    # [Note: branch-free accumulation]: the inner transformation sees a zero mean gradient for
    # it (torch.optim would skip it), so the inner state of that leaf advances.
    tx = multi_steps(chain(scale_by_learning_rate(shardopt.core.linear_warmup(1.0, 4))), 2)
    params = [torch.ones(1), torch.ones(1)]
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update([torch.ones(1), None], state, params)
    assert torch.equal(updates[1], torch.zeros(1))
    assert [c.item() for c in state.inner_state[0].count] == [1.0, 1.0]


@pytest.mark.parametrize("every_k", [0, -2, 2.0, True])
def test_multi_steps_rejects_every_k_that_is_not_a_positive_int(every_k: Any) -> None:
    with pytest.raises(ValueError, match=r"multi_steps: expected an int every_k >= 1, got"):
        multi_steps(scale(1.0), every_k)
