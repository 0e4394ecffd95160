"""Stochastic gradient descent with momentum, dampening and Nesterov, as ``torch.optim.SGD``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shardopt.core._base import EmptyState, Transformation, chain, init_count
from shardopt.core._checks import expect, expect_nonnegative
from shardopt.core._fused_sgd import prepare_sgd_, update_sgd_
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._scalars import is_zero, learning_rate_at
from shardopt.core._schedules import ScalarOrSchedule
from shardopt.core._transforms import ScaleByScheduleState, add_decayed_weights, scale
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = ["SGDHyperparams", "TraceState", "sgd", "step_by_learning_rate", "trace"]


def step_by_learning_rate(learning_rate: ScalarOrSchedule) -> Transformation:
    """The step ``-lr * update`` as the change that ``p.add_(update, alpha=-lr)`` makes to ``p``.

    Example:
        >>> import torch
        >>> tx = step_by_learning_rate(0.5)
        >>> tx.update([torch.ones(1)], tx.init([torch.ones(1)]), [torch.full((1,), 2.0)])[0]
        [tensor([-0.5000])]
    """
    # [Note: torch's step as a delta]
    # torch adds ``-lr * u`` to the parameter in one fused multiply-add (``add_(u, alpha=-lr)``,
    # or ``addcmul_`` for a tensor lr), rounding once; ``p + (-lr * u)`` rounds twice and drifts
    # from torch by an ulp now and then. We compute torch's new value ``x`` with the same op and
    # return ``x - p``: the subtraction is exact whenever ``x`` and ``p`` are within a factor of 2
    # (Sterbenz), so ``apply_updates`` gives back ``x`` to the last bit nearly always.
    scheduled = callable(learning_rate)

    def init(params: PyTree) -> Any:
        return ScaleByScheduleState(init_count(params)) if scheduled else EmptyState()

    def rule(u: torch.Tensor, p: torch.Tensor, *count: torch.Tensor) -> tuple[Any, ...]:
        lr = learning_rate_at(learning_rate, count)
        if isinstance(lr, torch.Tensor):
            new = torch.addcmul(p, u, lr.to(p.dtype), value=-1)
        else:
            new = p.add(u, alpha=-lr)
        return (new - p, *(c + 1 for c in count))

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        if params is None:
            raise ValueError("step_by_learning_rate: expected params, got None")
        counts = (state.count,) if scheduled else ()
        new, parts = leafwise(rule, updates, params, *counts)
        return new, ScaleByScheduleState(*parts) if scheduled else state

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "step_by_learning_rate")


class TraceState(NamedTuple):
    """Per-parameter counts and momentum buffers (torch's ``state["momentum_buffer"]``)."""

    count: PyTree
    momentum: PyTree


def trace(momentum: float, dampening: float = 0.0, *, nesterov: bool = False) -> Transformation:
    """Heavy-ball momentum as torch's SGD: ``b = momentum * b + (1 - dampening) * g``.

    The first update of a parameter sets ``b = g`` (no dampening), as torch does. The update is
    ``b``, or ``g + momentum * b`` with ``nesterov``.

    Example:
        >>> import torch
        >>> tx = trace(0.5)
        >>> state = tx.init([torch.zeros(1)])
        >>> u, state = tx.update([torch.ones(1)], state)
        >>> tx.update([torch.ones(1)], state)[0]
        [tensor([1.5000])]
    """

    def init(params: PyTree) -> TraceState:
        return TraceState(init_count(params), zeros_like_tree(params))

    def rule(
        g: torch.Tensor, p: object, count: torch.Tensor, buf: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        # [Note: momentum buffer starts at zero]
        # torch creates the buffer as a copy of the first gradient. A zero buffer gives exactly
        # that when dampening is 0 (0 * momentum + 1 * g == g in floating point); otherwise the
        # first step is selected by the count, without reading it on the host.
        new_buf = (buf * momentum).add(g, alpha=1 - dampening)
        if dampening != 0:
            new_buf = torch.where(count == 0, g, new_buf)
        out = g.add(new_buf, alpha=momentum) if nesterov else new_buf
        return out, count + 1, new_buf

    def update(
        updates: PyTree, state: TraceState, params: PyTree | None = None
    ) -> tuple[PyTree, TraceState]:
        del params
        new, (count, buf) = leafwise(rule, updates, None, state.count, state.momentum)
        return new, TraceState(count, buf)

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "trace")


@dataclass(frozen=True, slots=True)
class SGDHyperparams:
    """The validated hyperparameters of :func:`sgd` (torch's names and rules)."""

    lr: ScalarOrSchedule = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float | torch.Tensor = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        expect_nonnegative("sgd", "lr", self.lr)
        expect(self.momentum >= 0, "sgd", "0 <= momentum", self.momentum)
        expect_nonnegative("sgd", "weight_decay", self.weight_decay)
        expect(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "sgd",
            "momentum > 0 and dampening == 0 with nesterov",
            f"momentum={self.momentum}, dampening={self.dampening}",
        )

    def build(self) -> Transformation:
        """The pure chain: [negate] -> [add_decayed_weights] -> [trace] -> step_by_lr."""
        pieces = [scale(-1.0)] if self.maximize else []
        if not is_zero(self.weight_decay):
            pieces.append(add_decayed_weights(self.weight_decay))
        if self.momentum != 0:
            pieces.append(trace(self.momentum, self.dampening, nesterov=self.nesterov))
        pieces.append(step_by_learning_rate(self.lr))
        return chain(*pieces)


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> Transformation:
    """Stochastic gradient descent, the pure equivalent of ``torch.optim.SGD``.

    Same hyperparameters, defaults and validation as torch. ``lr`` may be a float, a 0-d tensor
    or a schedule of the per-parameter count (see [Note: schedule counts]). Registers the flat
    in-place fast path for :func:`~shardopt.core.update_pieces_`: torch's foreach ops on CPU,
    bitwise equal to ``torch.optim.SGD`` on any split of a tensor, ``torch._fused_sgd_`` on
    CUDA (see [Note: SGD on CPU is foreach]).

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> tx = sgd(lr=0.1, momentum=0.9)
        >>> updates, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> apply_updates(params, updates)
        {'w': tensor([0.9000, 1.9000])}

    Raises:
        ValueError: for a hyperparameter torch rejects, e.g.
            ``sgd: expected 0 <= momentum, got -0.1``.
    """
    hp = SGDHyperparams(lr, momentum, dampening, weight_decay, nesterov, maximize)
    return with_kind(
        with_piece_rule(
            hp.build(), functools.partial(update_sgd_, hp), functools.partial(prepare_sgd_, hp)
        ),
        Kind.ELEMENTWISE,
        "sgd",
    )
