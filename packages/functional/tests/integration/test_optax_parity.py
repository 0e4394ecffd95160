"""shardopt.core's optax-style library against optax itself (CPU jax, float32).

Each case runs a few steps of one of our transformations and of optax's on the same params and
gradients, each applying its own updates, and compares every update within ~1e-6 relative
(``RTOL``; ``ATOL`` is 1e-6 of the update's largest element, for elements that cancel to ~0).
Known differences, tested as such: optax's JAX layouts put a Linear's output units last, ours
(torch's) first, so ``adaptive_grad_clip`` on a torch ``(out, in)`` weight is compared with
optax on its transpose; ``add_noise`` draws from torch's generator, not JAX's, so only its
variance schedule is compared.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
import torch

import shardopt.core as so

RTOL = 1e-6
SHAPES = [(3, 4), (5,)]


def _arrays(rng: np.random.Generator, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _close(ours: Any, theirs: Any, what: str) -> None:
    a, b = np.asarray(ours), np.asarray(theirs)
    atol = 1e-6 * max(float(np.abs(b).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=what)


def _run(ours: Any, theirs: Any, grads: Any = None, *, on_params: bool = False) -> tuple[Any, Any]:
    """Steps both; compares each update (the new params, for a case in ``ON_PARAMS``) and
    returns the final (ours, optax's) states."""
    rng = np.random.default_rng(0)
    p0 = _arrays(rng, SHAPES)
    seq = grads if grads is not None else [_arrays(rng, SHAPES) for _ in range(4)]
    tp, jp = [torch.tensor(x) for x in p0], [jnp.asarray(x) for x in p0]
    ts, js = ours.init(tp), theirs.init(jp)
    for k, g in enumerate(seq):
        tu, ts = ours.update([torch.tensor(x) for x in g], ts, tp)
        ju, js = theirs.update([jnp.asarray(x) for x in g], js, jp)
        new_tp, new_jp = so.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        pairs = zip(new_tp, new_jp) if on_params else zip(tu, ju)
        for i, (a, b) in enumerate(pairs):
            _close(a.numpy(), b, f"step {k}, leaf {i}")
        tp, jp = new_tp, new_jp
    return ts, js


def _alpha_ours(c: torch.Tensor) -> torch.Tensor:
    return 5.0 * torch.clamp(c / 3.0, max=1.0)


def _alpha_optax(c: Any) -> Any:
    return 5.0 * jnp.minimum(c / 3.0, 1.0)


ox = optax
cx = optax.contrib
CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "lion": (lambda: so.lion(1e-2, weight_decay=1e-2), lambda: ox.lion(1e-2, weight_decay=1e-2)),
    "lion_masked_decay": (
        lambda: so.lion(1e-2, weight_decay=0.1, mask=[True, False]),
        lambda: ox.lion(1e-2, weight_decay=0.1, mask=[True, False]),
    ),
    "lamb": (lambda: so.lamb(1e-2, weight_decay=1e-2), lambda: ox.lamb(1e-2, weight_decay=1e-2)),
    "lars": (
        lambda: so.lars(0.1, weight_decay=1e-3, trust_coefficient=0.01),
        lambda: ox.lars(0.1, weight_decay=1e-3, trust_coefficient=0.01),
    ),
    "lars_nesterov_masked": (
        lambda: so.lars(0.1, 1e-3, [True, False], nesterov=True, trust_ratio_mask=[True, False]),
        lambda: ox.lars(0.1, 1e-3, [True, False], nesterov=True, trust_ratio_mask=[True, False]),
    ),
    "adabelief": (lambda: so.adabelief(1e-2), lambda: ox.adabelief(1e-2)),
    "adabelief_nesterov": (
        lambda: so.adabelief(1e-2, nesterov=True),
        lambda: ox.adabelief(1e-2, nesterov=True),
    ),
    "yogi": (lambda: so.yogi(1e-2), lambda: ox.yogi(1e-2)),
    "novograd": (
        lambda: so.novograd(1e-2, weight_decay=1e-3),
        lambda: ox.novograd(1e-2, weight_decay=1e-3),
    ),
    "adan": (lambda: so.adan(1e-2, weight_decay=1e-2), lambda: ox.adan(1e-2, weight_decay=1e-2)),
    "sign_sgd": (lambda: so.sign_sgd(0.1), lambda: ox.sign_sgd(0.1)),
    "signum": (lambda: so.signum(0.1), lambda: ox.signum(0.1)),
    "ademamix": (
        lambda: so.ademamix(1e-2, weight_decay=1e-3),
        lambda: cx.ademamix(1e-2, weight_decay=1e-3),
    ),
    "ademamix_alpha_schedule": (
        lambda: so.ademamix(1e-2, alpha=_alpha_ours),
        lambda: cx.ademamix(1e-2, alpha=_alpha_optax),
    ),
    "adopt": (lambda: so.adopt(1e-2), lambda: cx.adopt(1e-2)),
    "adopt_nesterov": (
        lambda: so.adopt(1e-2, nesterov=True),
        lambda: cx.adopt(1e-2, nesterov=True),
    ),
    "adopt_no_clipping": (
        lambda: so.adopt(1e-2, use_clipping=False),
        lambda: cx.adopt(1e-2, use_clipping=False),
    ),
    "schedule_free_adamw": (
        lambda: so.schedule_free_adamw(1e-2, weight_decay=1e-3),
        lambda: cx.schedule_free_adamw(1e-2, weight_decay=1e-3),
    ),
    "scale_by_trust_ratio": (
        lambda: so.scale_by_trust_ratio(min_norm=0.1, trust_coefficient=0.5, eps=1e-3),
        lambda: ox.scale_by_trust_ratio(min_norm=0.1, trust_coefficient=0.5, eps=1e-3),
    ),
    "clip_by_block_rms": (lambda: so.clip_by_block_rms(0.5), lambda: ox.clip_by_block_rms(0.5)),
    "centralize": (lambda: so.centralize(), lambda: ox.centralize()),
    "ema": (lambda: so.ema(0.9), lambda: ox.ema(0.9)),
    "ema_biased": (lambda: so.ema(0.9, debias=False), lambda: ox.ema(0.9, debias=False)),
    "adaptive_grad_clip_vectors_and_axis": (
        lambda: so.adaptive_grad_clip(0.05, axis=0),
        lambda: ox.adaptive_grad_clip(0.05, axis=0),
    ),
}


