"""Adam-like optimizers as optax's: ``adabelief``, ``yogi``, ``adan``, ``ademamix``, ``adopt``.

All are elementwise (``Kind.ELEMENTWISE``). Each moment is an exponential moving average
(:func:`~shardopt.core.blocks.update_moment`), debiased by ``1 - b**t`` where optax debiases,
``t`` the parameter's count of updates with this one (see [Note: per-parameter step counts]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._moments import decayed_weights, moment, moment_per_elem_norm, zeros_in
from shardopt.core._optax_sign import check_decay
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._transforms import scale_by_learning_rate
from shardopt.core._tree import PyTree, leafwise

__all__ = [
    "ScaleByAdanState",
    "ScaleByAdemamixState",
    "ScaleByMomentsState",
    "adabelief",
    "adan",
    "ademamix",
    "adopt",
    "yogi",
]


class ScaleByMomentsState(NamedTuple):
    """Per-parameter counts, first moments ``mu`` and second moments ``nu``."""

    count: PyTree
    mu: PyTree
    nu: PyTree


def debias(m: torch.Tensor, decay: Any, t: torch.Tensor) -> torch.Tensor:
    """``m / (1 - decay**t)`` for one leaf."""
    return m / (1 - decay**t).to(m.dtype)


def moments_step(
    name: str, rule: Callable[..., tuple[Any, ...]], init_value: float = 0.0, mu_dtype: Any = None
) -> Transformation:
    """An elementwise transformation over ``ScaleByMomentsState`` whose leaf rule is
    ``rule(g, count, mu, nu) -> (update, mu', nu')``."""

    def init(params: PyTree) -> ScaleByMomentsState:
        mu, nu = zeros_in(params, mu_dtype, init_value), zeros_in(params, None, init_value)
        return ScaleByMomentsState(init_count(params), mu, nu)

    def leaf(g: torch.Tensor, p: Any, count: torch.Tensor, mu: Any, nu: Any) -> tuple[Any, ...]:
        out, mu, nu = rule(g, count, mu, nu)
        return out.to(g.dtype), count + 1, mu, nu

    def update(updates: PyTree, state: ScaleByMomentsState, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(leaf, updates, None, state.count, state.mu, state.nu)
        return new, ScaleByMomentsState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, name)


def scale_by_adam_root(b1: float, b2: float, eps: float, eps_root: float) -> Transformation:
    """optax's ``scale_by_adam``: ``m_hat / (sqrt(v_hat + eps_root) + eps)``."""

    def rule(g: torch.Tensor, count: torch.Tensor, mu: Any, nu: Any) -> tuple[Any, ...]:
        mu, nu, t = moment(g, mu, b1), moment_per_elem_norm(g, nu, b2, 2), count + 1
        return debias(mu, b1, t) / ((debias(nu, b2, t) + eps_root).sqrt() + eps), mu, nu

    return moments_step("scale_by_adam", rule)


def adabelief(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    nesterov: bool = False,
) -> Transformation:
    """AdaBelief (Zhuang et al., 2020), as ``optax.adabelief``: ``m' = ema_b1(g)``,
    ``s' = ema_b2((g - m')**2) + eps_root``, ``p' = p - lr * m_hat / (sqrt(s_hat) + eps)``
    (hats debiased; with ``nesterov``, ``m_hat = b1 m'/(1-b1**(t+1)) + (1-b1) g/(1-b1**t)``).

    Example:
        >>> import torch
        >>> tx = adabelief(lr=0.1)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-0.1111])]
    """
    check_learning_rate("adabelief", lr)
    check_decay("adabelief", "b1", b1)
    check_decay("adabelief", "b2", b2)

    def rule(g: torch.Tensor, count: torch.Tensor, mu: Any, nu: Any) -> tuple[Any, ...]:
        mu, t = moment(g, mu, b1), count + 1
        nu = moment_per_elem_norm(g - mu, nu, b2, 2) + eps_root
        mu_hat = debias(mu, b1, t)
        if nesterov:
            mu_hat = b1 * debias(mu, b1, t + 1) + (1 - b1) * debias(g, b1, t)
        return mu_hat / (debias(nu, b2, t).sqrt() + eps), mu, nu

    tx = chain(moments_step("scale_by_belief", rule), scale_by_learning_rate(lr))
    return with_kind(tx, Kind.ELEMENTWISE, "adabelief")


