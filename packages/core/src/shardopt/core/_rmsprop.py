"""RMSprop (torch.optim.RMSprop): scale by the root of a moving average of squared gradients."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import add_like_torch, operand, prologue, rmsprop_
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = ["ScaleByRmsState", "rmsprop"]


class ScaleByRmsState(NamedTuple):
    """Per-parameter state of :func:`rmsprop` (torch: ``step``, ``square_avg``, ...).

    ``grad_avg`` is ``None`` unless ``centered``, ``momentum`` (torch's ``momentum_buffer``) is
    ``None`` unless ``momentum > 0``: torch creates neither in those cases.
    """

    count: PyTree
    square_avg: PyTree
    grad_avg: PyTree | None
    momentum: PyTree | None


@dataclass(frozen=True, slots=True)
class RmspropHyperparams:
    """The validated hyperparameters of :func:`rmsprop` (read by its piece rule)."""

    lr: ScalarOrSchedule
    alpha: float
    eps: float
    weight_decay: float | torch.Tensor
    momentum: float
    centered: bool
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("rmsprop", self.lr)
        expect(self.eps >= 0.0, "rmsprop", "0 <= eps", self.eps)
        expect(self.momentum >= 0.0, "rmsprop", "0 <= momentum", self.momentum)
        check_weight_decay("rmsprop", self.weight_decay)
        expect(self.alpha >= 0.0, "rmsprop", "0 <= alpha", self.alpha)


def _rmsprop_step(hp: RmspropHyperparams) -> Transformation:
    """Moving averages, then the parameter step with torch's rounding (one transformation).

    See [Note: torch's parameter rounding]: without momentum torch's ``addcdiv_`` is
    ``p + (-lr * g) / avg``, which we return as is; with momentum we return ``q - p`` for torch's
    fused ``q = p.add(buf, alpha=-lr)``.
    """
    alpha, centered, momentum = hp.alpha, hp.centered, hp.momentum

    def init(params: PyTree) -> ScaleByRmsState:
        return ScaleByRmsState(
            count=init_count(params),
            square_avg=zeros_like_tree(params),
            grad_avg=zeros_like_tree(params) if centered else None,
            momentum=zeros_like_tree(params) if momentum > 0 else None,
        )

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        square_avg: torch.Tensor,
        grad_avg: Any,
        buf: Any,
    ) -> tuple[Any, ...]:
        lr = operand(resolve(hp.lr, count), g)
        square_avg = (square_avg * alpha).addcmul(g, g, value=1 - alpha)
        if centered:
            grad_avg = torch.lerp(grad_avg, g, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt()
        else:
            avg = square_avg.sqrt()
        avg = avg.add(hp.eps)
        if momentum > 0:
            buf = (buf * momentum).addcdiv(g, avg)
            update = add_like_torch(p, buf, -lr) - p
        else:
            update = (g * -lr) / avg
        return update, count + 1, square_avg, grad_avg, buf

    def update(
        updates: PyTree, state: ScaleByRmsState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByRmsState]:
        if params is None and momentum > 0:
            raise ValueError("rmsprop: expected params, got None")
        # An absent buffer is stood in for by the counts (same tree) and dropped again.
        grad_avg = state.grad_avg if centered else state.count
        buf = state.momentum if momentum > 0 else state.count
        new, (count, square_avg, grad_avg, buf) = leafwise(
            rule, updates, params, state.count, state.square_avg, grad_avg, buf
        )
        return new, ScaleByRmsState(
            count, square_avg, grad_avg if centered else None, buf if momentum > 0 else None
        )

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "rmsprop")


def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.RMSprop`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param``] -> one transformation for
    the moving averages and the step, which reproduces torch's rounding of the parameters (see
    [Note: torch's parameter rounding]). ``lr`` may be a float, a 0-d tensor or a schedule of
    the per-parameter count. It has a piece fast path (``update_pieces_``) on foreach kernels.

    Example:
        >>> import torch
        >>> tx = rmsprop(lr=0.1)
        >>> params = [torch.ones(2)]
        >>> updates, state = tx.update([torch.ones(2)], tx.init(params), params)
        >>> updates
        [tensor([-1.0000, -1.0000])]

    Raises:
        ValueError: for a negative ``lr``, ``alpha``, ``eps``, ``weight_decay`` or ``momentum``.
    """
    hp = RmspropHyperparams(lr, alpha, eps, weight_decay, momentum, centered, maximize)
    links = prologue(maximize, weight_decay)
    tx = chain(*links, _rmsprop_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(rmsprop_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "rmsprop"
    )
