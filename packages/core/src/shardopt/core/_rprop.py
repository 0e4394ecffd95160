"""Rprop (torch.optim.Rprop): resilient backpropagation, sign-based steps of adaptive size."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_pair, expect
from shardopt.core._foreach import rprop_
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._transforms import scale
from shardopt.core._tree import PyTree, leafwise, tree_map, zeros_like_tree

__all__ = ["ScaleByRpropState", "rprop", "scale_by_rprop"]


class ScaleByRpropState(NamedTuple):
    """Per-parameter state of :func:`scale_by_rprop` (torch: ``step``, ``prev``, ``step_size``)."""

    count: PyTree
    prev: PyTree
    step_size: PyTree


# [Note: rprop sign logic]
# With s = sign(g * prev): the step size is multiplied by etas[1] where s > 0 (same sign twice),
# by etas[0] where s < 0 (the sign flipped: the last step went too far) and kept where s = 0,
# then clamped to step_sizes. Where the sign flipped the gradient is taken as 0: no step this
# time, and prev = 0 so that the next step keeps its size. The step is sign(g) * step_size,
# exactly (a sign times a size): with torch's kernels the parameters are bitwise equal to torch's.


def _check_rprop(
    api: str, lr: float | torch.Tensor, etas: tuple[float, float], step_sizes: tuple[float, float]
) -> None:
    check_learning_rate(api, lr, schedule=False)
    check_pair(api, "etas", etas)
    expect(0.0 < etas[0] < 1.0 < etas[1], api, "0 < etas[0] < 1 < etas[1]", etas)
    check_pair(api, "step_sizes", step_sizes)


def _init_step_size(p: Any, lr: float | torch.Tensor) -> torch.Tensor | None:
    if p is None:
        return None
    if isinstance(lr, torch.Tensor):
        return torch.zeros_like(p) + lr  # differentiable in lr, unlike full_like
    return torch.full_like(p, lr)


def scale_by_rprop(
    lr: float | torch.Tensor = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
) -> Transformation:
    """Returns ``sign(g) * step_size`` with per-element step sizes adapted by sign agreement.

    ``lr`` is the initial step size (torch's meaning). See [Note: rprop sign logic].

    Example:
        >>> import torch
        >>> tx = scale_by_rprop(lr=0.5)
        >>> tx.update([torch.tensor([-3.0, 0.0])], tx.init([torch.zeros(2)]))[0]
        [tensor([-0.5000,  0.0000])]

    Raises:
        ValueError: for a negative ``lr``, a schedule ``lr`` or etas not ``0 < etas[0] < 1 <
            etas[1]``.
    """
    _check_rprop("scale_by_rprop", lr, etas, step_sizes)
    eta_minus, eta_plus = etas
    size_min, size_max = step_sizes

    def init(params: PyTree) -> ScaleByRpropState:
        sizes = tree_map(lambda p: _init_step_size(p, lr), params)
        return ScaleByRpropState(init_count(params), zeros_like_tree(params), sizes)

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        prev: torch.Tensor,
        step_size: torch.Tensor,
    ) -> tuple[Any, ...]:
        sign = (g * prev).sign()
        same = torch.where(sign < 0, eta_minus, torch.ones_like(sign))
        factor = torch.where(sign > 0, eta_plus, same)
        step_size = (step_size * factor).clamp(size_min, size_max)
        g = torch.where(sign < 0, 0.0, g)
        return g.sign() * step_size, count + 1, g, step_size

    def update(
        updates: PyTree, state: ScaleByRpropState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByRpropState]:
        del params
        new, parts = leafwise(rule, updates, None, *state)
        return new, ScaleByRpropState(*parts)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_rprop")


@dataclass(frozen=True, slots=True)
class RpropHyperparams:
    """The validated hyperparameters of :func:`rprop` (read by its piece rule)."""

    lr: float | torch.Tensor
    etas: tuple[float, float]
    step_sizes: tuple[float, float]
    maximize: bool

    def __post_init__(self) -> None:
        _check_rprop("rprop", self.lr, self.etas, self.step_sizes)


def rprop(
    lr: float | torch.Tensor = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.Rprop`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> :func:`scale_by_rprop` -> negate. ``lr`` is the initial
    step size (a float or a 0-d tensor, read by ``init``); as in torch it is not a learning rate
    that scales later steps, so a schedule is rejected. It has a piece fast path
    (``update_pieces_``).

    Example:
        >>> import torch
        >>> tx = rprop(lr=0.1)
        >>> params = [torch.ones(2)]
        >>> tx.update([torch.tensor([1.0, -2.0])], tx.init(params), params)[0]
        [tensor([-0.1000,  0.1000])]

    Raises:
        ValueError: for a negative ``lr``, a schedule ``lr`` or etas not ``0 < etas[0] < 1 <
            etas[1]``.
    """
    hp = RpropHyperparams(lr, etas, step_sizes, maximize)
    links = [scale(-1.0)] if maximize else []
    tx = chain(*links, scale_by_rprop(lr, etas, step_sizes), scale(-1.0))
    return with_kind(
        with_piece_rule(tx, partial(rprop_, hp=hp, at=len(links))), Kind.ELEMENTWISE, "rprop"
    )
