"""The piece rules (in place, update_pieces_) of rmsprop, adamax, nadam, radam, adadelta, rprop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardopt.core
from shardopt.core import Transformation, apply_updates, linear_warmup, update_pieces_
from shardopt.core.blocks import piece_rule, tree_leaves

SIZES = (1, 17, 1000)
STEPS = 20
TORCH = {
    "rmsprop": torch.optim.RMSprop,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adadelta": torch.optim.Adadelta,
    "rprop": torch.optim.Rprop,
}
# torch's state key -> our state field, for the buffers every case has.
STATE_KEYS = {
    "rmsprop": {"step": "count", "square_avg": "square_avg"},
    "adamax": {"step": "count", "exp_avg": "exp_avg", "exp_inf": "exp_inf"},
    "nadam": {"step": "count", "mu_product": "mu_product", "exp_avg": "exp_avg"},
    "radam": {"step": "count", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "adadelta": {"step": "count", "square_avg": "square_avg", "acc_delta": "acc_delta"},
    "rprop": {"step": "count", "prev": "prev", "step_size": "step_size"},
}
FULL_RMSPROP = {"momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, **FULL_RMSPROP}),
    ("adamax", {"lr": 0.02}),
    ("adamax", {"lr": 0.02, "weight_decay": 0.1, "maximize": True}),
    ("nadam", {"lr": 0.02}),
    ("nadam", {"lr": 0.02, "weight_decay": 0.1, "momentum_decay": 0.1}),
    ("nadam", {"lr": 0.02, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True}),
    ("radam", {"lr": 0.01}),
    ("radam", {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    ("radam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("adadelta", {"lr": 0.7}),
    ("adadelta", {"lr": 0.7, "weight_decay": 0.1, "maximize": True}),
    ("rprop", {"lr": 0.01}),
    ("rprop", {"lr": 0.01, "etas": (0.3, 1.5), "step_sizes": (5e-3, 0.05), "maximize": True}),
]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, options = case
    return name + "[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]"


def build(name: str, options: dict[str, Any]) -> Transformation:
    return getattr(shardopt.core, name)(**options)


def main_state(name: str, state: tuple[Any, ...]) -> Any:
    """The state of the optimizer's own transformation in its chain."""
    return state[-2] if name == "rprop" else state[-1]


def flat_params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in SIZES]


def grad_steps(dtype: torch.dtype, *, skip: bool = True) -> list[list[torch.Tensor | None]]:
    """Fresh random gradients per step; with ``skip`` a tensor gets None on every fourth step."""
    gen = torch.Generator().manual_seed(1)
    steps = []
    for step in range(STEPS):
        grads = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in SIZES]
        steps.append([None if skip and (step + i) % 4 == 0 else g for i, g in enumerate(grads)])
    return steps


def run_flat(tx: Transformation, dtype: torch.dtype, grads: list[Any]) -> tuple[list, Any]:
    params = flat_params(dtype)
    state = tx.init(params)
    for step_grads in grads:
        update_pieces_(tx, params, step_grads, state)
    return params, state


def run_pure(tx: Transformation, dtype: torch.dtype, grads: list[Any]) -> tuple[list, Any]:
    params = flat_params(dtype)
    state = tx.init(params)
    for step_grads in grads:
        updates, state = tx.update(step_grads, state, params)
        params = apply_updates(params, updates)
    return params, state


