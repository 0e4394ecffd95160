"""asgd against torch.optim.ASGD: options, schedules, the piece rule, torch.func and bad inputs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardopt.core import Transformation, apply_updates, asgd, update_pieces_, warmup_cosine_decay
from shardopt.core.blocks import piece_rule, tree_leaves, tree_map

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

# t0 = 5 starts the averaging (mu < 1) within the 50 steps; torch's default 1e6 never does.
OPTIONS = [
    {"weight_decay": wd, "maximize": mx, "t0": 5.0}
    for wd, mx in itertools.product([0.0, 0.1], [False, True])
] + [{}, {"lambd": 0.1, "alpha": 0.5, "t0": 0.0}, {"lambd": 0.01, "alpha": 2.0, "t0": 20.0}]
STATE_KEYS = {"step": "count", "eta": "eta", "mu": "mu", "ax": "ax"}


def learning_rate(kind: str, dtype: torch.dtype) -> float | torch.Tensor:
    return 0.02 if kind == "float" else torch.tensor(0.02, dtype=dtype)


# [Note: bitwise cases of asgd]
# torch writes the parameter with ``mul_`` then a fused ``add_(g, alpha=-eta)``: we return
# ``q - p`` for torch's result ``q``, exact except where ``q`` and ``p`` are more than a factor 2
# apart (an element crossing zero), after which the runs differ by a rounding. So parameters and
# ``ax`` are compared to tolerance; ``step``, ``eta`` and ``mu`` depend only on the counts and
# the lr, and are bitwise equal to torch's.
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_asgd_matches_torch_asgd_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = learning_rate(lr_kind, dtype)
    run = equivalence(
        asgd(lr, **options), torch.optim.ASGD, {"lr": lr, **options}, dtype, skip=skip_every_third
    )
    run.assert_params_close()
    run.assert_state_matches(run.state[-1], STATE_KEYS, bitwise=("step", "eta", "mu"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_asgd_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    # torch's eta of a step comes from the lr of the step before: the schedule shows one late.
    schedule = warmup_cosine_decay(0.05, 5, 50)
    cls = scheduled(torch.optim.ASGD, schedule)
    run = equivalence(asgd(schedule, t0=10.0), cls, {"lr": 0.0, "t0": 10.0}, dtype)
    run.assert_params_close()
    run.assert_state_matches(run.state[-1], STATE_KEYS, bitwise=("step", "eta", "mu"))


def test_asgd_keeps_eta_and_mu_as_float32_scalars_per_parameter_like_torch() -> None:
    params = {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}
    state = asgd(lr=torch.tensor(0.1, dtype=torch.float64)).init(params)[-1]
    for field in (state.eta, state.mu, state.count):
        assert all(t.shape == () and t.dtype == torch.float32 for t in tree_leaves(field))
    assert state.eta["w"] is not state.eta["b"], "a piece rule updates each eta in place"
    assert state.eta["w"].item() == torch.tensor(0.1).item()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "asgd: expected 0 <= lr, got -0.1"),
        ({"weight_decay": -0.1}, "asgd: expected 0 <= weight_decay, got -0.1"),
        ({"lr": torch.ones(2)}, "asgd: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_asgd_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(asgd, torch.optim.ASGD, kwargs, message)


# --- the piece rule ------------------------------------------------------------------------------

SIZES = (1, 17, 1000)
FLAT_CASES = [
    {"lr": 0.02},
    {"lr": 0.02, "t0": 3.0, "weight_decay": 0.1, "maximize": True},
    {"lr": 0.02, "t0": 2.0, "maximize": True, "lambd": 0.1, "alpha": 0.5},
    {"lr": torch.tensor(0.02), "t0": 2.0},
    {"lr": torch.tensor(0.02, dtype=torch.float64), "t0": 2.0, "weight_decay": 0.1},
]


def flat_params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in SIZES]


def flat_grads(dtype: torch.dtype, steps: int = 20) -> list[list[torch.Tensor | None]]:
    """Random gradients per step; a tensor gets None on every fourth step."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        grads = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in SIZES]
        out.append([None if (step + i) % 4 == 0 else g for i, g in enumerate(grads)])
    return out


def run_flat(tx: Transformation, dtype: torch.dtype) -> tuple[list[torch.Tensor], Any]:
    params = flat_params(dtype)
    state = tx.init(params)
    for grads in flat_grads(dtype):
        update_pieces_(tx, params, grads, state)
    return params, state


def run_pure(tx: Transformation, dtype: torch.dtype) -> tuple[list[torch.Tensor], Any]:
    params = flat_params(dtype)
    state = tx.init(params)
    for grads in flat_grads(dtype):
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    return params, state


