"""Optimizers under torch.func: grad through unrolled steps, and vmap over model ensembles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    Transformation,
    add_decayed_weights,
    apply_updates,
    chain,
    clip,
    clip_by_global_norm,
    masked,
    multi_steps,
    partition,
    scale_by_learning_rate,
)
from shardopt.core.blocks import tree_leaves, tree_map

from _core_helpers import FACTORY_CASES, case_id, decay_label, is_matrix

Builder = Callable[[Any], Transformation]  # learning rate (float or 0-d tensor) -> optimizer


def factory_builder(name: str, options: dict[str, Any]) -> Builder:
    return lambda lr: getattr(shardopt.core, name)(lr, **options)


COMBINATOR_CASES: dict[str, tuple[float, Builder]] = {
    "clip+lr": (0.1, lambda lr: chain(clip(0.3), scale_by_learning_rate(lr))),
    "clip_by_global_norm+sgd": (
        0.1,
        lambda lr: chain(clip_by_global_norm(0.5), shardopt.core.sgd(lr, momentum=0.9)),
    ),
    "masked-decay+lr": (
        0.1,
        lambda lr: chain(masked(add_decayed_weights(0.1), is_matrix), scale_by_learning_rate(lr)),
    ),
    "partition-adam+sgd": (
        0.01,
        lambda lr: partition(
            {"decay": shardopt.core.adamw(lr), "no_decay": shardopt.core.sgd(lr * 10.0)},
            decay_label,
        ),
    ),
    "multi_steps-adam": (0.01, lambda lr: multi_steps(shardopt.core.adam(lr), 2)),
}

ALL_CASES = [
    pytest.param(lr, factory_builder(name, options), id=case_id(name, options))
    for name, lr, options in FACTORY_CASES
] + [pytest.param(lr, build, id=name) for name, (lr, build) in COMBINATOR_CASES.items()]


# --- (a) torch.func.grad through 3 unrolled steps -----------------------------------------------


class Quadratic:
    """``loss(p) = sum 0.5 * curvature * (p - center)**2`` over a small float64 pytree."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)

        def tree(fn: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                "w": fn((3, 2), generator=gen, dtype=torch.float64),
                "b": fn((3,), generator=gen, dtype=torch.float64),
            }

        self.params = tree(torch.randn)
        self.center = tree(torch.randn)
        self.curvature = tree_map(lambda c: c + 0.5, tree(torch.rand))

    def grad(self, params: Any) -> Any:
        return tree_map(lambda p, a, c: a * (p - c), params, self.curvature, self.center)

    def loss(self, params: Any) -> torch.Tensor:
        terms = tree_map(
            lambda p, a, c: (0.5 * a * (p - c) ** 2).sum(), params, self.curvature, self.center
        )
        return torch.stack(tree_leaves(terms)).sum()

    def unrolled_loss(
        self, build: Builder, lr: torch.Tensor, params: Any, steps: int = 3
    ) -> torch.Tensor:
        """The loss after ``steps`` updates of ``build(lr)`` from ``params``."""
        tx = build(lr)
        state = tx.init(params)
        for _ in range(steps):
            updates, state = tx.update(self.grad(params), state, params)
            params = apply_updates(params, updates)
        return self.loss(params)


def central_differences(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, h: float
) -> torch.Tensor:
    """d fn / d x by central differences, element by element."""
    out = torch.empty_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        e = e.view_as(x)
        out.view(-1)[i] = (fn(x + e) - fn(x - e)) / (2 * h)
    return out


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    err = (ours - ref).norm().item() / max(ref.norm().item(), 1e-300)
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e} ({ours} vs {ref})"


