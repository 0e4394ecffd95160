"""Per-tensor transformations as optax's: ``scale_by_trust_ratio``, ``lamb``, ``lars``,
``novograd`` and ``clip_by_block_rms``.

Each reads reductions over whole tensors (``Kind.PER_TENSOR``), taken only through the
reduction blocks of ``_reduce.py`` and called unconditionally: in one process they reduce the
leaf; under ``shard`` a leaf is a piece and the blocks give the whole tensor's value (see
[Note: reductions across shards]), so the rest, elementwise, is exact on any cut.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count, stateless
from shardopt.core._checks import check_learning_rate, expect
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._moments import (
    decayed_weights,
    map_updates,
    masked_if,
    same_structure,
    whole_numels,
    zeros_in,
)
from shardopt.core._optax_adaptive import scale_by_adam_root
from shardopt.core._optax_sign import check_decay
from shardopt.core._reduce import tensor_norms, tensor_sum_sq
from shardopt.core._schedules import ScalarOrSchedule
from shardopt.core._sgd import trace
from shardopt.core._transforms import scale_by_learning_rate
from shardopt.core._tree import PyTree, leafwise, tree_map

__all__ = [
    "ScaleByNovogradState",
    "clip_by_block_rms",
    "lamb",
    "lars",
    "novograd",
    "scale_by_trust_ratio",
]


def _at_least(norm: torch.Tensor, min_norm: float) -> torch.Tensor:
    """optax's ``safe_norm`` of an already reduced norm: ``min_norm`` where ``norm <= min_norm``."""
    return torch.where(norm <= min_norm, torch.full_like(norm, min_norm), norm)


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> Transformation:
    """Scales each tensor's update by its trust ratio (LARS, LAMB), as optax's:
    ``u' = u * tc * ||p|| / (||u|| + eps)``, with both norms over the whole tensor and raised to
    at least ``min_norm``; the ratio is 1 where either norm is 0. Needs ``params``.

    Example:
        >>> import torch
        >>> tx = scale_by_trust_ratio()
        >>> u = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
        >>> tx.update(u, tx.init(None), [torch.tensor([0.0, 10.0]), torch.zeros(1)])[0]
        [tensor([6., 8.]), tensor([1.])]
    """

    def rule(u: torch.Tensor, u_norm: torch.Tensor, p_norm: torch.Tensor) -> torch.Tensor:
        u_norm, p_norm = _at_least(u_norm, min_norm), _at_least(p_norm, min_norm)
        ratio = trust_coefficient * p_norm / (u_norm + eps)
        ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
        return u * ratio.to(u.dtype)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        if params is None:
            raise ValueError("scale_by_trust_ratio: expected params, got None")
        same_structure("scale_by_trust_ratio", updates, params)
        u_norms, p_norms = tensor_norms(updates, params)  # one collective, every rank and call
        return map_updates(rule, updates, u_norms, p_norms)

    return with_kind(stateless(apply), Kind.PER_TENSOR, "scale_by_trust_ratio")


def clip_by_block_rms(threshold: float) -> Transformation:
    """Clips each tensor by its root mean square, as optax's:
    ``u' = u / max(1, sqrt(mean(u**2)) / threshold)``, the mean over the whole tensor.

    Example:
        >>> import torch
        >>> tx = clip_by_block_rms(1.0)
        >>> tx.update([torch.tensor([3.0, 4.0]), torch.tensor([0.5])], tx.init(None))[0]
        [tensor([0.8485, 1.1314]), tensor([0.5000])]
    """
    expect(threshold > 0, "clip_by_block_rms", "threshold > 0", threshold)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        sums = tensor_sum_sq(updates)  # every rank, every call
        numels = iter(whole_numels(updates))
        counts = tree_map(lambda s: max(next(numels), 1), sums)  # one per leaf, None included

        def rule(u: torch.Tensor, sum_sq: torch.Tensor, n: int) -> torch.Tensor:
            denom = torch.clamp((sum_sq / n).sqrt() / threshold, min=1.0)
            return u / denom.to(u.dtype)

        return map_updates(rule, updates, sums, counts)

    return with_kind(stateless(apply), Kind.PER_TENSOR, "clip_by_block_rms")


