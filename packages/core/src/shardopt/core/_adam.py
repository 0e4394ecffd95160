"""Adam and AdamW, as ``torch.optim.Adam`` and ``torch.optim.AdamW``, and ``scale_by_adam``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from shardopt.core._base import EmptyState, Transformation, chain, init_count
from shardopt.core._checks import expect, expect_nonnegative
from shardopt.core._fused import prepare_adam_, update_adam_
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._pieces import with_piece_rule
from shardopt.core._scalars import (
    cast_like,
    divide_learning_rate,
    is_zero,
    learning_rate_at,
    python_float_pow_half,
)
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._transforms import ScaleByScheduleState, add_decayed_weights, scale
from shardopt.core._tree import PyTree, leafwise, zeros_like_tree

__all__ = [
    "AdamHyperparams",
    "ScaleByAdamState",
    "adam",
    "adamw",
    "add_decoupled_weight_decay",
    "scale_by_adam",
]

Beta = float | torch.Tensor


class ScaleByAdamState(NamedTuple):
    """Per-parameter counts and moments: torch's ``step``, ``exp_avg``, ``exp_avg_sq`` and
    ``max_exp_avg_sq`` (``nu_max`` is ``None`` without amsgrad)."""

    count: PyTree
    mu: PyTree
    nu: PyTree
    nu_max: PyTree | None = None


def tensor_pow(base: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """torch's ``base ** float(step)`` for a tensor base: exponents 2 and 3 are multiplied out."""
    out = base ** step.to(base.dtype)
    out = torch.where(step == 2, base * base, out)
    return torch.where(step == 3, base * base * base, out)