@pytest.mark.parametrize(("lr", "build"), ALL_CASES)
def test_grad_of_unrolled_loss_matches_central_differences(lr: float, build: Builder) -> None:
    # For rprop the update is -sign(g) * step, with step = lr times a product of etas chosen by
    # sign(g * previous g): piecewise constant in the params (torch's sign has derivative 0, the
    # kinks where a gradient crosses zero are a null set) and linear in lr away from the
    # step_sizes clamps. So d(params_3)/d(params_0) is the identity and d(loss)/d(lr) exists;
    # central differences at this generic point (no sign flips within h, no clamp reached) agree,
    # and test_rprop_param_gradient_is_the_loss_gradient_at_the_final_params checks the identity.
    problem = Quadratic()
    lr_t = torch.tensor(lr, dtype=torch.float64)
    d_lr, d_params = torch.func.grad(
        lambda a, p: problem.unrolled_loss(build, a, p), argnums=(0, 1)
    )(lr_t, problem.params)

    fd_lr = central_differences(
        lambda a: problem.unrolled_loss(build, a, problem.params), lr_t, h=1e-6 * lr
    )
    assert_rel_close(d_lr, fd_lr, 1e-6, "d loss / d lr")
    for key, p in problem.params.items():

        def loss_of_leaf(x: torch.Tensor, key: str = key) -> torch.Tensor:
            return problem.unrolled_loss(build, lr_t, {**problem.params, key: x})

        fd = central_differences(loss_of_leaf, p, h=1e-6)
        assert_rel_close(d_params[key], fd, 1e-6, f"d loss / d params[{key!r}]")


def test_rprop_param_gradient_is_the_loss_gradient_at_the_final_params() -> None:
    problem = Quadratic()
    build = factory_builder("rprop", {})
    lr = torch.tensor(0.01, dtype=torch.float64)

    def final_params(params: Any) -> Any:
        tx = build(lr)
        state = tx.init(params)
        for _ in range(3):
            updates, state = tx.update(problem.grad(params), state, params)
            params = apply_updates(params, updates)
        return params

    d_params = torch.func.grad(lambda p: problem.unrolled_loss(build, lr, p))(problem.params)
    expected = problem.grad(final_params(problem.params))
    for key in d_params:
        torch.testing.assert_close(d_params[key], expected[key], rtol=1e-14, atol=0.0)


# --- (b) torch.func.vmap over an ensemble of 8 models -------------------------------------------


def vmap_over_tensors(fn: Callable[..., Any], *args: Any) -> Any:
    """``torch.func.vmap(fn)`` over dim 0 of every tensor leaf of ``args``.

    Non-tensor leaves (``None`` gradients, ``None`` state such as adam's ``nu_max`` without
    amsgrad) get ``in_dims=None``, and non-tensor outputs are passed back as they are: vmap
    itself accepts only tensors where a dim is given.
    """
    in_dims = tuple(tree_map(lambda x: 0 if isinstance(x, torch.Tensor) else None, a) for a in args)
    out: dict[str, Any] = {}

    def tensors_only(*inner_args: Any) -> list[torch.Tensor]:
        leaves, out["spec"] = pytree.tree_flatten(fn(*inner_args))
        out["leaves"] = leaves
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    tensors = iter(torch.func.vmap(tensors_only, in_dims=in_dims)(*args))
    leaves = [next(tensors) if isinstance(x, torch.Tensor) else x for x in out["leaves"]]
    return pytree.tree_unflatten(leaves, out["spec"])


def ensemble_grads(params: Any, steps: int, seed: int = 1) -> list[Any]:
    """Random float32 gradients for each step; leaf "b" has none at step 2."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(params["w"].shape, generator=gen),
            "b": None if step == 2 else torch.randn(params["b"].shape, generator=gen),
        }
        for step in range(steps)
    ]


@pytest.mark.parametrize(("lr", "build"), ALL_CASES)
def test_vmap_over_an_ensemble_of_8_equals_8_separate_runs(lr: float, build: Builder) -> None:
    members, steps = 8, 5
    gen = torch.Generator().manual_seed(0)
    params0 = {
        "w": torch.randn(members, 4, 3, generator=gen),
        "b": torch.randn(members, 3, generator=gen),
    }
    grads = ensemble_grads(params0, steps)
    tx = build(lr)

    params, state = params0, vmap_over_tensors(tx.init, params0)
    for g in grads:
        updates, state = vmap_over_tensors(tx.update, g, state, params)
        params = apply_updates(params, updates)

    for m in range(members):
        p = tree_map(lambda x, m=m: x[m], params0)
        s = tx.init(p)
        for g in grads:
            updates, s = tx.update(tree_map(lambda x, m=m: None if x is None else x[m], g), s, p)
            p = apply_updates(p, updates)
        for key in p:
            assert torch.equal(params[key][m], p[key]), f"member {m}: params[{key!r}] differ"
        ours = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
        ref = [t for t in tree_leaves(s) if isinstance(t, torch.Tensor)]
        assert len(ours) == len(ref)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert torch.equal(a[m], b), f"member {m}: state tensor {i} differs"
