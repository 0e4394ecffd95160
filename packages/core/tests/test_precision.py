"""with_state_dtype: bfloat16 state equals torch.optim with its state rounded after every step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.core import (
    adam,
    apply_updates,
    chain,
    inject_hyperparams,
    set_hyperparams,
    sgd,
    with_state_dtype,
)
from shardopt.core.blocks import TORCH_COMPAT, needs_whole_tensors, tree_leaves

from _core_helpers import FACTORY_CASES, case_id

STEPS = 30
RECORDS = {r.factory.__name__: r for r in TORCH_COMPAT}
ELEMENTWISE = [
    c for c in FACTORY_CASES if c[0] in RECORDS and not needs_whole_tensors(RECORDS[c[0]].factory())
]


def start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


def grads_at(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


def round_state(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """What with_state_dtype stores: every floating state tensor of 1 or more dims, rounded."""
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                value.copy_(value.to(dtype))


def torch_rounded(name: str, lr: float, options: dict[str, Any], dtype: torch.dtype) -> list:
    params = [torch.nn.Parameter(p) for p in start()]
    opt = RECORDS[name].torch_class(params, lr=lr, **options)
    for step in range(STEPS):
        for p, g in zip(params, grads_at(step)):
            p.grad = g
        opt.step()
        round_state(opt, dtype)
    return [p.detach() for p in params]


def core_stored(name: str, lr: float, options: dict[str, Any], dtype: torch.dtype) -> list:
    tx = with_state_dtype(RECORDS[name].factory(lr=lr, **options), dtype)
    params = start()
    state = tx.init(params)
    for step in range(STEPS):
        updates, state = tx.update(grads_at(step), state, params)
        params = apply_updates(params, updates)
    stored = [x for x in tree_leaves(state) if isinstance(x, torch.Tensor) and x.dim() > 0]
    assert all(x.dtype == dtype for x in stored)  # (plain SGD keeps none)
    return params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("name", "lr", "options"), ELEMENTWISE, ids=[case_id(c[0], c[2]) for c in ELEMENTWISE]
)
def test_stored_state_equals_torch_with_its_state_rounded_every_step(name, lr, options, dtype):
    ours = core_stored(name, lr, options, dtype)
    theirs = torch_rounded(name, lr, options, dtype)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bfloat16_state_moves_the_parameters_away_from_float32_state():
    """The rounding is real: the same run with float32 state ends elsewhere."""
    narrow = core_stored("adam", 0.01, {}, torch.bfloat16)
    wide = core_stored("adam", 0.01, {}, torch.float32)
    assert max((a - b).abs().max().item() for a, b in zip(narrow, wide)) > 1e-6


def test_counts_and_hyperparameters_keep_their_dtype():
    tx = with_state_dtype(inject_hyperparams(adam, lr=0.01), torch.bfloat16)
    state = tx.init(start())
    state = set_hyperparams(state, lr=0.02)
    _, state = tx.update(grads_at(0), state, start())
    zero_d = [x for x in tree_leaves(state) if isinstance(x, torch.Tensor) and x.dim() == 0]
    assert zero_d
    assert all(x.dtype != torch.bfloat16 for x in zero_d)
    assert float(state.hyperparams["lr"]) == 0.02


def test_it_composes_in_a_chain_and_works_under_torch_func():
    tx = chain(with_state_dtype(sgd(0.1, momentum=0.9), torch.bfloat16))
    params = start()

    def loss(ps: list[torch.Tensor], state: Any) -> torch.Tensor:
        updates, _ = tx.update(ps, state, ps)
        return sum(u.sum() for u in updates)

    grads = torch.func.grad(loss)(params, tx.init(params))
    assert [g.shape for g in grads] == [p.shape for p in params]


@pytest.mark.parametrize("bad", ["bfloat16", torch.int8, None])
def test_a_non_floating_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"with_state_dtype: expected a floating torch.dtype"):
        with_state_dtype(adam(), bad)


def test_a_gradient_wider_than_the_compute_dtype_is_refused_not_rounded():
    tx = with_state_dtype(adam(), torch.bfloat16)
    params = [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"no wider than compute_dtype torch.float32, got torch.f"):
        tx.update([torch.ones(3, dtype=torch.float64)], tx.init(params), params)
    wide = with_state_dtype(adam(), torch.bfloat16, compute_dtype=torch.float64)
    updates, _ = wide.update([torch.ones(3, dtype=torch.float64)], wide.init(params), params)
    assert updates[0].dtype == torch.float64
