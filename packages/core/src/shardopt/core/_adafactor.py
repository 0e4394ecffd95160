"""Adafactor (torch.optim.Adafactor): relative steps scaled by a factored second moment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_pair, check_weight_decay, expect
from shardopt.core._foreach import add_like_torch, decays, lr_scalar, operand, prologue
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._scalars import python_float_pow_half
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, tree_map

__all__ = ["ScaleByAdafactorState", "adafactor"]


class ScaleByAdafactorState(NamedTuple):
    """Per-parameter state of :func:`adafactor` (torch: ``step``, ``row_var``, ``col_var``,
    ``variance``).

    Each field is a tree shaped like the params, and, as torch keeps them, a parameter of 2 or
    more dims has a factored second moment: ``row_var`` (its shape with the last dim 1) and
    ``col_var`` (the second-to-last dim 1), its ``variance`` leaf is ``None``; a 0-d or 1-d
    parameter has a ``variance`` of its shape, its ``row_var`` and ``col_var`` leaves are
    ``None``.
    """

    count: PyTree
    row_var: PyTree
    col_var: PyTree
    variance: PyTree


def _zeros_if(params: PyTree, factored: bool, last_dim: int) -> PyTree:
    """Zeros of each parameter's shape with dim ``last_dim`` set to 1 for the parameters of 2 or
    more dims if ``factored``; else zeros like the 0-d and 1-d parameters. ``None`` elsewhere."""

    def make(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or (p.dim() > 1) != factored:
            return None
        if not factored:
            return torch.zeros_like(p)
        shape = list(p.shape)
        shape[last_dim] = 1
        return p.new_zeros(shape)

    return tree_map(make, params)


@dataclass(frozen=True, slots=True)
class AdafactorHyperparams:
    """The validated hyperparameters of :func:`adafactor`."""

    lr: ScalarOrSchedule
    beta2_decay: float
    eps: tuple[float | None, float]
    d: float
    weight_decay: float | torch.Tensor
    maximize: bool

    def __post_init__(self) -> None:
        check_learning_rate("adafactor", self.lr)
        expect(self.beta2_decay <= 0.0, "adafactor", "beta2_decay <= 0", self.beta2_decay)
        check_pair("adafactor", "eps", self.eps)  # type: ignore[arg-type]
        eps1, eps2 = self.eps
        expect(eps1 is None or eps1 >= 0.0, "adafactor", "0 <= eps[0] or None", eps1)
        expect(eps2 >= 0.0, "adafactor", "0 <= eps[1]", eps2)
        expect(self.d >= 1.0, "adafactor", "1 <= d", self.d)
        check_weight_decay("adafactor", self.weight_decay)


# [Note: adafactor's scalars]
# torch reads the step, the parameter's norm and the update's norm to Python floats and computes
# ``1 - beta2_t = t ** beta2_decay``, ``rho = min(lr, 1 / t ** 0.5)``, the relative step
# ``max(eps2, rms(p)) * rho`` and its clipping ``/ max(1, rms(update) / d)`` in double precision.
# We compute them as float64 0-d tensors (so they trace under torch.func), with C ``pow``. A
# tensor lr stays a tensor in torch: where ``rho`` is the lr, the step size is computed in the
# lr's dtype (``rho`` is picked by comparing in that dtype too), as here. Without ``eps[0]``,
# each parameter's eps is its dtype's machine eps (torch takes the first parameter's for all
# the parameters of a group; they differ only in a group of mixed dtypes).


def _step_size(
    hp: AdafactorHyperparams, lr: torch.Tensor, step: torch.Tensor, p: torch.Tensor, u: Any
) -> torch.Tensor:
    """``-max(eps2, rms(p)) * min(lr, 1 / sqrt(t)) / max(1, rms(u) / d)`` as torch rounds it,
    in ``p``'s dtype (``p`` before the weight decay, ``u`` the unclipped update)."""
    scale = torch.clamp(p.norm(2).to(torch.float64) / (p.numel() ** 0.5), min=hp.eps[1])
    clip = torch.clamp(u.norm(2).to(torch.float64) / ((u.numel() ** 0.5) * hp.d), min=1.0)
    inverse_root = 1 / python_float_pow_half(step)
    on_root = -(scale * inverse_root) / clip
    on_lr = -(scale.to(lr.dtype) * lr) / clip.to(lr.dtype)
    return torch.where(inverse_root.to(lr.dtype) < lr, on_root.to(p.dtype), on_lr.to(p.dtype))