def yogi(
    lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3
) -> Transformation:
    """Yogi (Zaheer et al., 2018), as ``optax.yogi``: moments start at 1e-6,
    ``m' = ema_b1(g)``, ``v' = v - (1 - b2) sign(v - g**2) g**2``,
    ``p' = p - lr * m_hat / (sqrt(v_hat) + eps)`` (hats debiased by ``1 - b**t``).

    Example:
        >>> import torch
        >>> tx = yogi(lr=0.1)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-0.0999])]
    """
    check_learning_rate("yogi", lr)
    check_decay("yogi", "b1", b1)
    check_decay("yogi", "b2", b2)

    def rule(g: torch.Tensor, count: torch.Tensor, mu: Any, nu: Any) -> tuple[Any, ...]:
        mu, t, sq = moment(g, mu, b1), count + 1, g * g
        nu = nu - (1 - b2) * torch.sign(nu - sq) * sq
        return debias(mu, b1, t) / (debias(nu, b2, t).sqrt() + eps), mu, nu

    tx = chain(moments_step("scale_by_yogi", rule, init_value=1e-6), scale_by_learning_rate(lr))
    return with_kind(tx, Kind.ELEMENTWISE, "yogi")


class ScaleByAdanState(NamedTuple):
    """Per-parameter counts; Adan's moments ``m`` (gradients), ``v`` (their differences),
    ``n`` (squares) and the previous gradient ``g``."""

    count: PyTree
    m: PyTree
    v: PyTree
    n: PyTree
    g: PyTree


