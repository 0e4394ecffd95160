"""Moments, bias correction and the shared pieces of the optax-style library.

The public helpers (:func:`update_moment`, :func:`update_moment_per_elem_norm`,
:func:`bias_correction`) are what a user needs to write an Adam-like transformation; they are
exported from :mod:`shardopt.core.blocks`. They keep shardopt's conventions: a ``None``
gradient leaves its moment as it was (see [Note: per-parameter step counts]), and a count may
be one tensor or a tree of per-parameter counts.
"""

from __future__ import annotations

from typing import Any

import torch

from shardopt.core._base import Transformation, identity
from shardopt.core._combinators import masked
from shardopt.core._kinds import Kind, with_kind
from shardopt.core._reduce import whole_reference
from shardopt.core._scalars import is_zero
from shardopt.core._transforms import add_decayed_weights
from shardopt.core._tree import PyTree, tree_leaves, tree_map, tree_structure

__all__ = [
    "bias_correction",
    "decayed_weights",
    "map_updates",
    "masked_if",
    "moment",
    "moment_per_elem_norm",
    "nothing",
    "same_structure",
    "update_moment",
    "update_moment_per_elem_norm",
    "whole_numels",
    "zeros_in",
]


def moment(g: torch.Tensor, m: torch.Tensor, decay: Any, order: int = 1) -> torch.Tensor:
    """One leaf's ``(1 - decay) * g**order + decay * m``, in ``m``'s dtype."""
    x = g.to(m.dtype)
    return (1 - decay) * (x if order == 1 else x**order) + decay * m


def moment_per_elem_norm(g: torch.Tensor, m: torch.Tensor, decay: Any, order: int) -> torch.Tensor:
    """One leaf's ``(1 - decay) * |g|**order + decay * m`` (``g * g`` for order 2)."""
    x = g.to(m.dtype)
    power = x * x if order == 2 else x.abs() ** order
    return (1 - decay) * power + decay * m


def update_moment(updates: PyTree, moments: PyTree, decay: Any, order: int = 1) -> PyTree:
    """The exponential moving average of ``updates**order``: per leaf
    ``m' = (1 - decay) * g**order + decay * m``; where ``g`` is None, ``m`` is kept.

    Example:
        >>> import torch
        >>> update_moment([torch.tensor([2.0]), None], [torch.zeros(1), torch.ones(1)], 0.5)
        [tensor([1.]), tensor([1.])]
    """
    return tree_map(lambda g, m: m if g is None else moment(g, m, decay, order), updates, moments)


def update_moment_per_elem_norm(
    updates: PyTree, moments: PyTree, decay: Any, order: int = 2
) -> PyTree:
    """The moving average of ``|updates|**order`` (``g * g`` for order 2): per leaf
    ``m' = (1 - decay) * |g|**order + decay * m``; where ``g`` is None, ``m`` is kept.

    Example:
        >>> import torch
        >>> update_moment_per_elem_norm([torch.tensor([-2.0])], [torch.zeros(1)], 0.75)
        [tensor([1.])]
    """
    return tree_map(
        lambda g, m: m if g is None else moment_per_elem_norm(g, m, decay, order),
        updates,
        moments,
    )


def bias_correction(moment_tree: PyTree, decay: Any, count: PyTree) -> PyTree:
    """Adam's debiasing: per leaf ``m / (1 - decay**count)``, where ``count`` (the number of
    updates including this one) is a tensor or a tree of per-parameter counts like the moments.

    Example:
        >>> import torch
        >>> bias_correction([torch.tensor([0.1])], 0.9, torch.tensor(1.0))
        [tensor([1.0000])]
    """

    def correct(m: torch.Tensor | None, c: torch.Tensor) -> torch.Tensor | None:
        return None if m is None else m / (1 - decay**c).to(m.dtype)

    if isinstance(count, torch.Tensor):
        return tree_map(lambda m: correct(m, count), moment_tree)
    return tree_map(correct, moment_tree, count)


def zeros_in(params: PyTree, dtype: torch.dtype | None = None, value: float = 0.0) -> PyTree:
    """A tensor of ``value`` shaped like each leaf, in ``dtype`` (the leaf's where None)."""
    return tree_map(
        lambda p: None if p is None else torch.full_like(p, value, dtype=dtype or p.dtype), params
    )


def nothing() -> Transformation:
    """:func:`~shardopt.core.identity`, declared elementwise."""
    return with_kind(identity(), Kind.ELEMENTWISE, "identity")


def masked_if(tx: Transformation, mask: Any) -> Transformation:
    """optax's ``mask`` argument: None or True applies ``tx`` to every leaf, False to none,
    anything else (a tree of bools or a callable of the params) goes to
    :func:`~shardopt.core.masked`."""
    if mask is None or mask is True:
        return tx
    if mask is False:
        return nothing()
    return masked(tx, mask)


def decayed_weights(weight_decay: Any, mask: Any) -> Transformation:
    """optax's ``add_decayed_weights(weight_decay, mask)``; nothing at all for a zero float."""
    if is_zero(weight_decay):
        return nothing()
    return masked_if(add_decayed_weights(weight_decay), mask)


def map_updates(rule: Any, updates: PyTree, *trees: PyTree) -> PyTree:
    """``rule(u, *xs)`` for each leaf ``u`` of ``updates`` with the leaves of ``trees`` beside it;
    None where ``u`` is None."""
    return tree_map(lambda u, *xs: None if u is None else rule(u, *xs), updates, *trees)


def whole_numels(tree: PyTree) -> list[int]:
    """The element count of each leaf's whole tensor: the leaf's own in one process, the whole
    tensor's (from the scope, no collective) where the leaves are pieces under ``shard``."""
    leaves = tree_leaves(tree)
    found = whole_reference(tree)
    if found is None:
        return [0 if x is None else x.numel() for x in leaves]
    whole, of_leaf = found
    whole_leaves = tree_leaves(whole)
    return [whole_leaves[w].numel() for w in of_leaf]


def same_structure(api: str, a: PyTree, b: PyTree) -> None:
    """Raises unless ``a`` and ``b`` have one tree structure (params and updates)."""
    if tree_structure(a) != tree_structure(b):
        raise ValueError(
            f"{api}: expected params with the structure of the updates {tree_structure(a)}, "
            f"got {tree_structure(b)}"
        )
