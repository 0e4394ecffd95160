"""Adagrad, as ``torch.optim.Adagrad``, and ``scale_by_adagrad``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import expect_nonnegative
from shardopt.core._fused import prepare_adagrad_, update_adagrad_
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._scalars import cast_like, divide_learning_rate, is_zero
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._transforms import add_decayed_weights, scale
from shardopt.core._tree import PyTree, leafwise, tree_map

__all__ = ["AdagradHyperparams", "ScaleByAdagradState", "adagrad", "scale_by_adagrad"]


class ScaleByAdagradState(NamedTuple):
    """Per-parameter counts and sums of squared gradients (torch's ``step`` and ``sum``)."""

    count: PyTree
    sum: PyTree


def adagrad_step_size(
    lr_decay: float, lr: float | torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """torch's ``clr = lr / (1 + (step - 1) * lr_decay)`` with ``step - 1 == count``, rounded as
    torch rounds it (see [Note: scalar arithmetic of the count])."""
    return divide_learning_rate(lr, count.to(torch.float64) * lr_decay + 1)


def scale_by_adagrad(
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    learning_rate: ScalarOrSchedule | None = None,
    lr_decay: float = 0.0,
) -> Transformation:
    """Divides updates by the root of the running sum of squared gradients, plus ``eps``.

    Without ``learning_rate`` the update is ``(g * c) / (sqrt(sum) + eps)`` with
    ``c = 1 / (1 + count * lr_decay)``; with it, the final descent step with
    ``c = -lr / (1 + count * lr_decay)``, in torch's order of operations (see
    [Note: folded learning rate]).

    Example:
        >>> import torch
        >>> tx = scale_by_adagrad()
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([1.])]
    """
    lr, sign = (1.0, 1.0) if learning_rate is None else (learning_rate, -1.0)

    def init(params: PyTree) -> ScaleByAdagradState:
        sums = tree_map(
            lambda p: None if p is None else torch.full_like(p, initial_accumulator_value), params
        )
        return ScaleByAdagradState(init_count(params), sums)

    def rule(
        g: torch.Tensor, p: Any, count: torch.Tensor, acc: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        acc = torch.addcmul(acc, g, g, value=1)
        clr = adagrad_step_size(lr_decay, resolve(lr, count), count)
        return (g * cast_like(sign * clr, g)) / (acc.sqrt() + eps), count + 1, acc

    def update(
        updates: PyTree, state: ScaleByAdagradState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdagradState]:
        del params
        new, (count, acc) = leafwise(rule, updates, None, state.count, state.sum)
        return new, ScaleByAdagradState(count, acc)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_adagrad")


@dataclass(frozen=True, slots=True)
class AdagradHyperparams:
    """The validated hyperparameters of :func:`adagrad` (torch's names and rules)."""

    lr: ScalarOrSchedule = 1e-2
    lr_decay: float = 0.0
    weight_decay: float | torch.Tensor = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        expect_nonnegative("adagrad", "lr", self.lr)
        expect_nonnegative("adagrad", "lr_decay", self.lr_decay)
        expect_nonnegative("adagrad", "weight_decay", self.weight_decay)
        expect_nonnegative("adagrad", "initial_accumulator_value", self.initial_accumulator_value)
        expect_nonnegative("adagrad", "eps", self.eps)

    def step_size(self, count: torch.Tensor, lr: float | torch.Tensor) -> torch.Tensor:
        """:func:`adagrad_step_size` with this ``lr_decay`` (for the piece rules)."""
        return adagrad_step_size(self.lr_decay, lr, count)

    def build(self) -> Transformation:
        """The pure chain: [negate] -> [add_decayed_weights] -> scale_by_adagrad."""
        pieces = [scale(-1.0)] if self.maximize else []
        if not is_zero(self.weight_decay):
            pieces.append(add_decayed_weights(self.weight_decay))
        pieces.append(
            scale_by_adagrad(
                self.initial_accumulator_value,
                self.eps,
                learning_rate=self.lr,
                lr_decay=self.lr_decay,
            )
        )
        return chain(*pieces)


def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
) -> Transformation:
    """Adagrad, the pure equivalent of ``torch.optim.Adagrad`` (bitwise for float weight decay).

    Same hyperparameters, defaults and validation as torch; the learning rate of step ``t`` is
    ``lr / (1 + (t - 1) * lr_decay)``. ``lr`` may be a float, a 0-d tensor or a schedule of the
    per-parameter count (see [Note: schedule counts]). Registers the flat in-place fast path
    (``torch._fused_adagrad_``) for :func:`~shardopt.core.update_pieces_`.

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates
        >>> params = [torch.tensor([1.0])]
        >>> tx = adagrad(lr=0.5)
        >>> updates, state = tx.update([torch.tensor([4.0])], tx.init(params), params)
        >>> apply_updates(params, updates)
        [tensor([0.5000])]

    Raises:
        ValueError: for a hyperparameter torch rejects, e.g.
            ``adagrad: expected 0 <= lr_decay, got -1.0``.
    """
    hp = AdagradHyperparams(lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize)
    return with_kind(
        with_piece_rule(
            hp.build(),
            functools.partial(update_adagrad_, hp),
            functools.partial(prepare_adagrad_, hp),
        ),
        Kind.ELEMENTWISE,
        "adagrad",
    )
