"""Sign-based optimizers as optax's: ``lion``, ``sign_sgd``, ``signum``, and ``ema``.

All are elementwise (``Kind.ELEMENTWISE``): any cut of the tensors steps exactly. Counts are
per parameter (see [Note: per-parameter step counts]); optax keeps one for the tree, which gives
the same values whenever every parameter has a gradient at every step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count, stateless
from shardopt.core._checks import check_learning_rate, expect
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._moments import bias_correction, decayed_weights, moment, zeros_in
from shardopt.core._schedules import ScalarOrSchedule
from shardopt.core._transforms import scale_by_learning_rate
from shardopt.core._tree import PyTree, leafwise

__all__ = [
    "EmaState",
    "ScaleByLionState",
    "ema",
    "lion",
    "scale_by_lion",
    "scale_by_sign",
    "sign_sgd",
    "signum",
]


def check_decay(api: str, name: str, value: Any) -> None:
    """A coefficient in ``[0, 1]`` (a tensor's value is not read: it may be traced)."""
    if not isinstance(value, torch.Tensor):
        expect(0.0 <= value <= 1.0, api, f"0 <= {name} <= 1", value)


class ScaleByLionState(NamedTuple):
    """Per-parameter counts and Lion's momentum ``mu``."""

    count: PyTree
    mu: PyTree


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None
) -> Transformation:
    """Lion's direction: ``u = sign((1 - b1) g + b1 mu)``, then ``mu' = b2 mu + (1 - b2) g``.

    Example:
        >>> import torch
        >>> tx = scale_by_lion()
        >>> tx.update([torch.tensor([0.5, -2.0, 0.0])], tx.init([torch.zeros(3)]))[0]
        [tensor([ 1., -1.,  0.])]
    """
    check_decay("scale_by_lion", "b1", b1)
    check_decay("scale_by_lion", "b2", b2)

    def init(params: PyTree) -> ScaleByLionState:
        return ScaleByLionState(init_count(params), zeros_in(params, mu_dtype))

    def rule(g: torch.Tensor, p: Any, count: torch.Tensor, mu: torch.Tensor) -> tuple[Any, ...]:
        direction = torch.sign((1 - b1) * g + b1 * mu.to(g.dtype))
        return direction, count + 1, moment(g, mu, b2)

    def update(updates: PyTree, state: ScaleByLionState, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(rule, updates, None, state.count, state.mu)
        return new, ScaleByLionState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_lion")


def lion(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: float = 1e-3,
    mask: Any = None,
) -> Transformation:
    """Lion (Chen et al., 2023), as ``optax.lion``:
    ``p' = p - lr * (sign((1 - b1) g + b1 mu) + weight_decay * p)``,
    ``mu' = b2 mu + (1 - b2) g``. ``mask`` selects the leaves that decay (optax's forms).

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates
        >>> params = [torch.tensor([1.0, -1.0])]
        >>> tx = lion(lr=0.1, weight_decay=0.0)
        >>> u, state = tx.update([torch.tensor([3.0, -0.5])], tx.init(params), params)
        >>> apply_updates(params, u)
        [tensor([ 0.9000, -0.9000])]
    """
    check_learning_rate("lion", lr)
    tx = chain(
        scale_by_lion(b1, b2, mu_dtype),
        decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
    )
    return with_kind(tx, Kind.ELEMENTWISE, "lion")


def scale_by_sign() -> Transformation:
    """Replaces each update element by its sign (-1, 0 or 1).

    Example:
        >>> import torch
        >>> tx = scale_by_sign()
        >>> tx.update([torch.tensor([-3.0, 0.0, 0.2])], tx.init(None))[0]
        [tensor([-1.,  0.,  1.])]
    """

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        return leafwise(lambda g, p: (torch.sign(g),), updates, None)[0]

    return with_kind(stateless(apply), Kind.ELEMENTWISE, "scale_by_sign")


def sign_sgd(lr: ScalarOrSchedule) -> Transformation:
    """signSGD (Bernstein et al., 2018), as ``optax.sign_sgd``: ``p' = p - lr * sign(g)``.

    Example:
        >>> import torch
        >>> tx = sign_sgd(lr=0.5)
        >>> tx.update([torch.tensor([-3.0, 0.2])], tx.init([torch.zeros(2)]))[0]
        [tensor([ 0.5000, -0.5000])]
    """
    check_learning_rate("sign_sgd", lr)
    return with_kind(
        chain(scale_by_sign(), scale_by_learning_rate(lr)), Kind.ELEMENTWISE, "sign_sgd"
    )


def signum(
    lr: ScalarOrSchedule, beta: float = 0.9, accumulator_dtype: torch.dtype | None = None
) -> Transformation:
    """Signum (Bernstein et al., 2018), as ``optax.signum``: ``m' = beta m + (1 - beta) g``,
    ``p' = p - lr * sign(m')`` (the moving average is not debiased: its sign is the same).

    Example:
        >>> import torch
        >>> tx = signum(lr=0.5)
        >>> tx.update([torch.tensor([-3.0, 0.2])], tx.init([torch.zeros(2)]))[0]
        [tensor([ 0.5000, -0.5000])]
    """
    check_learning_rate("signum", lr)
    tx = chain(
        ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
        scale_by_sign(),
        scale_by_learning_rate(lr),
    )
    return with_kind(tx, Kind.ELEMENTWISE, "signum")


class EmaState(NamedTuple):
    """Per-parameter counts and the moving average ``ema`` (not debiased)."""

    count: PyTree
    ema: PyTree


def ema(
    decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None
) -> Transformation:
    """The exponential moving average of the updates, as ``optax.ema``:
    ``e' = decay e + (1 - decay) g``; the update is ``e'``, or ``e' / (1 - decay**t)`` with
    ``debias`` (``t`` the parameter's count of updates, this one included).

    Example:
        >>> import torch
        >>> tx = ema(0.5)
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([2.])]
    """
    check_decay("ema", "decay", decay)

    def init(params: PyTree) -> EmaState:
        return EmaState(init_count(params), zeros_in(params, accumulator_dtype))

    def rule(g: torch.Tensor, p: Any, count: torch.Tensor, avg: torch.Tensor) -> tuple[Any, ...]:
        new = moment(g, avg, decay)
        out = bias_correction(new, decay, count + 1) if debias else new
        return out.to(g.dtype), count + 1, new

    def update(updates: PyTree, state: EmaState, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(rule, updates, None, state.count, state.ema)
        return new, EmaState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "ema")
