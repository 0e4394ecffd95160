"""Small composable transformations: scaling, learning rates and weight decay."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardopt.core._base import EmptyState, Transformation, init_count, stateless
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise

__all__ = [
    "ScaleByScheduleState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
]


class ScaleByScheduleState(NamedTuple):
    """Per-parameter counts of the updates applied, for schedules."""

    count: PyTree


def scale(factor: float | torch.Tensor) -> Transformation:
    """Multiplies updates by ``factor``.

    Example:
        >>> import torch
        >>> tx = scale(-2.0)
        >>> tx.update([torch.ones(1)], tx.init([torch.ones(1)]))[0]
        [tensor([-2.])]
    """

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        new, _ = leafwise(lambda g, p: (g * factor,), updates, None)
        return new

    return with_kind(stateless(apply), Kind.ELEMENTWISE, "scale")


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> Transformation:
    """Multiplies updates by ``-learning_rate`` (``+`` if ``flip_sign=False``).

    ``learning_rate`` may be a float, a 0-d tensor (differentiable under ``torch.func.grad``) or a
    schedule of the per-parameter update count (see [Note: schedule counts]).

    Example:
        >>> import torch
        >>> tx = scale_by_learning_rate(0.1)
        >>> tx.update([torch.ones(1)], tx.init([torch.ones(1)]))[0]
        [tensor([-0.1000])]
    """
    sign = -1.0 if flip_sign else 1.0

    def init(params: PyTree) -> Any:
        return ScaleByScheduleState(init_count(params)) if callable(learning_rate) else EmptyState()

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        del params
        if not callable(learning_rate):
            new, _ = leafwise(lambda g, p: (g * (sign * learning_rate),), updates, None)
            return new, state

        def rule(g, p, count):
            lr = resolve(learning_rate, count)
            return (g * (sign * lr)).to(g.dtype), count + 1

        new, (count,) = leafwise(rule, updates, None, state.count)
        return new, ScaleByScheduleState(count)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_learning_rate")


def add_decayed_weights(weight_decay: float | torch.Tensor = 0.0) -> Transformation:
    """Adds ``weight_decay * param`` to the updates (L2 decay, as torch's ``weight_decay``).

    Example:
        >>> import torch
        >>> tx = add_decayed_weights(0.5)
        >>> tx.update([torch.ones(1)], tx.init([torch.ones(1)]), [torch.full((1,), 2.0)])[0]
        [tensor([2.])]
    """

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        if params is None:
            raise ValueError("add_decayed_weights: expected params, got None")
        new, _ = leafwise(rule, updates, params)
        return new

    def rule(g: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor]:
        if isinstance(weight_decay, torch.Tensor):  # differentiable: no alpha= scalar
            return (torch.addcmul(g, p, weight_decay.to(p.dtype)),)
        return (g.add(p, alpha=weight_decay),)

    return with_kind(stateless(apply), Kind.ELEMENTWISE, "add_decayed_weights")
