"""Muon (torch.optim.Muon): momentum orthogonalized by a Newton–Schulz iteration, for matrices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, check_weight_decay, expect
from shardopt.core._foreach import add_like_torch, lr_scalar, operand
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._tree import PyTree, leafwise, tree_leaves, zeros_like_tree

__all__ = ["ScaleByMuonState", "muon", "newton_schulz_flops", "orthogonalize"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    """Per-parameter state of :func:`muon` (torch: ``momentum_buffer``).

    torch.optim.Muon keeps no step count; ``count`` (the updates applied, for schedules) is ours,
    as in :class:`~shardopt.core.TraceState` of SGD.
    """

    count: PyTree
    momentum: PyTree


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Multiply-add flops of :func:`orthogonalize` on a matrix of ``shape`` (``m <= n`` after
    the transpose): per step ``A = X X^T`` (m m n), ``A A`` (m m m) and ``B X`` (m m n). The cost
    to balance when ranks own whole matrices; another shape costs its element count (an
    elementwise update).

    Example:
        >>> newton_schulz_flops((768, 3072)), newton_schulz_flops((768,))
        (20384317440, 768)
    """
    if len(shape) != 2:
        return math.prod(shape)
    m, n = sorted(shape)
    return steps * (2 * m * m * n + m * m * m)


def orthogonalize(
    g: torch.Tensor,
    coefficients: Sequence[float] = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximately ``U V^T`` for ``g = U S V^T``, by ``steps`` quintic Newton–Schulz iterations.

    As torch.optim.Muon, in bfloat16: ``X = g / max(||g||_F, eps)`` (transposed if ``g`` has
    more rows than columns), then ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. The
    coefficients ``(a, b, c)`` move every singular value into a band around 1 in few steps (the
    example's 2 and 0.5 both become 0.73), not to exactly 1. It is a pure function of a 2-D
    ``g`` that returns a bfloat16 tensor of ``g``'s shape, and traces under ``torch.func.grad``
    and ``torch.func.vmap``; under vmap torch runs ``addmm`` as a product and a sum rounded
    apart, so a batch agrees with a loop to a few bfloat16 roundings, not bitwise.

    Example:
        >>> import torch
        >>> orthogonalize(torch.tensor([[2.0, 0.0], [0.0, 0.5]]))
        tensor([[0.7305, 0.0000],
                [0.0000, 0.7305]], dtype=torch.bfloat16)

    Raises:
        ValueError: for a ``g`` that is not 2-D or coefficients that are not three numbers.
    """
    expect(g.dim() == 2, "orthogonalize", "a 2-D g", f"shape {tuple(g.shape)}")
    expect(len(coefficients) == 3, "orthogonalize", "3 coefficients", tuple(coefficients))
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.bfloat16().T if tall else g.bfloat16()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's factor of the lr for a matrix of ``shape`` (rows, columns)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))  # None or "original"


def _expect_matrix(what: str, t: torch.Tensor) -> None:
    expect(t.dim() == 2, "muon", f"2-D {what} (torch.optim.Muon's rule)", f"shape {tuple(t.shape)}")


@dataclass(frozen=True, slots=True)
class MuonHyperparams:
    """The validated hyperparameters of :func:`muon`."""

    lr: ScalarOrSchedule
    weight_decay: float | torch.Tensor
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None

    def __post_init__(self) -> None:
        check_learning_rate("muon", self.lr)
        expect(self.momentum >= 0.0, "muon", "0 <= momentum", self.momentum)
        check_weight_decay("muon", self.weight_decay)
        rule = "adjust_lr_fn None, 'original' or 'match_rms_adamw'"
        expect(self.adjust_lr_fn in _ADJUST_LR_FNS, "muon", rule, repr(self.adjust_lr_fn))
        # torch raises these two at its first step.
        expect(self.ns_steps < 100, "muon", "ns_steps < 100", self.ns_steps)
        coefficients = self.ns_coefficients
        expect(len(coefficients) == 3, "muon", "3 ns_coefficients", coefficients)


def _muon_step(hp: MuonHyperparams) -> Transformation:
    """Momentum, orthogonalization, then torch's two parameter writes (one transformation).

    ``buf = lerp(buf, g, 1 - momentum)``; ``O = orthogonalize(lerp(g, buf, momentum))`` with
    Nesterov, else of ``buf``; ``p *= 1 - lr * weight_decay``; ``p -= lr * ratio * O``. We return
    ``q - p`` for torch's result ``q`` (see [Note: torch's parameter rounding]).
    """
    momentum = hp.momentum

    def init(params: PyTree) -> ScaleByMuonState:
        for p in tree_leaves(params):
            if p is not None:
                _expect_matrix("parameters", p)
        return ScaleByMuonState(init_count(params), zeros_like_tree(params))

    def rule(g: torch.Tensor, p: Any, count: torch.Tensor, buf: torch.Tensor) -> tuple[Any, ...]:
        _expect_matrix("gradients", g)
        _expect_matrix("parameters", p)
        lr = lr_scalar(resolve(hp.lr, count), g)
        buf = torch.lerp(buf, g, 1 - momentum)
        direction = torch.lerp(g, buf, momentum) if hp.nesterov else buf
        o = orthogonalize(direction, hp.ns_coefficients, hp.ns_steps, hp.eps).to(p.dtype)
        q = p * operand(1 - lr * hp.weight_decay, p)
        q = add_like_torch(q, o, -(lr * _lr_ratio(hp.adjust_lr_fn, p.shape)))
        return q - p, count + 1, buf

    def update(
        updates: PyTree, state: ScaleByMuonState, params: PyTree | None = None
    ) -> tuple[PyTree, ScaleByMuonState]:
        if params is None:
            raise ValueError("muon: expected params, got None")
        new, parts = leafwise(rule, updates, params, *state)
        return new, ScaleByMuonState(*parts)

    return with_kind(Transformation(init, update), Kind.SHAPED, "muon")


def muon(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float | torch.Tensor = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> Transformation:
    """``torch.optim.Muon`` as a pure transformation (same hyperparameters and defaults).

    For 2-D parameters only, as torch: ``init`` and ``update`` raise for others (partition the
    rest to another optimizer). Each step orthogonalizes the (Nesterov) momentum of a whole matrix
    with :func:`orthogonalize` (bfloat16, as torch), applies the decoupled weight decay
    ``p *= 1 - lr * weight_decay`` and steps by ``lr`` times torch's shape ratio
    (``adjust_lr_fn``). ``lr`` may be a float, a 0-d tensor or a schedule of the per-parameter
    count. It has no piece fast path: it needs whole tensors (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> tx = muon(lr=0.1, weight_decay=0.0)
        >>> params = [torch.zeros(2, 2)]
        >>> tx.update([torch.eye(2)], tx.init(params), params)[0]
        [tensor([[-0.1125,  0.0000],
                [ 0.0000, -0.1125]])]

    Raises:
        ValueError: for a negative ``lr``, ``weight_decay`` or ``momentum``, an unknown
            ``adjust_lr_fn``, ``ns_steps >= 100`` or ``ns_coefficients`` not three numbers; and
            from ``init``/``update`` for parameters or gradients that are not 2-D.
    """
    hp = MuonHyperparams(
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn
    )
    return with_kind(chain(_muon_step(hp)), Kind.SHAPED, "muon")