def lamb(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> Transformation:
    """LAMB (You et al., 2019), as ``optax.lamb``: Adam's direction
    ``a = m_hat / (sqrt(v_hat + eps_root) + eps)``, plus ``weight_decay * p`` (where ``mask``),
    scaled by the trust ratio ``||p|| / ||a + wd p||`` of each whole tensor:
    ``p' = p - lr * ratio * (a + wd p)``.

    Example:
        >>> import torch
        >>> tx = lamb(lr=0.1)
        >>> params = [torch.tensor([3.0, 4.0])]
        >>> tx.update([torch.tensor([1.0, -1.0])], tx.init(params), params)[0]
        [tensor([-0.3536,  0.3536])]
    """
    check_learning_rate("lamb", lr)
    check_decay("lamb", "b1", b1)
    check_decay("lamb", "b2", b2)
    tx = chain(
        scale_by_adam_root(b1, b2, eps, eps_root),
        decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(lr),
    )
    return with_kind(tx, Kind.PER_TENSOR, "lamb")


def lars(
    lr: ScalarOrSchedule,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    trust_ratio_mask: Any = True,
    momentum: float = 0.9,
    nesterov: bool = False,
) -> Transformation:
    """LARS (You et al., 2017), as ``optax.lars``: ``d = g + wd p`` (where
    ``weight_decay_mask``), scaled by ``tc * ||p|| / (||d|| + eps)`` per whole tensor (where
    ``trust_ratio_mask``), times ``-lr``, then heavy-ball momentum ``b' = momentum b + d``
    (``d + momentum b'`` with ``nesterov``): ``p' = p + b'``.

    Example:
        >>> import torch
        >>> tx = lars(lr=1.0, trust_coefficient=1.0)
        >>> params = [torch.tensor([3.0, 4.0])]
        >>> tx.update([torch.tensor([0.0, 2.0])], tx.init(params), params)[0]
        [tensor([ 0., -5.])]
    """
    check_learning_rate("lars", lr)
    expect(momentum >= 0, "lars", "momentum >= 0", momentum)
    tx = chain(
        decayed_weights(weight_decay, weight_decay_mask),
        masked_if(
            scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask
        ),
        scale_by_learning_rate(lr),
        trace(momentum, nesterov=nesterov),
    )
    return with_kind(tx, Kind.PER_TENSOR, "lars")


class ScaleByNovogradState(NamedTuple):
    """Per-parameter counts, first moments ``mu`` and NovoGrad's per-tensor second moment
    ``nu`` (a 0-d tensor per parameter, the same on every piece of it)."""

    count: PyTree
    mu: PyTree
    nu: PyTree


def _novograd_step(b1: float, b2: float, eps: float, eps_root: float, wd: float) -> Transformation:
    def init(params: PyTree) -> ScaleByNovogradState:
        nu = tree_map(lambda p: None if p is None else p.new_zeros(()), params)
        return ScaleByNovogradState(init_count(params), zeros_in(params), nu)

    def rule(g: Any, p: Any, sq: Any, count: Any, mu: Any, nu: Any) -> tuple[Any, ...]:
        first = count == 0
        nu = torch.where(first, sq.to(nu.dtype), b2 * nu + (1 - b2) * sq.to(nu.dtype))
        step = g / ((nu + eps_root).sqrt() + eps).to(g.dtype)
        if wd != 0:
            step = step + wd * p
        mu = torch.where(first, step, b1 * mu + step)
        return mu, sq, count + 1, mu, nu

    def update(updates: PyTree, state: ScaleByNovogradState, params: PyTree | None = None) -> Any:
        if params is None and wd != 0:
            raise ValueError("novograd: expected params (weight_decay is not 0), got None")
        squares = tensor_sum_sq(updates)  # every rank, every call
        new, parts = leafwise(rule, updates, params, squares, *state)
        return new, ScaleByNovogradState(*parts[1:])

    return with_kind(Transformation(init, update), Kind.PER_TENSOR, "scale_by_novograd")


def novograd(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.25,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
) -> Transformation:
    """NovoGrad (Ginsburg et al., 2019), as ``optax.novograd``: a second moment per tensor,
    ``nu' = b2 nu + (1 - b2) ||g||**2`` (``||g||**2`` at the first step; the norm over the whole
    tensor), ``m' = b1 m + g / (sqrt(nu' + eps_root) + eps) + wd p`` (without ``b1 m`` at the
    first step), ``p' = p - lr * m'``.

    Example:
        >>> import torch
        >>> tx = novograd(lr=0.1)
        >>> params = [torch.zeros(2)]
        >>> tx.update([torch.tensor([3.0, 4.0])], tx.init(params), params)[0]
        [tensor([-0.0600, -0.0800])]
    """
    check_learning_rate("novograd", lr)
    check_decay("novograd", "b1", b1)
    check_decay("novograd", "b2", b2)
    tx = chain(_novograd_step(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(lr))
    return with_kind(tx, Kind.PER_TENSOR, "novograd")