def adam_step_scalars(
    b1: Beta, b2: Beta, lr: float | torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lr / bc1, sqrt(bc2))`` for the update after ``count`` others, rounded as torch does."""
    step = count.to(torch.float64) + 1
    if isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor):
        # torch's tensor-beta path: tensor arithmetic in the betas' dtype.
        bc1, bc2 = 1 - tensor_pow(b1, step), 1 - tensor_pow(b2, step)
        return lr / bc1, bc2**0.5
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return divide_learning_rate(lr, bc1), python_float_pow_half(bc2)


def scale_by_adam(
    b1: Beta = 0.9,
    b2: Beta = 0.999,
    eps: float = 1e-8,
    *,
    amsgrad: bool = False,
    learning_rate: ScalarOrSchedule | None = None,
) -> Transformation:
    """Rescales updates by Adam's bias-corrected moments.

    Without ``learning_rate`` the update is ``(mu / bc1) / (sqrt(nu) / sqrt(bc2) + eps)``, to be
    followed by :func:`~shardopt.core.scale_by_learning_rate`. With ``learning_rate`` it is the
    final descent step ``(mu * -(lr / bc1)) / (sqrt(nu) / sqrt(bc2) + eps)``, in torch's order of
    operations, so that it equals ``torch.optim.Adam`` bitwise (see [Note: folded learning rate]).

    Example:
        >>> import torch
        >>> tx = scale_by_adam()
        >>> tx.update([torch.tensor([2.0])], tx.init([torch.zeros(1)]))[0]
        [tensor([1.0000])]
    """
    # [Note: folded learning rate]
    # torch multiplies exp_avg by -lr/bc1 before dividing by the denominator. Scaling the
    # normalised update by -lr afterwards rounds differently (a few ulps per step), so the
    # factories fold the learning rate in here rather than chaining scale_by_learning_rate.
    lr, sign = (1.0, 1.0) if learning_rate is None else (learning_rate, -1.0)

    def init(params: PyTree) -> ScaleByAdamState:
        nu_max = zeros_like_tree(params) if amsgrad else None
        return ScaleByAdamState(
            init_count(params), zeros_like_tree(params), zeros_like_tree(params), nu_max
        )

    def rule(
        g: torch.Tensor,
        p: Any,
        count: torch.Tensor,
        mu: torch.Tensor,
        nu: torch.Tensor,
        *nu_max: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        if isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor):
            mu = torch.lerp(mu, g, 1 - b1.to(device=g.device, dtype=g.dtype))
            nu = torch.addcmul(nu * b2, g * cast_like(1 - b2, g), g)
        else:
            mu = torch.lerp(mu, g, 1 - b1)
            nu = torch.addcmul(nu * b2, g, g, value=1 - cast(float, b2))
        nu_max = tuple(torch.maximum(m, nu) for m in nu_max)
        step_size, bc2_sqrt = adam_step_scalars(b1, b2, resolve(lr, count), count)
        denom = (nu_max[0] if amsgrad else nu).sqrt() / cast_like(bc2_sqrt, nu)
        step = (mu * cast_like(sign * step_size, mu)) / (denom + eps)
        return step, count + 1, mu, nu, *nu_max

    def update(
        updates: PyTree, state: ScaleByAdamState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdamState]:
        del params
        moments = (state.nu_max,) if amsgrad else ()
        new, parts = leafwise(rule, updates, None, state.count, state.mu, state.nu, *moments)
        return new, ScaleByAdamState(*parts, *((None,) if not amsgrad else ()))

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_adam")


def add_decoupled_weight_decay(
    learning_rate: ScalarOrSchedule, weight_decay: float | torch.Tensor
) -> Transformation:
    """Decoupled weight decay (AdamW): the new parameter is ``p * (1 - lr * wd) + update``.

    Place it after the step that produces ``update`` (already scaled by the learning rate).

    Example:
        >>> import torch
        >>> tx = add_decoupled_weight_decay(0.5, 0.1)
        >>> tx.update([torch.zeros(1)], tx.init([torch.ones(1)]), [torch.full((1,), 2.0)])[0]
        [tensor([-0.1000])]
    """
    # [Note: decoupled decay as a delta]
    # torch scales the parameter first, ``p.mul_(1 - lr * wd)``, then adds the step. We return
    # ``(p * (1 - lr * wd) + u) - p`` so that ``apply_updates`` rebuilds torch's value; the
    # subtraction is exact whenever the old and new parameter are within a factor of 2 of each
    # other (Sterbenz), i.e. nearly always: equal to torch to the last bit or within an ulp.
    scheduled = callable(learning_rate)

    def init(params: PyTree) -> Any:
        return ScaleByScheduleState(init_count(params)) if scheduled else EmptyState()

    def rule(u: torch.Tensor, p: torch.Tensor, *count: torch.Tensor) -> tuple[Any, ...]:
        factor = 1 - learning_rate_at(learning_rate, count) * weight_decay
        return ((p * cast_like(factor, p) + u) - p, *(c + 1 for c in count))

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        if params is None:
            raise ValueError("add_decoupled_weight_decay: expected params, got None")
        counts = (state.count,) if scheduled else ()
        new, parts = leafwise(rule, updates, params, *counts)
        return new, ScaleByScheduleState(*parts) if scheduled else state

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "add_decoupled_weight_decay")


@dataclass(frozen=True, slots=True)
class AdamHyperparams:
    """The validated hyperparameters of :func:`adam` and :func:`adamw` (torch's names and rules)."""

    api: str
    lr: ScalarOrSchedule = 1e-3
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float | torch.Tensor = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        api = self.api
        expect_nonnegative(api, "lr", self.lr)
        expect_nonnegative(api, "eps", self.eps)
        expect(len(self.betas) == 2, api, "2 betas", self.betas)
        kinds = {isinstance(b, torch.Tensor) for b in self.betas}
        expect(len(kinds) == 1, api, "betas both floats or both tensors", self.betas)
        for i, beta in enumerate(self.betas):
            if isinstance(beta, torch.Tensor):
                expect(beta.numel() == 1, api, f"betas[{i}] with 1 element", tuple(beta.shape))
                if torch._C._functorch.is_functorch_wrapped_tensor(beta):
                    continue
            expect(bool(0 <= beta < 1), api, f"0 <= betas[{i}] < 1", beta)
        expect_nonnegative(api, "weight_decay", self.weight_decay)

    def step_scalars(
        self, count: torch.Tensor, lr: float | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`adam_step_scalars` with these betas (for the piece rules)."""
        return adam_step_scalars(self.betas[0], self.betas[1], lr, count)

    def build(self) -> Transformation:
        """The pure chain: [negate] -> [add_decayed_weights] -> scale_by_adam -> [decay]."""
        decay = not is_zero(self.weight_decay)
        pieces = [scale(-1.0)] if self.maximize else []
        if decay and not self.decoupled_weight_decay:
            pieces.append(add_decayed_weights(self.weight_decay))
        b1, b2 = self.betas
        pieces.append(scale_by_adam(b1, b2, self.eps, amsgrad=self.amsgrad, learning_rate=self.lr))
        if decay and self.decoupled_weight_decay:
            pieces.append(add_decoupled_weight_decay(self.lr, self.weight_decay))
        return chain(*pieces)


def _pair(betas: Any) -> tuple[Beta, Beta]:
    """``tuple(betas)``; its length is checked by :class:`AdamHyperparams`."""
    return cast(tuple[Beta, Beta], tuple(betas))


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[Beta, Beta] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> Transformation:
    """Adam, the pure equivalent of ``torch.optim.Adam`` (bitwise for float hyperparameters
    without decoupled weight decay).

    Same hyperparameters, defaults and validation as torch. ``lr`` may be a float, a 0-d tensor
    or a schedule of the per-parameter count (see [Note: schedule counts]). Registers the flat
    in-place fast path (``torch._fused_adam_``) for :func:`~shardopt.core.update_pieces_`.

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates
        >>> params = [torch.tensor([1.0, -1.0])]
        >>> tx = adam(lr=0.1)
        >>> updates, state = tx.update([torch.tensor([3.0, -0.5])], tx.init(params), params)
        >>> apply_updates(params, updates)
        [tensor([ 0.9000, -0.9000])]

    Raises:
        ValueError: for a hyperparameter torch rejects, e.g.
            ``adam: expected 0 <= betas[0] < 1, got 1.5``.
    """
    hp = AdamHyperparams(
        "adam", lr, _pair(betas), eps, weight_decay, amsgrad, maximize, decoupled_weight_decay
    )
    return with_kind(
        with_piece_rule(
            hp.build(), functools.partial(update_adam_, hp), functools.partial(prepare_adam_, hp)
        ),
        Kind.ELEMENTWISE,
        "adam",
    )


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[Beta, Beta] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> Transformation:
    """AdamW, the pure equivalent of ``torch.optim.AdamW``: :func:`adam` with decoupled decay.

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates
        >>> params = [torch.tensor([1.0])]
        >>> tx = adamw(lr=0.1, weight_decay=0.5)
        >>> updates, state = tx.update([torch.tensor([2.0])], tx.init(params), params)
        >>> apply_updates(params, updates)
        [tensor([0.8500])]
    """
    hp = AdamHyperparams("adamw", lr, _pair(betas), eps, weight_decay, amsgrad, maximize, True)
    return with_kind(
        with_piece_rule(
            hp.build(), functools.partial(update_adam_, hp), functools.partial(prepare_adam_, hp)
        ),
        Kind.ELEMENTWISE,
        "adamw",
    )
