"""Gradient clipping: elementwise (``clip``) and by the global 2-norm (``clip_by_global_norm``)."""

from __future__ import annotations

import torch

from shardopt.core._base import Transformation, stateless
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._reduce import current_scope, tree_norm
from shardopt.core._tree import PyTree, leafwise, tree_leaves

__all__ = ["clip", "clip_by_global_norm", "global_norm"]

# [Note: clipping epsilon]
# torch.nn.utils.clip_grad_norm_ scales by max_norm / (total_norm + 1e-6), clamped to at most 1.
# The same constant and the same order of operations (per-tensor 2-norms, the 2-norm of their
# stack, one multiplication per gradient) make our clipped gradients bitwise equal to torch's on
# the same device and dtype. The clamp replaces an ``if total_norm > max_norm`` branch, so the
# transformation traces under torch.func.grad and torch.func.vmap (each ensemble member is
# clipped by its own norm under vmap).
_CLIP_EPS = 1e-6


def _check_nonnegative(api: str, name: str, value: float | torch.Tensor) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{api}: expected a 0-d tensor {name}, got shape {tuple(value.shape)}")
        return  # a tensor may be traced: its value is not inspected
    if not value >= 0.0:
        raise ValueError(f"{api}: expected {name} >= 0, got {value}")


def clip(max_delta: float | torch.Tensor) -> Transformation:
    """Clamps every update element to ``[-max_delta, max_delta]`` (torch's ``clip_grad_value_``).

    Example:
        >>> import torch
        >>> tx = clip(1.0)
        >>> tx.update([torch.tensor([-3.0, 0.5, 2.0])], tx.init(None))[0]
        [tensor([-1.0000,  0.5000,  1.0000])]

    Raises:
        ValueError: if ``max_delta`` is a negative number.
    """
    _check_nonnegative("clip", "max_delta", max_delta)

    def rule(g: torch.Tensor, p: None) -> tuple[torch.Tensor]:
        if isinstance(max_delta, torch.Tensor):
            bound = max_delta.to(g.device, g.dtype)
            return (torch.clamp(g, -bound, bound),)
        return (g.clamp(-max_delta, max_delta),)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        new, _ = leafwise(rule, updates, None)
        return new

    return with_kind(stateless(apply), Kind.ELEMENTWISE, "clip")


def global_norm(updates: PyTree) -> torch.Tensor | None:
    """The 2-norm of all non-``None`` leaves seen as one vector, ``None`` if there are none (in
    one process; under ``shard`` the whole tree's norm, 0 for none: see [Note: reductions across
    shards]).

    Example:
        >>> import torch
        >>> global_norm([torch.tensor([3.0]), None, torch.tensor(4.0)])
        tensor(5.)
    """
    if current_scope() is not None:  # pieces of tensors: summed over ranks (one all-reduce)
        return tree_norm(updates)
    leaves = [g for g in tree_leaves(updates) if g is not None]
    if not leaves:
        return None
    device = leaves[0].device
    norms = [torch.linalg.vector_norm(g, 2.0).to(device) for g in leaves]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_by_global_norm(max_norm: float | torch.Tensor) -> Transformation:
    """Scales all updates by ``min(max_norm / (total_norm + 1e-6), 1)``, as ``clip_grad_norm_``.

    ``total_norm`` is the 2-norm of all non-``None`` leaves together; ``None`` leaves pass
    through. See [Note: clipping epsilon].

    Example:
        >>> import torch
        >>> tx = clip_by_global_norm(1.0)
        >>> tx.update([torch.tensor([3.0, 4.0]), None], tx.init(None))[0]
        [tensor([0.6000, 0.8000]), None]

    Raises:
        ValueError: if ``max_norm`` is a negative number.
    """
    _check_nonnegative("clip_by_global_norm", "max_norm", max_norm)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        total = global_norm(updates)
        if total is None:  # no gradient at all: nothing to scale
            return updates
        coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
        new, _ = leafwise(lambda g, p: (g * coef.to(g.device, g.dtype),), updates, None)
        return new

    return with_kind(stateless(apply), Kind.WHOLE_TREE, "clip_by_global_norm")