def run_torch_foreach(
    name: str, options: dict[str, Any], dtype: torch.dtype, grads: list[Any]
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [p.requires_grad_(True) for p in flat_params(dtype)]
    opt = TORCH[name](params, foreach=True, **options)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    return params, opt


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(ref.abs().max().item(), torch.finfo(ref.dtype).tiny)
    return (ours.to(ref.dtype) - ref).abs().max().item() / scale


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_factory_registers_a_piece_rule(case: tuple[str, dict[str, Any]]) -> None:
    assert piece_rule(build(*case)) is not None


# [Note: piece rules against torch's foreach]
# The piece rules run torch's foreach kernels in the order of torch's foreach implementation with
# the same Python float scalars (see [Note: foreach rules]), so on CPU their parameters and state
# are bitwise equal to torch.optim.<Class>(foreach=True), skipped gradients included.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_update_pieces_matches_torch_foreach_bitwise_for_20_steps(
    case: tuple[str, dict[str, Any]], dtype: torch.dtype
) -> None:
    name, options = case
    grads = grad_steps(dtype)
    params, state = run_flat(build(name, options), dtype, grads)
    torch_params, opt = run_torch_foreach(name, options, dtype, grads)
    for i, (a, b) in enumerate(zip(params, torch_params)):
        assert torch.equal(a, b.detach()), f"param {i} differs bitwise"
    for key, field in STATE_KEYS[name].items():
        ours = tree_leaves(getattr(main_state(name, state), field))
        for i, (a, p) in enumerate(zip(ours, torch_params)):
            assert torch.equal(a, opt.state[p][key]), f"state {key} of param {i} differs bitwise"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_update_pieces_matches_the_pure_path_for_20_steps(case: tuple[str, dict[str, Any]]) -> None:
    name, options = case
    grads = grad_steps(torch.float32)
    flat, flat_state = run_flat(build(name, options), torch.float32, grads)
    pure, pure_state = run_pure(build(name, options), torch.float32, grads)
    for i, (a, b) in enumerate(zip(flat, pure)):
        assert rel_error(a, b) <= 1e-6, f"param {i}: {rel_error(a, b):.2e}"
    for a, b in zip(tree_leaves(flat_state), tree_leaves(pure_state)):
        if a is not None:
            assert rel_error(a, b) <= 1e-6


@pytest.mark.parametrize("name", ["rmsprop", "adamax", "nadam", "radam", "adadelta"])
@pytest.mark.parametrize("lr_kind", ["schedule", "tensor"])
def test_update_pieces_with_a_schedule_or_tensor_lr_matches_the_pure_path(
    name: str, lr_kind: str
) -> None:
    lr = linear_warmup(0.02, 10) if lr_kind == "schedule" else torch.tensor(0.02)
    decoupled = {"weight_decay": 0.1, "decoupled_weight_decay": True}
    options = decoupled if name in ("nadam", "radam") else {"weight_decay": 0.1}
    grads = grad_steps(torch.float32)
    flat, flat_state = run_flat(build(name, {"lr": lr, **options}), torch.float32, grads)
    pure, pure_state = run_pure(build(name, {"lr": lr, **options}), torch.float32, grads)
    for i, (a, b) in enumerate(zip(flat, pure)):
        assert rel_error(a, b) <= 1e-6, f"param {i}: {rel_error(a, b):.2e}"
    counts = zip(main_state(name, flat_state).count, main_state(name, pure_state).count)
    assert all(torch.equal(a, b) for a, b in counts)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_update_pieces_skips_none_grads_and_updates_state_tensors_in_place(
    case: tuple[str, dict[str, Any]],
) -> None:
    name, options = case
    tx = build(name, options)
    params = flat_params(torch.float32)
    initial = [p.clone() for p in params]
    state = tx.init(params)
    own = main_state(name, state)
    buffers = {field: list(getattr(own, field)) for field in STATE_KEYS[name].values()}
    update_pieces_(tx, params, [torch.ones(SIZES[0]), None, torch.full((SIZES[2],), -2.0)], state)
    fresh = main_state(name, tx.init(initial))
    assert torch.equal(params[1], initial[1]), "a parameter without gradient moved"
    assert not torch.equal(params[0], initial[0])
    assert not torch.equal(params[2], initial[2])
    for field, tensors in buffers.items():
        # The state holds the very tensors it held before (updated in place, not replaced) ...
        assert all(a is b for a, b in zip(getattr(own, field), tensors)), f"{field} replaced"
        # ... and those of the parameter without gradient are untouched.
        assert torch.equal(tensors[1], getattr(fresh, field)[1]), f"{field} of param 1 changed"
    assert [c.item() for c in own.count] == [1.0, 0.0, 1.0]