# Schedule-free's update is the difference of two parameter vectors of order 1, so the last
# bit of each shows as ~1e-5 of the update: its new parameters are compared instead.
ON_PARAMS = {"schedule_free_adamw"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax(name: str) -> None:
    ours, theirs = CASES[name]
    _run(ours(), theirs(), on_params=name in ON_PARAMS)


def test_adaptive_grad_clip_units_are_torch_rows_where_optax_takes_columns() -> None:
    """Ours on a torch (out, in) weight is optax's on the JAX (in, out) transpose."""
    rng = np.random.default_rng(1)
    g, p = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3))
    p = p.astype(np.float32)
    g[0] *= 50.0  # one unit clipped, the others not
    ours = so.adaptive_grad_clip(0.1)
    theirs = ox.adaptive_grad_clip(0.1)
    tu = ours.update([torch.tensor(g)], ours.init(None), [torch.tensor(p)])[0][0]
    ju = theirs.update([jnp.asarray(g.T)], theirs.init(None), [jnp.asarray(p.T)])[0][0]
    _close(tu.numpy(), np.asarray(ju).T, "adaptive_grad_clip")
    assert not np.allclose(tu.numpy(), g)


def test_lookahead_fast_weights_match_optax() -> None:
    rng = np.random.default_rng(2)
    p0 = _arrays(rng, SHAPES)
    ours = so.lookahead(so.lion(1e-2), sync_period=3, slow_step_size=0.5)
    theirs = ox.lookahead(ox.lion(1e-2), sync_period=3, slow_step_size=0.5)
    tp = [torch.tensor(x) for x in p0]
    jp = ox.LookaheadParams.init_synced([jnp.asarray(x) for x in p0])
    ts, js = ours.init(tp), theirs.init(jp)
    for k in range(7):
        g = _arrays(rng, SHAPES)
        tu, ts = ours.update([torch.tensor(x) for x in g], ts, tp)
        ju, js = theirs.update([jnp.asarray(x) for x in g], js, jp)
        tp, jp = so.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        for i, (a, b) in enumerate(zip(tp, jp.fast)):
            _close(a.numpy(), b, f"fast params, step {k}, leaf {i}")
        for i, (a, b) in enumerate(zip(ts.slow, jp.slow)):
            _close(a.numpy(), b, f"slow params, step {k}, leaf {i}")


def _with_bad(value: float) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(3)
    seq = [_arrays(rng, SHAPES) for _ in range(6)]
    for k in (1, 3, 4):
        seq[k][1][2] = value
    return seq


def test_apply_if_finite_matches_optax() -> None:
    ts, js = _run(
        so.apply_if_finite(so.lion(1e-2), 1),
        ox.apply_if_finite(ox.lion(1e-2), 1),
        grads=_with_bad(float("inf")),
    )
    assert int(ts.notfinite_count) == int(js.notfinite_count)
    assert int(ts.total_notfinite) == int(js.total_notfinite) == 3


def test_zero_nans_matches_optax() -> None:
    ts, js = _run(so.zero_nans(), ox.zero_nans(), grads=_with_bad(float("nan"))[:2])
    assert [bool(x) for x in ts.found_nan] == [bool(x) for x in js.found_nan] == [False, True]


def test_add_noise_variance_schedule_matches_optax() -> None:
    """Different random streams (torch's, JAX's), one law: std ``sqrt(eta / t**gamma)``."""
    shape, eta, gamma = (20000,), 0.5, 0.55
    ours, theirs = so.add_noise(eta, gamma, key=0), ox.add_noise(eta, gamma, key=0)
    ts, js = ours.init([torch.zeros(shape)]), theirs.init([jnp.zeros(shape)])
    for t in (1, 2, 3):
        tu, ts = ours.update([torch.zeros(shape)], ts)
        ju, js = theirs.update([jnp.zeros(shape)], js)
        expected = (eta / t**gamma) ** 0.5
        assert abs(float(tu[0].std()) / expected - 1) < 0.03
        assert abs(float(np.asarray(ju[0]).std()) / expected - 1) < 0.03
