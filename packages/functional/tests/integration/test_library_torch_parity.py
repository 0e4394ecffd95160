"""shardopt.core's optax-style library against torch optimizer classes with the same method
(pytorch-optimizer, lion-pytorch): a few float32 steps, the params within 1e-6 relative.

Only classes with the same update are compared. pytorch-optimizer's ``Lamb``, ``Adan`` and
``ADOPT`` are other variants of those methods (after 4 steps they differ from optax's, and ours,
by about 2e-1, 1e-2 and 5e-4): they are checked against optax in test_optax_parity.py only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import pytorch_optimizer as po
import torch
from lion_pytorch import Lion

import shardopt.core as so

SHAPES = [(3, 4), (5,)]

CASES: dict[str, tuple[Callable[[], Any], Callable[[list[Any]], torch.optim.Optimizer]]] = {
    "lion_vs_lion_pytorch": (
        lambda: so.lion(1e-2, weight_decay=0.1),
        lambda ps: Lion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    ),
    "lion_vs_pytorch_optimizer": (
        lambda: so.lion(1e-2, weight_decay=0.1),
        lambda ps: po.Lion(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
    ),
    "sign_sgd": (lambda: so.sign_sgd(1e-2), lambda ps: po.SignSGD(ps, lr=1e-2, momentum=0.0)),
    "signum": (lambda: so.signum(1e-2), lambda ps: po.SignSGD(ps, lr=1e-2, momentum=0.9)),
    "yogi": (lambda: so.yogi(1e-2), lambda ps: po.Yogi(ps, lr=1e-2)),
    "ademamix": (
        lambda: so.ademamix(1e-2),
        lambda ps: po.AdEMAMix(ps, lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8),
    ),
    "novograd": (
        lambda: so.novograd(1e-2),
        lambda ps: po.NovoGrad(ps, lr=1e-2, betas=(0.9, 0.25), eps=1e-6),
    ),
    "adabelief": (lambda: so.adabelief(1e-2), lambda ps: po.AdaBelief(ps, lr=1e-2, eps=1e-16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_torch_class_with_the_same_method(name: str) -> None:
    ours, make_torch = CASES[name][0](), CASES[name][1]
    gen = torch.Generator().manual_seed(0)
    p0 = [torch.randn(s, generator=gen) for s in SHAPES]
    torch_params = [torch.nn.Parameter(x.clone()) for x in p0]
    opt = make_torch(torch_params)
    params, state = [x.clone() for x in p0], ours.init(p0)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        updates, state = ours.update(grads, state, params)
        params = so.apply_updates(params, updates)
        for t, g in zip(torch_params, grads):
            t.grad = g.clone()
        opt.step()
        for ours_p, t in zip(params, torch_params):
            ref = t.detach()
            error = float((ours_p - ref).abs().max() / ref.abs().max())
            assert error <= 1e-6, f"{name}: relative error {error:.2e}"