def flat_id(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", FLAT_CASES, ids=flat_id)
def test_update_pieces_of_asgd_matches_torch_foreach_asgd_bitwise_for_20_steps(
    options: dict[str, Any], dtype: torch.dtype
) -> None:
    tx = asgd(**options)
    assert piece_rule(tx) is not None
    params, state = run_flat(tx, dtype)
    torch_params = [p.requires_grad_(True) for p in flat_params(dtype)]
    opt = torch.optim.ASGD(torch_params, foreach=True, **options)
    for grads in flat_grads(dtype):
        for p, g in zip(torch_params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    for i, (a, b) in enumerate(zip(params, torch_params)):
        assert torch.equal(a, b.detach()), f"param {i} differs bitwise"
    for key, field in STATE_KEYS.items():
        for i, (a, p) in enumerate(zip(getattr(state[-1], field), torch_params)):
            assert torch.equal(a, opt.state[p][key]), f"state {key} of param {i} differs bitwise"


@pytest.mark.parametrize("options", FLAT_CASES, ids=flat_id)
def test_update_pieces_of_asgd_matches_the_pure_path_to_float32_rounding(
    options: dict[str, Any],
) -> None:
    # torch's foreach path (the piece rule) folds the decay into one addcmul and computes eta in
    # float32, its single-tensor path (the pure rule) in double: a few roundings per step apart.
    flat, flat_state = run_flat(asgd(**options), torch.float32)
    pure, pure_state = run_pure(asgd(**options), torch.float32)
    for i, (a, b) in enumerate(zip(flat, pure)):
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err <= 2e-6, f"param {i}: {err:.2e}"
    for a, b in zip(tree_leaves(flat_state), tree_leaves(pure_state)):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_update_pieces_of_asgd_skips_none_grads_and_updates_state_tensors_in_place() -> None:
    tx = asgd(0.1, t0=0.0)
    params = flat_params(torch.float32)
    initial = [p.clone() for p in params]
    state = tx.init(params)
    own = state[-1]
    held = {field: list(getattr(own, field)) for field in STATE_KEYS.values()}
    update_pieces_(tx, params, [torch.ones(SIZES[0]), None, torch.ones(SIZES[2])], state)
    assert torch.equal(params[1], initial[1]), "a parameter without gradient moved"
    assert not torch.equal(params[0], initial[0])
    for field, tensors in held.items():
        assert all(a is b for a, b in zip(getattr(own, field), tensors)), f"{field} replaced"
    assert [c.item() for c in own.count] == [1.0, 0.0, 1.0]
    assert own.eta[1].item() == pytest.approx(0.1)
    assert own.eta[0].item() < 0.1
    assert torch.equal(own.ax[0], params[0])
    assert torch.equal(own.ax[1], torch.zeros(SIZES[1]))


# --- torch.func -----------------------------------------------------------------------------


def quadratic(seed: int = 0) -> tuple[dict[str, torch.Tensor], Callable[[Any], Any]]:
    """float64 params and the gradient of ``sum 0.5 * (p - center)**2``."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64)}
    params["b"] = torch.randn(3, generator=gen, dtype=torch.float64)
    center = tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
    return params, lambda p: tree_map(lambda x, c: x - c, p, center)


def unrolled_loss(lr: Any, params: Any, steps: int = 3) -> torch.Tensor:
    _, grad = quadratic()
    tx = asgd(lr, lambd=0.1, t0=1.0, weight_decay=0.01)
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grad(params), state, params)
        params = apply_updates(params, updates)
    averages = state[-1].ax  # the result of ASGD: the average of the iterates
    return sum(((a - 1.0) ** 2).sum() for a in tree_leaves(averages))


def central_difference(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, h: float):
    out = torch.empty_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        out.view(-1)[i] = (fn(x + e.view_as(x)) - fn(x - e.view_as(x))) / (2 * h)
    return out


def test_asgd_param_gradient_through_3_steps_matches_central_differences() -> None:
    params, _ = quadratic()
    lr = torch.tensor(0.3, dtype=torch.float64)
    d_params = torch.func.grad(lambda p: unrolled_loss(lr, p))(params)
    for key, p in params.items():
        fd = central_difference(lambda x, k=key: unrolled_loss(lr, {**params, k: x}), p, 1e-6)
        torch.testing.assert_close(d_params[key], fd, rtol=1e-6, atol=1e-9)


def test_asgd_lr_gradient_matches_central_differences_to_the_float32_eta() -> None:
    # eta is float32 (as torch's): steps of h = 1e-3 * lr keep its rounding below 1e-4.
    params, _ = quadratic()
    lr = torch.tensor(0.3, dtype=torch.float64)
    d_lr = torch.func.grad(lambda a: unrolled_loss(a, params))(lr)
    fd = central_difference(lambda a: unrolled_loss(a, params), lr, 1e-3 * lr.item())
    torch.testing.assert_close(d_lr, fd, rtol=1e-4, atol=0.0)


def test_vmap_of_asgd_over_8_parameter_sets_equals_8_separate_runs() -> None:
    gen = torch.Generator().manual_seed(0)
    params0 = [torch.randn(8, 4, 3, generator=gen), torch.randn(8, 3, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params0] for _ in range(5)]
    tx = asgd(0.05, t0=2.0, weight_decay=0.1)

    def step(g: Any, state: Any, p: Any) -> tuple[Any, Any]:
        updates, state = tx.update(g, state, p)
        return apply_updates(p, updates), state

    params, state = params0, torch.func.vmap(tx.init)(params0)
    for g in grads:
        params, state = torch.func.vmap(step)(g, state, params)
    for m in range(8):
        p = [x[m] for x in params0]
        s = tx.init(p)
        for g in grads:
            p, s = step([x[m] for x in g], s, p)
        assert all(torch.equal(a[m], b) for a, b in zip(params, p)), f"member {m}: params differ"
        for a, b in zip(tree_leaves(state), tree_leaves(s)):
            assert torch.equal(a[m], b), f"member {m}: state differs"
