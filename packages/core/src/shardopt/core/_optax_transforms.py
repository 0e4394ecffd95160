"""Transforms as optax's: ``adaptive_grad_clip``, ``centralize``, ``zero_nans``, ``add_noise``.

``adaptive_grad_clip`` and ``centralize`` read each tensor in its shape (per-row norms, means
over dimensions): ``Kind.SHAPED``, run on whole tensors, refused on plans that cut one.
``zero_nans`` is elementwise in its update but records per tensor whether it held a NaN
(``Kind.PER_TENSOR``, through a reduction block). ``add_noise`` draws each tensor's noise whole
from a seed of (key, tensor, count), so that a value does not depend on how tensors are cut:
``Kind.SHAPED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, init_count, stateless
from shardopt.core._checks import expect
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._moments import map_updates, same_structure
from shardopt.core._reduce import row_norm, tensor_sum, whole_reference
from shardopt.core._tree import PyTree, tree_leaves, tree_map

__all__ = [
    "AddNoiseState",
    "ZeroNansState",
    "adaptive_grad_clip",
    "add_noise",
    "centralize",
    "unitwise_norm",
    "zero_nans",
]


def unitwise_norm(x: torch.Tensor, axis: int | Sequence[int] | None = None) -> torch.Tensor:
    """The 2-norm of each unit of ``x``, broadcast to ``x``'s shape: over ``axis`` where given;
    else over all of a scalar or vector (``x.squeeze().dim() <= 1``), and over every dimension
    but the first otherwise (torch's layouts: a Linear weight is ``(out, in)``, a convolution's
    ``(out, in, *kernel)``, so a unit is an output row; optax's JAX layouts put the output last).

    Example:
        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([[5., 5.],
                [1., 1.]])
    """
    if axis is not None:
        dims: Any = axis
    elif x.squeeze().dim() <= 1:
        dims = None
    else:
        dims = tuple(range(1, x.dim()))
    norm = torch.linalg.vector_norm(x, 2.0, dim=dims, keepdim=True)
    return norm.expand(x.shape) if x.dim() else norm.reshape(())


def adaptive_grad_clip(
    clipping: float, eps: float = 1e-3, axis: int | Sequence[int] | None = None
) -> Transformation:
    """Adaptive gradient clipping (Brock et al., 2021), as optax's: each unit's gradient ``g``
    (see :func:`unitwise_norm`) is scaled to at most ``clipping * max(||p||, eps)``:
    ``g' = g`` where ``||g|| < max_norm``, else ``g * max_norm / max(||g||, 1e-6)``. Needs
    ``params``. With the default units (output rows) the norms come from the ``row_norm``
    reduction block, so it runs on slices (``Kind.PER_TENSOR``); with an ``axis``, each tensor
    whole in its shape (``Kind.SHAPED``).

    Example:
        >>> tx = adaptive_grad_clip(0.5)
        >>> g = [torch.tensor([[3.0, 4.0], [0.1, 0.0]])]
        >>> p = [torch.tensor([[1.0, 0.0], [1.0, 0.0]])]
        >>> tx.update(g, tx.init(p), p)[0]
        [tensor([[0.3000, 0.4000],
                [0.1000, 0.0000]])]
    """
    expect(clipping >= 0, "adaptive_grad_clip", "clipping >= 0", clipping)

    def clipped(g: torch.Tensor, g_norm: torch.Tensor, p_norm: torch.Tensor) -> torch.Tensor:
        max_norm = clipping * torch.clamp(p_norm, min=eps)
        scaled = g * (max_norm / torch.clamp(g_norm, min=1e-6)).to(g.dtype)
        return torch.where(g_norm < max_norm, g, scaled)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        if params is None:
            raise ValueError("adaptive_grad_clip: expected params, got None")
        same_structure("adaptive_grad_clip", updates, params)
        if axis is not None:  # units of the caller's choosing: each tensor whole in its shape
            return map_updates(
                lambda g, p: clipped(g, unitwise_norm(g, axis), unitwise_norm(p, axis)),
                updates,
                params,
            )
        g_norms, p_norms = row_norm(updates), row_norm(params)  # blocks: rows of whole tensors
        return tree_map(
            lambda g, gn, pn: None if g is None else clipped(g, gn, pn), updates, g_norms, p_norms
        )

    # rows (all dimensions but the first) through the row_norm block, so slices are fine; an
    # explicit axis reads the shape
    kind = Kind.PER_TENSOR if axis is None else Kind.SHAPED
    return with_kind(stateless(apply), kind, "adaptive_grad_clip")


def centralize() -> Transformation:
    """Gradient centralization (Yong et al., 2020), as optax's: a tensor of 2 or more
    dimensions loses its mean over every dimension but the first, ``g' = g - mean(g, dims 1..)``;
    scalars and vectors pass unchanged. Each tensor whole in its shape (``Kind.SHAPED``).

    Example:
        >>> tx = centralize()
        >>> tx.update([torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.ones(2)], tx.init(None))[0]
        [tensor([[-1.,  1.],
                [ 0.,  0.]]), tensor([1., 1.])]
    """

    def rule(g: torch.Tensor) -> torch.Tensor:
        if g.dim() <= 1:
            return g
        return g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)

    def apply(updates: PyTree, params: PyTree | None) -> PyTree:
        del params
        return map_updates(rule, updates)

    return with_kind(stateless(apply), Kind.SHAPED, "centralize")


def _false(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=p.device)


class ZeroNansState(NamedTuple):
    """Per parameter, whether its last update held a NaN (a bool 0-d tensor)."""

    found_nan: PyTree


def zero_nans() -> Transformation:
    """Replaces NaNs in the updates by 0, as optax's, and records per tensor (over the whole
    tensor, through a reduction block) whether it held one.

    Example:
        >>> tx = zero_nans()
        >>> u, state = tx.update([torch.tensor([1.0, float("nan")])], tx.init([torch.zeros(2)]))
        >>> u, state.found_nan
        ([tensor([1., 0.])], [tensor(True)])
    """

    def init(params: PyTree) -> ZeroNansState:
        return ZeroNansState(tree_map(lambda p: None if p is None else _false(p), params))

    def update(updates: PyTree, state: ZeroNansState, params: PyTree | None = None) -> Any:
        del params
        nans = tensor_sum(map_updates(torch.isnan, updates))  # every rank, every call
        found = tree_map(lambda n, old: old if n is None else n > 0, nans, state.found_nan)
        new = map_updates(lambda u: torch.where(torch.isnan(u), torch.zeros_like(u), u), updates)
        return new, ZeroNansState(found)

    return with_kind(Transformation(init, update), Kind.PER_TENSOR, "zero_nans")


class AddNoiseState(NamedTuple):
    """Per-parameter counts of the updates noised."""

    count: PyTree


def _leaf_indices(updates: PyTree) -> list[int]:
    """Each leaf's index among the whole tensors: its own in one process, from the scope under
    ``shard`` (so a tensor draws the same noise wherever it is updated)."""
    found = whole_reference(updates)
    return list(range(len(tree_leaves(updates)))) if found is None else list(found[1])


def add_noise(eta: float, gamma: float, key: int = 0) -> Transformation:
    """Adds Gaussian noise of variance ``eta / t**gamma`` (``t`` the parameter's count of
    updates, this one included), as optax's ``add_noise`` (Neelakantan et al., 2015). Each
    tensor's noise is drawn whole from torch's CPU generator seeded by ``(key, tensor index,
    t)``: reproducible and independent of the cut, not optax's stream. Reads the count on the
    host (a sync; not traceable under ``torch.func``).

    Example:
        >>> tx = add_noise(eta=0.0, gamma=0.55, key=1)
        >>> tx.update([torch.ones(2)], tx.init([torch.zeros(2)]))[0]
        [tensor([1., 1.])]
    """
    expect(eta >= 0, "add_noise", "eta >= 0", eta)

    def rule(g: torch.Tensor, index: int, count: torch.Tensor) -> torch.Tensor:
        t = count + 1
        generator = torch.Generator().manual_seed(hash((key, index, int(t))) & (2**63 - 1))
        noise = torch.randn(g.shape, generator=generator, dtype=torch.float32)
        std = (eta / t**gamma).sqrt()
        return g + (std * noise.to(g.device)).to(g.dtype)

    def update(updates: PyTree, state: AddNoiseState, params: PyTree | None = None) -> Any:
        del params
        indices = iter(_leaf_indices(updates))
        index_tree = tree_map(lambda u: next(indices), updates)
        new = map_updates(rule, updates, index_tree, state.count)
        count = tree_map(lambda u, c: c if u is None else c + 1, updates, state.count)
        return new, AddNoiseState(count)

    def init(params: PyTree) -> AddNoiseState:
        return AddNoiseState(init_count(params))

    return with_kind(Transformation(init, update), Kind.SHAPED, "add_noise")
