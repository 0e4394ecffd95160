"""Adadelta (torch.optim.Adadelta): steps scaled by the ratio of two moving RMS averages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import adadelta_, add_like_torch, prologue
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = ["ScaleByAdadeltaState", "adadelta"]


class ScaleByAdadeltaState(NamedTuple):
    """Per-parameter state of :func:`adadelta` (torch: ``step``, ``square_avg``, ...)."""

    count: PyTree
    square_avg: PyTree
    acc_delta: PyTree


@dataclass(frozen=True, slots=True)
class AdadeltaHyperparams:
    """The validated hyperparameters of :func:`adadelta` (read by its piece rule)."""

    lr: ScalarOrSchedule
    rho: float
    eps: float
    weight_decay: float | torch.Tensor
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("adadelta", self.lr)
        expect(0.0 <= self.rho <= 1.0, "adadelta", "0 <= rho <= 1", self.rho)
        expect(self.eps >= 0.0, "adadelta", "0 <= eps", self.eps)
        check_weight_decay("adadelta", self.weight_decay)


def _adadelta_step(hp: AdadeltaHyperparams) -> Transformation:
    """Moving averages of squared gradients and steps, then torch's ``p.add_(delta, alpha=-lr)``.

    ``delta = sqrt(u + eps) / sqrt(v + eps) * g``; we return ``q - p`` for torch's fused result
    ``q`` (see [Note: torch's parameter rounding]).
    """
    rho, eps = hp.rho, hp.eps

    def init(params: PyTree) -> ScaleByAdadeltaState:
        zeros = zeros_like_tree
        return ScaleByAdadeltaState(init_count(params), zeros(params), zeros(params))

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        square_avg: torch.Tensor,
        acc_delta: torch.Tensor,
    ) -> tuple[Any, ...]:
        lr = resolve(hp.lr, count)
        square_avg = (square_avg * rho).addcmul(g, g, value=1 - rho)
        std = square_avg.add(eps).sqrt()
        delta = acc_delta.add(eps).sqrt().div(std).mul(g)
        acc_delta = (acc_delta * rho).addcmul(delta, delta, value=1 - rho)
        return add_like_torch(p, delta, -lr) - p, count + 1, square_avg, acc_delta

    def update(
        updates: PyTree, state: ScaleByAdadeltaState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdadeltaState]:
        if params is None:
            raise ValueError("adadelta: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByAdadeltaState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "adadelta")


def adadelta(
    lr: ScalarOrSchedule = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.Adadelta`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param``] -> one transformation for
    the averages and the step, which reproduces torch's rounding of the parameters (see [Note:
    torch's parameter rounding]). ``lr`` may be a float, a 0-d tensor or a schedule of the
    per-parameter count. It has a piece fast path (``update_pieces_``) on foreach kernels.

    Example:
        >>> import torch
        >>> tx = adadelta(rho=0.0, eps=1.0)
        >>> params = [torch.ones(2)]
        >>> tx.update([torch.full((2,), 3.0)], tx.init(params), params)[0]
        [tensor([-0.9487, -0.9487])]

    Raises:
        ValueError: for a negative ``lr``, ``eps`` or ``weight_decay``, or ``rho`` outside [0, 1].
    """
    hp = AdadeltaHyperparams(lr, rho, eps, weight_decay, maximize)
    links = prologue(maximize, weight_decay)
    tx = chain(*links, _adadelta_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(adadelta_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "adadelta"
    )
