"""ASGD (torch.optim.ASGD): SGD with a decaying step size and a running average of the iterates."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_weight_decay
from shardopt.core._foreach import add_like_torch, asgd_, lr_scalar, operand, prologue
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, tree_map, zeros_like_tree

__all__ = ["ScaleByAsgdState", "asgd"]


class ScaleByAsgdState(NamedTuple):
    """Per-parameter state of :func:`asgd` (torch: ``step``, ``eta``, ``mu``, ``ax``).

    ``eta`` (the step size of the next step) and ``mu`` (the averaging weight) are float32 0-d
    tensors per parameter, like ``count``; ``ax``, the average of the iterates, is the result of
    ASGD and has the parameter's shape (the steps never read it).
    """

    count: PyTree
    eta: PyTree
    mu: PyTree
    ax: PyTree


# [Note: asgd's eta and mu]
# torch creates ``eta`` as the float32 value of the lr, ``mu`` as 1, and steps a parameter with
# ``p *= 1 - lambd * eta`` then ``p += -eta * g`` (``eta`` read as a Python float), then averages
# ``ax += mu * (p - ax)`` (or copies ``p`` while ``mu`` is exactly 1: up to step ``t0 + 1``),
# and last stores ``eta = lr / (1 + lambd * lr * t) ** alpha`` and ``mu = 1 / max(1, t - t0)``
# for the new step number ``t``, computed in double precision and rounded to float32. So the eta
# of a step comes from the lr of the step before (a schedule's lr shows one step late). Two
# details of rounding: a tensor lr keeps torch's arithmetic in its own dtype (``lr / ...`` is
# computed on the tensor), and a Python float's ``** alpha`` is C ``pow`` while a tensor's ``**``
# special-cases exponents such as 0.5; we compute each as torch does. Holding ``eta`` and ``mu``
# in float32 like torch (like the counts, whatever torch's default dtype) keeps float64 runs
# equal to torch's. This is torch's single-tensor path (its default on CPU); its foreach path,
# which the piece rule follows, rounds differently (see ``asgd_``).


def _scalar_per_leaf(params: PyTree, value: Any) -> PyTree:
    """A float32 0-d tensor of ``value`` on each parameter's device (a new tensor per leaf)."""

    def make(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None:
            return None
        if isinstance(value, torch.Tensor):
            return value.to(device=p.device, dtype=torch.float32, copy=True)
        return torch.full((), value, dtype=torch.float32, device=p.device)

    return tree_map(make, params)


@dataclass(frozen=True, slots=True)
class AsgdHyperparams:
    """The validated hyperparameters of :func:`asgd` (read by its piece rule)."""

    lr: ScalarOrSchedule
    lambd: float
    alpha: float
    t0: float
    weight_decay: float | torch.Tensor
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("asgd", self.lr)
        check_weight_decay("asgd", self.weight_decay)


def _next_eta(hp: AsgdHyperparams, lr: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``lr / (1 + lambd * lr * step) ** alpha`` in ``lr``'s dtype, with torch's ``**``."""
    base = 1 + hp.lambd * lr * step.to(lr.dtype)
    if isinstance(hp.lr, torch.Tensor):
        return lr / base**hp.alpha
    return lr / base ** torch.full_like(base, hp.alpha)  # a Python float's pow, not sqrt & co


def _asgd_step(hp: AsgdHyperparams) -> Transformation:
    """The decayed step, the average and the next ``eta`` and ``mu`` (one transformation).

    See [Note: asgd's eta and mu]; we return ``q - p`` for torch's new parameter ``q`` (see
    [Note: torch's parameter rounding]).
    """
    lambd = hp.lambd

    def init(params: PyTree) -> ScaleByAsgdState:
        count = init_count(params)
        eta = _scalar_per_leaf(params, resolve(hp.lr, torch.zeros(())))
        return ScaleByAsgdState(count, eta, _scalar_per_leaf(params, 1.0), zeros_like_tree(params))

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        eta: torch.Tensor,
        mu: torch.Tensor,
        ax: torch.Tensor,
    ) -> tuple[Any, ...]:
        lr = lr_scalar(resolve(hp.lr, count), g)
        step = count + 1
        eta64 = eta.to(torch.float64)
        q = add_like_torch(p * operand(1 - lambd * eta64, p), g, -eta64)
        ax = torch.where(mu == 1, q, ax + (q - ax) * mu.to(q.dtype))
        mu_next = 1 / torch.clamp(step.to(torch.float64) - hp.t0, min=1.0)
        eta_next = _next_eta(hp, lr, step).to(eta.dtype)
        return q - p, step, eta_next, mu_next.to(mu.dtype), ax

    def update(
        updates: PyTree, state: ScaleByAsgdState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAsgdState]:
        if params is None:
            raise ValueError("asgd: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByAsgdState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "asgd")


def asgd(
    lr: ScalarOrSchedule = 1e-2,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.ASGD`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> [add ``weight_decay * param``] -> one transformation for
    the step, the average of the iterates (the state's ``ax``) and the next step size, which
    reproduces torch's rounding (see [Note: asgd's eta and mu]). ``lr`` may be a float, a 0-d
    tensor or a schedule of the per-parameter count. It has a piece fast path (``update_pieces_``)
    on foreach kernels.

    Example:
        >>> import torch
        >>> tx = asgd(lr=0.5, lambd=0.0)
        >>> params = [torch.ones(2)]
        >>> updates, state = tx.update([torch.ones(2)], tx.init(params), params)
        >>> updates, state[-1].ax
        ([tensor([-0.5000, -0.5000])], [tensor([0.5000, 0.5000])])

    Raises:
        ValueError: for a negative ``lr`` or ``weight_decay``.
    """
    hp = AsgdHyperparams(lr, lambd, alpha, t0, weight_decay, maximize)
    links = prologue(maximize, weight_decay)
    tx = chain(*links, _asgd_step(hp))
    return with_kind(
        with_piece_rule(tx, partial(asgd_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "asgd"
    )
