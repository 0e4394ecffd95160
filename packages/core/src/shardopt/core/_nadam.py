"""NAdam (torch.optim.NAdam): Adam with Nesterov momentum and a momentum-decay schedule."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_betas, check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import decays, lr_scalar, nadam_, operand, prologue
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, tree_map, zeros_like_tree

__all__ = ["ScaleByNadamState", "nadam"]


class ScaleByNadamState(NamedTuple):
    """Per-parameter state of :func:`nadam` (torch: ``step``, ``mu_product``, ...)."""

    count: PyTree
    mu_product: PyTree
    exp_avg: PyTree
    exp_avg_sq: PyTree


# [Note: nadam mu_product]
# torch keeps ``mu_product``, the running product of the momentum coefficients mu_t, as a float32
# 0-d tensor (like ``step``) and multiplies it in place by the Python float mu_t, that is in
# float32 by mu_t rounded to float32. Its step sizes then read the float32 product as a double.
# We keep the same float32 product, multiplied the same way, so float64 runs agree with torch to
# 1e-12 (a float64 product would differ from torch's by float32 rounding, ~1e-8).


def _init_mu_product(params: PyTree) -> PyTree:
    return tree_map(
        lambda p: None if p is None else torch.ones((), dtype=torch.float32, device=p.device),
        params,
    )


@dataclass(frozen=True, slots=True)
class NadamHyperparams:
    """The validated hyperparameters of :func:`nadam` (read by its piece rule)."""

    lr: ScalarOrSchedule
    betas: tuple[float, float]
    eps: float
    weight_decay: float | torch.Tensor
    momentum_decay: float
    decoupled_weight_decay: bool
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("nadam", self.lr)
        expect(self.eps >= 0.0, "nadam", "0 <= eps", self.eps)
        check_betas("nadam", self.betas)
        expect(self.momentum_decay >= 0.0, "nadam", "0 <= momentum_decay", self.momentum_decay)
        check_weight_decay("nadam", self.weight_decay)


def _momentum_coefficient(beta1: float, step: torch.Tensor, momentum_decay: float) -> torch.Tensor:
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def _nadam_step(hp: NadamHyperparams) -> Transformation:
    """Moments and ``mu_product``, then torch's two ``addcdiv_`` steps (one transformation).

    With ``mu_t = beta1 * (1 - 0.5 * 0.96**(t * momentum_decay))`` and ``P_t`` the product of
    ``mu_1..mu_t``: ``p += -lr (1 - mu_t) / (1 - P_t) * g / d``, then
    ``p += -lr mu_{t+1} / (1 - P_t mu_{t+1}) * m / d`` with ``d = sqrt(v / (1 - beta2**t)) + eps``,
    after ``p *= 1 - lr * weight_decay`` if decoupled. We return ``q - p`` for torch's result
    ``q`` (see [Note: torch's parameter rounding]).
    """
    beta1, beta2 = hp.betas
    decay = hp.decoupled_weight_decay and decays(hp.weight_decay)

    def init(params: PyTree) -> ScaleByNadamState:
        zeros = zeros_like_tree
        return ScaleByNadamState(
            init_count(params), _init_mu_product(params), zeros(params), zeros(params)
        )

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        mu_product: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> tuple[Any, ...]:
        lr = lr_scalar(resolve(hp.lr, count), g)
        step = count.to(torch.float64) + 1
        mu = _momentum_coefficient(beta1, step, hp.momentum_decay)
        mu_next = _momentum_coefficient(beta1, step + 1, hp.momentum_decay)
        mu_product = mu_product * mu.to(mu_product.dtype)
        exp_avg = torch.lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = (exp_avg_sq * beta2).addcmul(g, g, value=1 - beta2)
        denom = exp_avg_sq.div(operand(1 - beta2**step, g)).sqrt().add(hp.eps)
        product = mu_product.to(torch.float64)
        grad_size = -lr * (1.0 - mu).to(lr.dtype) / (1.0 - product).to(lr.dtype)
        avg_size = (-lr * mu_next.to(lr.dtype)) / (1.0 - product * mu_next).to(lr.dtype)
        q = p * operand(1 - lr * hp.weight_decay, g) if decay else p
        q = q + (g * operand(grad_size, g)) / denom  # torch's addcdiv_: p + (value * t1) / t2
        q = q + (exp_avg * operand(avg_size, g)) / denom
        return q - p, count + 1, mu_product, exp_avg, exp_avg_sq

    def update(
        updates: PyTree, state: ScaleByNadamState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByNadamState]:
        if params is None:
            raise ValueError("nadam: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByNadamState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "nadam")


def nadam(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.NAdam`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param`` unless
    ``decoupled_weight_decay`` (NAdamW)] -> one transformation for the moments and the step, which
    reproduces torch's rounding of the parameters (see [Note: torch's parameter rounding]).
    ``lr`` may be a float, a 0-d tensor or a schedule of the per-parameter count. It has a flat
    fast path (``update_pieces_``) on foreach kernels.

    Example:
        >>> import torch
        >>> tx = nadam(lr=0.1)
        >>> params = [torch.ones(2)]
        >>> tx.update([torch.ones(2)], tx.init(params), params)[0]
        [tensor([-0.1056, -0.1056])]

    Raises:
        ValueError: for a negative ``lr``, ``eps``, ``weight_decay`` or ``momentum_decay``, or a
            beta outside [0, 1).
    """
    hp = NadamHyperparams(
        lr, betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize
    )
    links = prologue(maximize, 0.0 if decoupled_weight_decay else weight_decay)
    tx = chain(*links, _nadam_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(nadam_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "nadam"
    )
