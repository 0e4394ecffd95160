"""adafactor against torch.optim.Adafactor: options, state layout, schedules, torch.func."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from shardopt.core import adafactor, apply_updates, linear_warmup, update_pieces_
from shardopt.core.blocks import needs_whole_tensors, tree_leaves, tree_map
from shardopt.testing import requires_torch

from _core_helpers import assert_rejected_like_torch, option_id, scheduled, skip_every_third

NEEDS_ADAFACTOR = requires_torch("2.5", "torch.optim.Adafactor")
OPTIONS = [
    {"weight_decay": wd, "maximize": mx} for wd, mx in itertools.product([0.0, 0.1], [False, True])
] + [
    {"beta2_decay": -0.5, "eps": (1e-30, 1e-2), "d": 2.0},
    {"eps": (1e-3, 0.0), "d": 1.5, "weight_decay": 0.05},
]
FIELDS = {"row_var": "row_var", "col_var": "col_var", "variance": "variance"}


def assert_state_like_torch(run: Any, *, bitwise: bool) -> None:
    """Our state has a tensor exactly where torch's has the key (``None`` elsewhere), equal to it
    (bitwise if ``bitwise``), and the counts are torch's steps."""
    state = run.state[-1]
    for name, a, b in zip(run.names, tree_leaves(state.count), run.torch_state("step")):
        assert a.item() == b.item(), f"step of {name}"
    for key, field in FIELDS.items():
        for name, a, b in zip(run.names, tree_leaves(getattr(state, field)), run.torch_state(key)):
            assert (a is None) == (b is None), (
                f"{key} of {name}: ours {a is None}, torch {b is None}"
            )
            if b is None:
                continue
            assert a.shape == b.shape, f"{key} of {name}"
            if bitwise:
                assert torch.equal(a, b), f"{key} of {name} differs bitwise"
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


# [Note: bitwise cases of adafactor]
# The second moments depend only on the gradients and the counts: they are bitwise equal to
# torch's. The parameters are written by ``mul_`` then a fused ``add_``, for which we return
# ``q - p``, exact except where ``q`` and ``p`` are more than a factor 2 apart: compared to
# tolerance. lr = 0.5 exceeds 1/sqrt(t) after 4 steps, where torch's relative step switches
# from the lr to ``1 / sqrt(t)`` (for a tensor lr, from arithmetic in its dtype to double).
@NEEDS_ADAFACTOR
@pytest.mark.parametrize("lr", ["0.01", "0.5", "tensor 0.01", "tensor 0.5"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_adafactor_matches_torch_adafactor_for_50_steps_with_skipped_grads(
    equivalence: Any, options: dict[str, Any], dtype: torch.dtype, lr: str
) -> None:
    value = float(lr.split()[-1])
    rate = torch.tensor(value, dtype=dtype) if lr.startswith("tensor") else value
    run = equivalence(
        adafactor(rate, **options),
        torch.optim.Adafactor,
        {"lr": rate, **options},
        dtype,
        skip=skip_every_third,
    )
    run.assert_params_close()
    assert_state_like_torch(run, bitwise=True)


@NEEDS_ADAFACTOR
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_adafactor_with_a_schedule_matches_torch_with_that_lr_set_before_each_step(
    equivalence: Any, dtype: torch.dtype
) -> None:
    schedule = linear_warmup(0.05, 10)
    cls = scheduled(torch.optim.Adafactor, schedule)
    run = equivalence(adafactor(schedule, weight_decay=0.1), cls, {"weight_decay": 0.1}, dtype)
    run.assert_params_close()
    assert_state_like_torch(run, bitwise=True)


def test_adafactor_factors_the_last_two_dims_and_keeps_a_full_variance_below_two_dims(
    mixed_params: Any,
) -> None:
    state = adafactor().init(mixed_params(torch.float32))[-1]
    assert state.variance["scalar"].shape == ()
    assert state.row_var["scalar"] is None
    assert state.variance["bias"].shape == (7,)
    assert state.col_var["bias"] is None
    assert state.row_var["weight"].shape == (5, 1)
    assert state.col_var["weight"].shape == (1, 3)
    assert state.row_var["conv"].shape == (2, 3, 2, 1)
    assert state.variance["conv"] is None
    assert state.col_var["conv"].shape == (2, 3, 1, 2)


@NEEDS_ADAFACTOR
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "adafactor: expected 0 <= lr, got -0.1"),
        ({"beta2_decay": 0.5}, "adafactor: expected beta2_decay <= 0, got 0.5"),
        ({"eps": (-1.0, 1e-3)}, "adafactor: expected 0 <= eps[0] or None, got -1.0"),
        ({"eps": (None, -1e-3)}, "adafactor: expected 0 <= eps[1], got -0.001"),
        ({"d": 0.5}, "adafactor: expected 1 <= d, got 0.5"),
        ({"weight_decay": -0.1}, "adafactor: expected 0 <= weight_decay, got -0.1"),
        ({"lr": torch.ones(2)}, "adafactor: expected a 0-d tensor lr, got shape (2,)"),
    ],
)
def test_adafactor_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(adafactor, torch.optim.Adafactor, kwargs, message)


