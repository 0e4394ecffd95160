"""Clipping equals torch.nn.utils.clip_grad_norm_ / clip_grad_value_, alone and chained."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    EmptyState,
    Transformation,
    chain,
    clip,
    clip_by_global_norm,
    global_norm,
    scale_by_learning_rate,
)

ClipFn = Callable[[list[torch.Tensor]], Any]


def clip_then(torch_cls: type[torch.optim.Optimizer], clip_fn: ClipFn) -> Callable[..., Any]:
    """A ``torch_cls`` whose ``step`` first clips its parameters' gradients with ``clip_fn``."""

    class ClipThenStep(torch_cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Any = None) -> Any:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            clip_fn(params)
            return super().step(closure)

    return ClipThenStep


def random_grads(params: Any, seed: int, none_at: int | None = None) -> Any:
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = pytree.tree_flatten(params)
    grads = [
        None if i == none_at else torch.randn(p.shape, generator=gen, dtype=p.dtype)
        for i, p in enumerate(leaves)
    ]
    return pytree.tree_unflatten(grads, spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["active", "inactive"])
@pytest.mark.parametrize("none_at", [None, 2], ids=["all-grads", "none-grad-at-leaf-2"])
def test_clip_by_global_norm_equals_clip_grad_norm_bitwise(
    mixed_params: Callable[..., Any], dtype: torch.dtype, max_norm: float, none_at: int | None
) -> None:
    params = mixed_params(dtype)
    grads = random_grads(params, seed=1, none_at=none_at)
    tx = clip_by_global_norm(max_norm)
    clipped, state = tx.update(grads, tx.init(params))
    torch_params = [p.clone().requires_grad_(True) for p in pytree.tree_leaves(params)]
    for p, g in zip(torch_params, pytree.tree_leaves(grads, is_leaf=lambda x: x is None)):
        p.grad = None if g is None else g.clone()
    torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
    assert state == EmptyState()
    for ours, p in zip(pytree.tree_leaves(clipped, is_leaf=lambda x: x is None), torch_params):
        assert (ours is None) == (p.grad is None)
        if ours is not None:
            assert torch.equal(ours, p.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(
    ("name", "kwargs", "torch_cls"),
    [
        ("adam", {"lr": 1e-2}, torch.optim.Adam),
        ("adamw", {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD),
    ],
    ids=["adam", "adamw", "sgd-nesterov"],
)
def test_chain_clip_by_global_norm_then_optimizer_matches_torch_for_20_steps(
    equivalence: Callable[..., Any],
    dtype: torch.dtype,
    name: str,
    kwargs: dict[str, Any],
    torch_cls: type[torch.optim.Optimizer],
) -> None:
    tx = chain(clip_by_global_norm(1.0), getattr(shardopt.core, name)(**kwargs))
    ref_cls = clip_then(torch_cls, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    run = equivalence(tx, ref_cls, kwargs, dtype, steps=20)
    run.assert_params_close()


def test_chain_clip_by_global_norm_matches_torch_with_none_grads(
    equivalence: Callable[..., Any],
) -> None:
    tx = chain(clip_by_global_norm(1.0), scale_by_learning_rate(0.1))
    ref_cls = clip_then(torch.optim.SGD, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    run = equivalence(
        tx, ref_cls, {"lr": 0.1}, torch.float64, steps=20, skip=lambda step, i: (step + i) % 3 == 0
    )
    run.assert_params_close()


@pytest.mark.parametrize(
    ("make_inner", "torch_cls", "kwargs"),
    [
        (lambda: scale_by_learning_rate(0.1), torch.optim.SGD, {"lr": 0.1}),
        (lambda: shardopt.core.adam(1e-2), torch.optim.Adam, {"lr": 1e-2}),
    ],
    ids=["scale_by_learning_rate", "adam"],
)
def test_chain_clip_then_optimizer_matches_torch_clip_grad_value_(
    equivalence: Callable[..., Any],
    make_inner: Callable[[], Transformation],
    torch_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
) -> None:
    tx = chain(clip(0.3), make_inner())
    ref_cls = clip_then(torch_cls, lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.3))
    run = equivalence(tx, ref_cls, kwargs, torch.float32, steps=20)
    run.assert_params_close()


def test_clip_clamps_each_element_and_passes_none() -> None:
    tx = clip(torch.tensor(1.5))
    updates, _ = tx.update([torch.tensor([-4.0, 1.0, 2.0]), None], tx.init(None))
    assert torch.equal(updates[0], torch.tensor([-1.5, 1.0, 1.5]))
    assert updates[1] is None


def test_clip_by_global_norm_passes_all_none_updates_through() -> None:
    tx = clip_by_global_norm(1.0)
    grads = {"a": None, "b": [None]}
    assert tx.update(grads, tx.init(grads))[0] is grads


def test_global_norm_is_the_norm_of_all_non_none_leaves_as_one_vector(
    mixed_params: Callable[..., Any],
) -> None:
    tree = mixed_params(torch.float64)
    flat = torch.cat([p.reshape(-1) for p in pytree.tree_leaves(tree)])
    torch.testing.assert_close(global_norm(tree), torch.linalg.vector_norm(flat))
    assert global_norm([None, None]) is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: clip(-1.0), r"clip: expected max_delta >= 0, got -1.0"),
        (lambda: clip(float("nan")), r"clip: expected max_delta >= 0, got nan"),
        (
            lambda: clip_by_global_norm(-0.5),
            r"clip_by_global_norm: expected max_norm >= 0, got -0.5",
        ),
        (
            lambda: clip_by_global_norm(torch.ones(2)),
            r"clip_by_global_norm: expected a 0-d tensor max_norm, got shape \(2,\)",
        ),
    ],
)
def test_clipping_rejects_bad_bounds(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