def scale_by_adan(b1: float, b2: float, b3: float, eps: float, eps_root: float) -> Transformation:
    """Adan's direction (see :func:`adan`)."""

    def init(params: PyTree) -> ScaleByAdanState:
        return ScaleByAdanState(init_count(params), *(zeros_in(params) for _ in range(4)))

    def rule(g: torch.Tensor, p: Any, count: Any, m: Any, v: Any, n: Any, prev: Any) -> Any:
        diff = torch.where(count == 0, torch.zeros_like(g), g - prev)
        m, v, t = moment(g, m, b1), moment(diff, v, b2), count + 1
        n = moment_per_elem_norm(g + (1 - b2) * diff, n, b3, 2)
        direction = debias(m, b1, t) + (1 - b2) * debias(v, b2, t)
        return direction / ((debias(n, b3, t) + eps_root).sqrt() + eps), t, m, v, n, g

    def update(updates: PyTree, state: ScaleByAdanState, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(rule, updates, None, *state)
        return new, ScaleByAdanState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_adan")


def adan(
    lr: ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    eps_root: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> Transformation:
    """Adan (Xie et al., 2022), as ``optax.adan``: with ``d = g - g_prev`` (0 at the first
    step), ``m' = ema_b1(g)``, ``v' = ema_b2(d)``, ``n' = ema_b3((g + (1 - b2) d)**2)`` and
    ``p' = p - lr * ((m_hat + (1 - b2) v_hat) / (sqrt(n_hat + eps_root) + eps) + wd * p)``.

    Example:
        >>> import torch
        >>> tx = adan(lr=0.1)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-0.1000])]
    """
    check_learning_rate("adan", lr)
    for name, b in (("b1", b1), ("b2", b2), ("b3", b3)):
        check_decay("adan", name, b)
    tx = chain(
        scale_by_adan(b1, b2, b3, eps, eps_root),
        decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
    )
    return with_kind(tx, Kind.ELEMENTWISE, "adan")


class ScaleByAdemamixState(NamedTuple):
    """Per-parameter counts; the fast and slow moving averages ``m1``, ``m2`` and ``nu``."""

    count: PyTree
    m1: PyTree
    m2: PyTree
    nu: PyTree


def scale_by_ademamix(
    b1: float, b2: float, b3: ScalarOrSchedule, alpha: ScalarOrSchedule, eps: float,
    eps_root: float, mu_dtype: Any,
) -> Transformation:  # fmt: skip
    """AdEMAMix's direction (see :func:`ademamix`)."""

    def init(params: PyTree) -> ScaleByAdemamixState:
        m1, m2, nu = (zeros_in(params, mu_dtype) for _ in range(3))
        return ScaleByAdemamixState(init_count(params), m1, m2, nu)

    def rule(g: torch.Tensor, p: Any, count: Any, m1: Any, m2: Any, nu: Any) -> Any:
        c_b3, c_alpha, t = resolve(b3, count), resolve(alpha, count), count + 1
        m1, m2 = moment(g, m1, b1), moment(g, m2, c_b3)
        nu = moment_per_elem_norm(g, nu, b2, 2)
        out = (debias(m1, b1, t) + c_alpha * m2) / ((debias(nu, b2, t) + eps_root).sqrt() + eps)
        return out.to(g.dtype), t, m1, m2, nu

    def update(updates: PyTree, state: ScaleByAdemamixState, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(rule, updates, None, *state)
        return new, ScaleByAdemamixState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_ademamix")


def ademamix(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> Transformation:
    """AdEMAMix (Pagliardini et al., 2024), as ``optax.contrib.ademamix``: a fast and a slow
    moving average, ``m1' = ema_b1(g)``, ``m2' = ema_b3(g)`` (not debiased), ``nu' = ema_b2(g**2)``,
    ``p' = p - lr * ((m1_hat + alpha m2') / (sqrt(nu_hat + eps_root) + eps) + wd * p)``.
    ``b3`` and ``alpha`` may be schedules of the count.

    Example:
        >>> import torch
        >>> tx = ademamix(lr=0.1)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([-0.1000])]
    """
    check_learning_rate("ademamix", lr)
    for name, b in (("b1", b1), ("b2", b2)):
        check_decay("ademamix", name, b)
    tx = chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
        decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
    )
    return with_kind(tx, Kind.ELEMENTWISE, "ademamix")


def _quarter_power(count: torch.Tensor) -> torch.Tensor:
    return count**0.25


def adopt(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.9999,
    eps: float = 1e-6,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[torch.Tensor], Any] = _quarter_power,
) -> Transformation:
    """ADOPT (Taniguchi et al., 2024), as ``optax.contrib.adopt``: the step normalizes ``g`` by
    the second moment *before* it sees ``g``: ``s = clip(g / max(sqrt(v), eps), +-c(t))`` with
    ``c(t) = clip_value_fn(t) = t**0.25``, ``m' = b1 m + (1 - b1) s``,
    ``v' = b2 v + (1 - b2) g**2``; the first step only sets ``v = g**2`` (its update is 0).
    ``p' = p - lr * m'`` (with ``nesterov``, ``p' = p - lr * (b1 m' + (1 - b1) s)``).

    Example:
        >>> import torch
        >>> tx = adopt(lr=0.1)
        >>> u, state = tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))
        >>> u, tx.update([torch.tensor([2.0])], state)[0]
        ([tensor([-0.])], [tensor([-0.0100])])
    """
    check_learning_rate("adopt", lr)
    check_decay("adopt", "b1", b1)
    check_decay("adopt", "b2", b2)

    def rule(g: torch.Tensor, count: torch.Tensor, mu: Any, nu: Any) -> tuple[Any, ...]:
        first = count == 0
        normed = g / torch.clamp(nu.sqrt(), min=eps)
        if use_clipping:
            bound = torch.as_tensor(clip_value_fn(count), dtype=g.dtype, device=g.device)
            normed = torch.clamp(normed, -bound, bound)
        nu = moment_per_elem_norm(g, nu, torch.where(first, 0.0, b2), 2)
        b1_now = torch.where(first, 1.0, b1)
        mu = moment(normed, mu, b1_now)
        out = moment(normed, mu, b1_now) if nesterov else mu
        return out, mu, nu

    tx = chain(moments_step("scale_by_adopt", rule, mu_dtype=mu_dtype), scale_by_learning_rate(lr))
    return with_kind(tx, Kind.ELEMENTWISE, "adopt")