def test_update_pieces_refuses_adafactor_whose_factors_need_whole_matrices() -> None:
    tx = adafactor()
    assert needs_whole_tensors(tx)
    params = [torch.ones(6)]  # say, a flat slice of a 2 x 3 matrix
    with pytest.raises(
        ValueError, match=re.escape("update_pieces_: adafactor needs whole tensors")
    ):
        update_pieces_(tx, params, [torch.ones(6)], tx.init(params))


# --- torch.func (test_func.py also runs it through its factory table) --------------------------


def vmap_over_tensors(fn: Any, *args: Any) -> Any:
    """``torch.func.vmap(fn)`` over dim 0 of the tensor leaves of ``args`` and of the result;
    ``None`` leaves (adafactor's absent factors or variance) pass as they are."""
    in_dims = tuple(tree_map(lambda x: None if x is None else 0, a) for a in args)
    out: dict[str, Any] = {}

    def tensors_only(*inner: Any) -> list[torch.Tensor]:
        out["leaves"], out["spec"] = pytree.tree_flatten(fn(*inner), is_leaf=lambda x: x is None)
        return [x for x in out["leaves"] if x is not None]

    tensors = iter(torch.func.vmap(tensors_only, in_dims=in_dims)(*args))
    leaves = [None if x is None else next(tensors) for x in out["leaves"]]
    return pytree.tree_unflatten(leaves, out["spec"])


def test_vmap_of_adafactor_over_8_stacks_of_matrices_equals_8_separate_runs() -> None:
    gen = torch.Generator().manual_seed(0)
    params0 = [torch.randn(8, 2, 4, 3, generator=gen), torch.randn(8, 5, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params0] for _ in range(5)]
    tx = adafactor(0.1, weight_decay=0.1)

    def step(g: Any, state: Any, p: Any) -> tuple[Any, Any]:
        updates, state = tx.update(g, state, p)
        return apply_updates(p, updates), state

    params, state = params0, vmap_over_tensors(tx.init, params0)
    for g in grads:
        params, state = vmap_over_tensors(step, g, state, params)
    for m in range(8):
        p = [x[m] for x in params0]
        s = tx.init(p)
        for g in grads:
            p, s = step([x[m] for x in g], s, p)
        assert all(torch.equal(a[m], b) for a, b in zip(params, p)), f"member {m}: params"
        for a, b in zip(tree_leaves(state), tree_leaves(s)):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a[m], b), f"member {m}: state"


def test_adafactor_gradient_through_3_steps_matches_central_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 4, generator=gen, dtype=torch.float64)]
    params.append(torch.randn(4, generator=gen, dtype=torch.float64))
    center = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]

    def loss(lr: torch.Tensor, p: list[torch.Tensor]) -> torch.Tensor:
        tx = adafactor(lr, weight_decay=0.1)
        state = tx.init(p)
        for _ in range(3):
            updates, state = tx.update([x - c for x, c in zip(p, center)], state, p)
            p = apply_updates(p, updates)
        return sum(((x - c) ** 2).sum() for x, c in zip(p, center))

    lr = torch.tensor(0.05, dtype=torch.float64)
    d_lr, d_params = torch.func.grad(loss, argnums=(0, 1))(lr, params)
    h = 1e-7
    fd_lr = (loss(lr + h, params) - loss(lr - h, params)) / (2 * h)
    torch.testing.assert_close(d_lr, fd_lr, rtol=1e-6, atol=0.0)
    e = torch.zeros(3, 4, dtype=torch.float64)
    e[1, 2] = 1e-6
    fd = (loss(lr, [params[0] + e, params[1]]) - loss(lr, [params[0] - e, params[1]])) / 2e-6
    torch.testing.assert_close(d_params[0][1, 2], fd, rtol=1e-6, atol=1e-9)
