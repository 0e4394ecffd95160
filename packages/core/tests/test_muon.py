"""muon against torch.optim.Muon (2-D parameters only): options, orthogonalize, torch.func."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from shardopt.core import (
    Transformation,
    adamw,
    apply_updates,
    chain,
    linear_warmup,
    masked,
    muon,
    partition,
    update_pieces_,
)
from shardopt.core._muon import orthogonalize
from shardopt.core.blocks import needs_whole_tensors, tree_leaves
from shardopt.testing import requires_torch

from _core_helpers import option_id, scheduled

NEEDS_MUON = requires_torch("2.9", "torch.optim.Muon")
SHAPES = [(5, 3), (3, 5), (4, 4), (6, 2)]  # tall, wide, square: the transposed NS and lr ratios
RTOL = {torch.float64: 1e-12, torch.float32: 1e-6}
OPTIONS = [
    {},
    {"nesterov": False},
    {"momentum": 0.5, "weight_decay": 0.0},
    {"adjust_lr_fn": "original", "weight_decay": 0.3},
    {"adjust_lr_fn": "match_rms_adamw"},
    {"ns_coefficients": (2.0, -1.5, 0.5), "ns_steps": 3, "eps": 1e-3},
]


def matrices(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


def run_against_torch(
    tx: Transformation,
    torch_cls: Any,
    torch_kwargs: dict[str, Any],
    dtype: torch.dtype,
    *,
    skip: bool = True,
) -> tuple[list[torch.Tensor], Any, list[torch.Tensor], torch.optim.Optimizer]:
    """50 steps of ``tx`` and of torch on the same gradients; with ``skip`` every third gradient
    of each parameter is None."""
    params = matrices(dtype)
    torch_params = [p.clone().requires_grad_(True) for p in params]
    opt = torch_cls(torch_params, **torch_kwargs)
    state = tx.init(params)
    gen = torch.Generator().manual_seed(1)
    for step in range(50):
        grads = [
            None if skip and (step + i) % 3 == 0 else torch.randn(s, generator=gen).to(dtype)
            for i, s in enumerate(SHAPES)
        ]
        for p, g in zip(torch_params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    return params, state, torch_params, opt


def assert_close_to_torch(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err = (a - b.detach()).abs().max().item() / b.abs().max().item()
        assert err <= RTOL[b.dtype], f"param {i}: relative error {err:.2e}"


# [Note: bitwise cases of muon]
# The orthogonalization is torch's bfloat16 computation, bitwise, and the momentum buffer too;
# the parameters are written by ``mul_`` then a fused ``add_``, for which we return ``q - p``:
# exact except where ``q`` and ``p`` are more than a factor 2 apart, so they are compared to
# tolerance. torch keeps no step count: its only state is the momentum buffer.
@NEEDS_MUON
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_muon_matches_torch_muon_for_50_steps_with_skipped_grads(
    options: dict[str, Any], dtype: torch.dtype, lr_kind: str
) -> None:
    lr = 0.02 if lr_kind == "float" else torch.tensor(0.02, dtype=dtype)
    kwargs = {"lr": lr, **options}
    params, state, torch_params, opt = run_against_torch(
        muon(**kwargs), torch.optim.Muon, kwargs, dtype
    )
    assert_close_to_torch(params, torch_params)
    for i, (buf, p) in enumerate(zip(state[-1].momentum, torch_params)):
        assert list(opt.state[p]) == ["momentum_buffer"]
        assert torch.equal(buf, opt.state[p]["momentum_buffer"]), f"buffer {i} differs bitwise"
    expected = [sum((step + i) % 3 != 0 for step in range(50)) for i in range(len(SHAPES))]
    assert [c.item() for c in state[-1].count] == expected


@NEEDS_MUON
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_muon_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    dtype: torch.dtype,
) -> None:
    schedule = linear_warmup(0.05, 10)
    cls = scheduled(torch.optim.Muon, schedule)
    tx = muon(schedule)
    params, _, torch_params, _ = run_against_torch(tx, cls, {"lr": 0.0}, dtype, skip=False)
    assert_close_to_torch(params, torch_params)


@NEEDS_MUON
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4), (1, 7), (32, 64)], ids=str)
def test_orthogonalize_is_torchs_newton_schulz_bitwise(shape: tuple[int, int]) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for coefficients, steps, eps in [
        ((3.4445, -4.775, 2.0315), 5, 1e-7),
        ((2.0, -1.5, 0.5), 2, 1.0),
    ]:
        from torch.optim._muon import _zeropower_via_newtonschulz

        ours = orthogonalize(g, coefficients, steps, eps)
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, coefficients, steps, eps))


def test_orthogonalize_brings_the_singular_values_of_a_matrix_near_one() -> None:
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 100.0
    singular_values = torch.linalg.svdvals(orthogonalize(g).float())
    assert singular_values.min() > 0.5
    assert singular_values.max() < 1.5


@NEEDS_MUON
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "muon: expected 0 <= lr, got -0.1"),
        ({"momentum": -0.9}, "muon: expected 0 <= momentum, got -0.9"),
        ({"weight_decay": -0.1}, "muon: expected 0 <= weight_decay, got -0.1"),
        ({"adjust_lr_fn": "nope"}, "muon: expected adjust_lr_fn None, 'original' or 'match_"),
        ({"lr": torch.ones(2)}, "muon: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_muon_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        muon(**kwargs)
    with pytest.raises(ValueError):
        torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)], **kwargs)


@NEEDS_MUON
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ns_steps": 100}, "muon: expected ns_steps < 100, got 100"),
        ({"ns_coefficients": (1.0, 2.0)}, "muon: expected 3 ns_coefficients, got (1.0, 2.0)"),
    ],
)
def test_muon_rejects_at_construction_what_torch_rejects_at_its_first_step(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        muon(**kwargs)
    p = torch.zeros(2, 2, requires_grad=True)
    opt = torch.optim.Muon([p], **kwargs)
    p.grad = torch.ones(2, 2)
    with pytest.raises(ValueError):
        opt.step()


@NEEDS_MUON
@pytest.mark.parametrize("shape", [(3,), (), (2, 3, 4)], ids=str)
def test_muon_refuses_parameters_and_gradients_that_are_not_2d_like_torch(
    shape: tuple[int, ...],
) -> None:
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        torch.optim.Muon([torch.zeros(shape, requires_grad=True)])
    tx = muon()
    with pytest.raises(ValueError, match=re.escape("muon: expected 2-D parameters (torch.")):
        tx.init([torch.zeros(shape)])
    state = tx.init([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=re.escape("muon: expected 2-D gradients")):
        tx.update([torch.zeros(shape)], state, [torch.zeros(2, 3)])


def test_muon_skips_a_none_gradient_and_keeps_its_buffer() -> None:
    tx = muon(0.1)
    params = matrices(torch.float32)
    state = tx.init(params)
    updates, new = tx.update([None, torch.ones(3, 5), None, None], state, params)
    assert updates[0] is None
    assert updates[1] is not None
    assert new[-1].momentum[0] is state[-1].momentum[0]
    assert [c.item() for c in new[-1].count] == [0.0, 1.0, 0.0, 0.0]


# --- whole tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: muon(),
        lambda: chain(muon()),
        lambda: masked(muon(), lambda p: [x.dim() == 2 for x in p]),
        lambda: partition(
            {"m": muon(), "a": adamw()}, lambda p: ["m" if x.dim() == 2 else "a" for x in p]
        ),
    ],
    ids=["muon", "chain", "masked", "partition"],
)
def test_update_pieces_refuses_muon_alone_or_inside_combinators(build: Any) -> None:
    tx = build()
    assert needs_whole_tensors(tx)
    params = [torch.zeros(2, 3)]
    with pytest.raises(ValueError, match=r"update_pieces_: muon needs whole tensors"):
        update_pieces_(tx, params, [torch.ones(2, 3)], tx.init(params))
    assert torch.equal(params[0], torch.zeros(2, 3)), "a refused update moved the params"


def test_combinators_without_muon_or_adafactor_do_not_need_whole_tensors() -> None:
    assert not needs_whole_tensors(chain(adamw(), adamw()))
    assert not needs_whole_tensors(masked(adamw(), [True]))
    assert not needs_whole_tensors(partition({"a": adamw()}, ["a"]))


# --- torch.func ---------------------------------------------------------------------------------


def unrolled_loss(lr: torch.Tensor, params: list[torch.Tensor], steps: int) -> torch.Tensor:
    """``sum (p - 1)**2`` after ``steps`` muon steps on the gradients of ``sum (p - c)**2 / 2``."""
    center = matrices(torch.float64, seed=7)
    tx = muon(lr, weight_decay=0.1)
    state = tx.init(params)
    for _ in range(steps):
        grads = [p - c for p, c in zip(params, center)]
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    return sum(((p - 1.0) ** 2).sum() for p in params)


def test_muon_lr_gradient_of_one_step_matches_central_differences() -> None:
    # One step: the orthogonalized direction does not depend on the lr, the loss is smooth in it
    # (over more steps it is not: the bfloat16 iteration rounds the direction).
    params = matrices(torch.float64)
    lr = torch.tensor(0.05, dtype=torch.float64)
    d_lr = torch.func.grad(lambda a: unrolled_loss(a, params, 1))(lr)
    h = 1e-6
    fd = (unrolled_loss(lr + h, params, 1) - unrolled_loss(lr - h, params, 1)) / (2 * h)
    torch.testing.assert_close(d_lr, fd, rtol=1e-7, atol=0.0)


def test_muon_under_torch_func_grad_through_3_steps_equals_autograd() -> None:
    params = matrices(torch.float64)
    lr = torch.tensor(0.05, dtype=torch.float64)
    d_lr, d_params = torch.func.grad(lambda a, p: unrolled_loss(a, p, 3), argnums=(0, 1))(
        lr, params
    )
    leaves = [lr.clone().requires_grad_(True)] + [p.clone().requires_grad_(True) for p in params]
    expected = torch.autograd.grad(unrolled_loss(leaves[0], leaves[1:], 3), leaves)
    torch.testing.assert_close(d_lr, expected[0], rtol=1e-12, atol=0.0)
    for ours, theirs in zip(d_params, expected[1:]):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)


def test_vmap_of_muon_over_8_matrices_equals_8_separate_runs_to_bfloat16_rounding() -> None:
    # vmap runs ``addmm`` as a separate multiply and add in bfloat16 (torch's batching rule),
    # one unbatched ``addmm`` rounds once: the directions differ by a few bfloat16 roundings.
    # The momentum buffers do not go through the iteration and are equal bitwise.
    gen = torch.Generator().manual_seed(0)
    params0 = torch.randn(8, 6, 4, generator=gen)
    grads = [torch.randn(8, 6, 4, generator=gen) for _ in range(5)]
    lr = 0.02
    tx = muon(lr)

    def step(g: torch.Tensor, state: Any, p: torch.Tensor) -> tuple[torch.Tensor, Any]:
        updates, state = tx.update([g], state, [p])
        return apply_updates([p], updates)[0], state

    params, state = params0, torch.func.vmap(tx.init)([params0])
    for g in grads:
        params, state = torch.func.vmap(step)(g, state, params)
    for m in range(8):
        p, s = params0[m], tx.init([params0[m]])
        for g in grads:
            p, s = step(g[m], s, p)
        assert torch.equal(state[-1].momentum[0][m], s[-1].momentum[0])
        # 5 steps of lr * sqrt(6 / 4) times a direction of entries below 1, a few % apart.
        assert (params[m] - p).abs().max().item() <= 5 * lr * 1.23 * 0.1
        assert torch.equal(state[-1].count[0][m], s[-1].count[0])


def test_vmap_of_orthogonalize_over_a_batch_runs_and_agrees_with_a_loop_to_bfloat16() -> None:
    g = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(0))
    batched = torch.func.vmap(orthogonalize)(g)
    looped = torch.stack([orthogonalize(x) for x in g])
    assert batched.dtype == torch.bfloat16
    assert batched.shape == g.shape
    torch.testing.assert_close(batched.float(), looped.float(), rtol=0.0, atol=0.1)


def test_muon_count_and_buffers_are_per_parameter_and_start_at_zero() -> None:
    state = muon().init(matrices(torch.float32))[-1]
    assert all(c.item() == 0.0 and c.dtype == torch.float32 for c in tree_leaves(state.count))
    assert [b.shape for b in state.momentum] == [torch.Size(s) for s in SHAPES]
