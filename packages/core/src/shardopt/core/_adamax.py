"""Adamax (torch.optim.Adamax): Adam with an exponentially weighted infinity norm."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_betas, check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import adamax_, lr_scalar, operand, prologue
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = ["ScaleByAdamaxState", "adamax"]


class ScaleByAdamaxState(NamedTuple):
    """Per-parameter state of :func:`adamax` (torch: ``step``, ``exp_avg``, ...)."""

    count: PyTree
    exp_avg: PyTree
    exp_inf: PyTree


@dataclass(frozen=True, slots=True)
class AdamaxHyperparams:
    """The validated hyperparameters of :func:`adamax` (read by its piece rule)."""

    lr: ScalarOrSchedule
    betas: tuple[float, float]
    eps: float
    weight_decay: float | torch.Tensor
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("adamax", self.lr)
        expect(self.eps >= 0.0, "adamax", "0 <= eps", self.eps)
        check_betas("adamax", self.betas)
        check_weight_decay("adamax", self.weight_decay)


def _adamax_step(hp: AdamaxHyperparams) -> Transformation:
    """Moments, then torch's ``addcdiv_`` step ``p + (-lr / (1 - beta1**t) * m) / u``.

    ``u`` is the exponentially weighted infinity norm. The bias-corrected step size is computed
    like torch's (see [Note: torch's parameter rounding]), so the parameters are bitwise equal.
    """
    beta1, beta2 = hp.betas

    def init(params: PyTree) -> ScaleByAdamaxState:
        zeros = zeros_like_tree
        return ScaleByAdamaxState(init_count(params), zeros(params), zeros(params))

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_inf: torch.Tensor,
    ) -> tuple[Any, ...]:
        lr = lr_scalar(resolve(hp.lr, count), g)
        step = count.to(torch.float64) + 1
        exp_avg = torch.lerp(exp_avg, g, 1 - beta1)
        exp_inf = torch.maximum(exp_inf * beta2, g.abs().add(hp.eps))
        step_size = lr / (1 - beta1**step).to(lr.dtype)
        return (exp_avg * operand(-step_size, g)) / exp_inf, count + 1, exp_avg, exp_inf

    def update(
        updates: PyTree, state: ScaleByAdamaxState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdamaxState]:
        del params
        new, parts = leafwise(rule, updates, None, *state)
        return new, ScaleByAdamaxState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "adamax")


def adamax(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.Adamax`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param``] -> one transformation for
    the moments and the step, which reproduces torch's rounding of the parameters (see [Note:
    torch's parameter rounding]). ``lr`` may be a float, a 0-d tensor or a schedule of the
    per-parameter count. It has a piece fast path (``update_pieces_``) on foreach kernels.

    Example:
        >>> import torch
        >>> tx = adamax(lr=0.1)
        >>> params = [torch.ones(2)]
        >>> tx.update([torch.ones(2)], tx.init(params), params)[0]
        [tensor([-0.1000, -0.1000])]

    Raises:
        ValueError: for a negative ``lr``, ``eps`` or ``weight_decay``, or a beta outside [0, 1).
    """
    hp = AdamaxHyperparams(lr, betas, eps, weight_decay, maximize)
    links = prologue(maximize, weight_decay)
    tx = chain(*links, _adamax_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(adamax_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "adamax"
    )