def _variance_estimate(
    g: torch.Tensor, row_var: Any, col_var: Any, variance: Any, weight: torch.Tensor, eps1: float
) -> tuple[torch.Tensor, Any, Any, Any]:
    """Updates the second moment (factored if ``g`` has 2 or more dims); returns its estimate."""
    if g.dim() <= 1:
        variance = torch.lerp(variance, g * g, weight)
        return variance, row_var, col_var, variance
    row_mean = torch.norm(g, dim=-1, keepdim=True).square().div(g.size(-1))
    row_var = torch.lerp(row_var, row_mean, weight)
    col_mean = torch.norm(g, dim=-2, keepdim=True).square().div(g.size(-2))
    col_var = torch.lerp(col_var, col_mean, weight)
    estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
    return estimate, row_var, col_var, variance


def _adafactor_step(hp: AdafactorHyperparams) -> Transformation:
    """The second moment, then torch's weight decay and clipped relative step (one
    transformation). We return ``q - p`` for torch's new parameter ``q`` (see [Note: torch's
    parameter rounding])."""

    def init(params: PyTree) -> ScaleByAdafactorState:
        return ScaleByAdafactorState(
            init_count(params),
            _zeros_if(params, True, -1),
            _zeros_if(params, True, -2),
            _zeros_if(params, False, -1),
        )

    def rule(
        g: torch.Tensor, p: Any, count: torch.Tensor, row_var: Any, col_var: Any, variance: Any
    ) -> tuple[Any, ...]:
        lr = lr_scalar(resolve(hp.lr, count), g)
        step = count.to(torch.float64) + 1
        eps1 = torch.finfo(p.dtype).eps if hp.eps[0] is None else hp.eps[0]
        weight = (step ** torch.full_like(step, hp.beta2_decay)).to(g.dtype)
        estimate, row_var, col_var, variance = _variance_estimate(
            g, row_var, col_var, variance, weight, eps1
        )
        u = estimate.clamp(min=eps1 * eps1).rsqrt().mul(g)
        q = p * operand(1 - lr * hp.weight_decay, p) if decays(hp.weight_decay) else p
        q = add_like_torch(q, u, _step_size(hp, lr, step, p, u))
        return q - p, count + 1, row_var, col_var, variance

    def update(
        updates: PyTree, state: ScaleByAdafactorState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByAdafactorState]:
        if params is None:
            raise ValueError("adafactor: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByAdafactorState(*parts)

    return with_kind(Transformation(init, update), Kind.SHAPED, "adafactor")


def adafactor(
    lr: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
) -> Transformation:
    """``torch.optim.Adafactor`` as a pure transformation (same hyperparameters and defaults).

    A chain: [negate if ``maximize``] -> one transformation that keeps torch's second moment (row
    and column means of the squared gradient for a parameter of 2 or more dims, over its last two
    dims; a full one for others), decays the parameter by ``1 - lr * weight_decay`` and steps by
    the relative step size ``max(eps[1], rms(p)) * min(lr, 1 / sqrt(t))`` along the update
    clipped to rms ``d`` (see [Note: adafactor's scalars]). ``lr`` may be a float, a 0-d tensor
    or a schedule of the per-parameter count. It has no piece fast path: it needs whole tensors
    (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> tx = adafactor()
        >>> params = [torch.ones(2, 2)]
        >>> tx.update([torch.ones(2, 2)], tx.init(params), params)[0]
        [tensor([[-0.0100, -0.0100],
                [-0.0100, -0.0100]])]

    Raises:
        ValueError: for a negative ``lr``, ``eps[0]``, ``eps[1]`` or ``weight_decay``, a positive
            ``beta2_decay`` or ``d < 1``.
    """
    hp = AdafactorHyperparams(lr, beta2_decay, eps, d, weight_decay, maximize)
    links = prologue(maximize, 0.0)
    return with_kind(chain(*links, _adafactor_step(hp)), Kind.SHAPED, "adafactor")
