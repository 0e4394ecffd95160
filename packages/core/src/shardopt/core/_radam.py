"""RAdam (torch.optim.RAdam): Adam with a rectified adaptive learning rate."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_betas, check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import decays, lr_scalar, operand, prologue, radam_, sqrt_like_python
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = ["ScaleByRadamState", "radam"]


class ScaleByRadamState(NamedTuple):
    """Per-parameter state of :func:`radam` (torch: ``step``, ``exp_avg``, ...)."""

    count: PyTree
    exp_avg: PyTree
    exp_avg_sq: PyTree


# [Note: radam rectification]
# torch.optim.RAdam takes the adaptive step only once the length of the approximated simple
# moving average, rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t), exceeds 5; before, it takes a
# bias-corrected momentum step. rho_t is a function of the count, so we compute both steps and
# pick with ``torch.where`` (no Python branch on a tensor: it traces under torch.func). The
# rectification ratio is replaced by 1 where it is not used: it may be negative there, and a NaN
# in the unused branch would still poison gradients through ``where``.


@dataclass(frozen=True, slots=True)
class RadamHyperparams:
    """The validated hyperparameters of :func:`radam` (read by its piece rule)."""

    lr: ScalarOrSchedule
    betas: tuple[float, float]
    eps: float
    weight_decay: float | torch.Tensor
    decoupled_weight_decay: bool
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("radam", self.lr)
        expect(self.eps >= 0.0, "radam", "0 <= eps", self.eps)
        check_betas("radam", self.betas)
        check_weight_decay("radam", self.weight_decay)


def _radam_step(hp: RadamHyperparams) -> Transformation:
    """Moments, then torch's step ``p - X`` with X the rectified or the plain momentum step.

    ``X = m_hat * lr * sqrt(1 - beta2**t) / (sqrt(v) + eps) * rect`` once rho_t > 5, else
    ``m_hat * lr``, in torch's order (see [Note: radam rectification]); with decoupled weight
    decay ``p`` is first multiplied by ``1 - lr * weight_decay`` and we return ``q - p`` (see
    [Note: torch's parameter rounding]).
    """
    beta1, beta2 = hp.betas
    rho_inf = 2 / (1 - beta2) - 1
    decay = hp.decoupled_weight_decay and decays(hp.weight_decay)

    def init(params: PyTree) -> ScaleByRadamState:
        zeros = zeros_like_tree
        return ScaleByRadamState(init_count(params), zeros(params), zeros(params))

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> tuple[Any, ...]:
        lr = lr_scalar(resolve(hp.lr, count), g)
        step = count.to(torch.float64) + 1
        exp_avg = torch.lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = (exp_avg_sq * beta2).addcmul(g, g, value=1 - beta2)
        bias_correction2 = 1 - beta2**step
        corrected = exp_avg / operand(1 - beta1**step, g)
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        rectified = rho_t > 5.0
        ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        rect = operand(sqrt_like_python(torch.where(rectified, ratio, 1.0)), g)
        root = operand(sqrt_like_python(bias_correction2), g)
        adaptive = exp_avg_sq.sqrt().add(hp.eps).reciprocal() * root
        lr_g = operand(lr, g)
        x = torch.where(rectified, corrected * lr_g * adaptive * rect, corrected * lr_g)
        if not decay:
            return -x, count + 1, exp_avg, exp_avg_sq
        q = p * operand(1 - lr * hp.weight_decay, g) - x
        return q - p, count + 1, exp_avg, exp_avg_sq

    def update(
        updates: PyTree, state: ScaleByRadamState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByRadamState]:
        if params is None and decay:
            raise ValueError("radam: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByRadamState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "radam")


def radam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.RAdam`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param`` unless
    ``decoupled_weight_decay`` (RAdamW)] -> one transformation for the moments and the step, which
    reproduces torch's rounding of the parameters (see [Note: torch's parameter rounding]).
    ``lr`` may be a float, a 0-d tensor or a schedule of the per-parameter count. It has a flat
    fast path (``update_pieces_``) on foreach kernels.

    Example:
        >>> import torch
        >>> tx = radam(lr=0.1)
        >>> params = [torch.ones(2)]
        >>> tx.update([torch.ones(2)], tx.init(params), params)[0]
        [tensor([-0.1000, -0.1000])]

    Raises:
        ValueError: for a negative ``lr``, ``eps`` or ``weight_decay``, or a beta outside [0, 1).
    """
    hp = RadamHyperparams(lr, betas, eps, weight_decay, decoupled_weight_decay, maximize)
    links = prologue(maximize, 0.0 if decoupled_weight_decay else weight_decay)
    tx = chain(*links, _radam_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(radam_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "radam"
    )
