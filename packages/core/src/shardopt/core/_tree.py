"""Pytree helpers over torch.utils._pytree; a None leaf means "no gradient for this parameter"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

PyTree = Any

__all__ = ["PyTree", "leafwise", "tree_leaves", "tree_map", "tree_structure", "zeros_like_tree"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # leaves for any pytree registry
_PLAIN_OR_NONE = frozenset((*_PLAIN, type(None)))  # checked at C speed: nothing per leaf


def _is_none(x: Any) -> bool:
    return x is None


def tree_leaves(tree: PyTree) -> list[Any]:
    """Returns the leaves of ``tree`` in order, counting ``None`` as a leaf.

    Example:
        >>> import torch
        >>> tree_leaves({"a": torch.zeros(2), "b": [None, torch.ones(())]})
        [tensor([0., 0.]), None, tensor(1.)]
    """
    if type(tree) is list and _PLAIN_OR_NONE.issuperset(map(type, tree)):
        return list(tree)  # the usual case (a list of parameters), without the pytree walk
    return pytree.tree_flatten(tree, is_leaf=_is_none)[0]


def tree_structure(tree: PyTree) -> pytree.TreeSpec:
    """Returns the structure of ``tree`` with ``None`` counted as a leaf."""
    return pytree.tree_flatten(tree, is_leaf=_is_none)[1]


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Maps ``fn`` over the leaves of ``tree`` and of ``rest`` (same structure, ``None`` is a leaf).

    Example:
        >>> import torch
        >>> tree_map(lambda a, b: a + b, [torch.ones(1)], [torch.ones(1)])
        [tensor([2.])]

    Raises:
        ValueError: if a tree in ``rest`` has another structure than ``tree``.
    """
    leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_none)
    others = []
    for other in rest:
        other_leaves, other_spec = pytree.tree_flatten(other, is_leaf=_is_none)
        if other_spec != spec:
            raise ValueError(
                f"tree_map: expected trees of the same structure, got {spec} and {other_spec}"
            )
        others.append(other_leaves)
    return pytree.tree_unflatten([fn(*xs) for xs in zip(leaves, *others)], spec)


def leafwise(
    fn: Callable[..., Sequence[Any]],
    grads: PyTree,
    params: PyTree | None,
    *states: PyTree,
) -> tuple[PyTree, tuple[PyTree, ...]]:
    """Applies a per-parameter update rule, skipping parameters whose gradient is ``None``.

    ``fn(g, p, *state_leaves)`` returns ``(update, *new_state_leaves)``. Where ``g`` is ``None``
    the update is ``None`` and the state leaves are passed through unchanged: the semantics of
    ``torch.optim``, which skips parameters without a gradient (no state change, no step count).

    Example:
        >>> import torch
        >>> rule = lambda g, p, m: (-(m + g), m + g)
        >>> updates, (mom,) = leafwise(rule, [torch.ones(1), None], None,
        ...                            [torch.zeros(1), torch.zeros(1)])
        >>> updates, mom
        ([tensor([-1.]), None], [tensor([1.]), tensor([0.])])

    Returns:
        ``(updates, new_states)`` with ``new_states`` a tuple of trees, one per tree in ``states``.
    """
    g_leaves, spec = pytree.tree_flatten(grads, is_leaf=_is_none)
    n = len(g_leaves)
    p_leaves = [None] * n if params is None else tree_leaves(params)
    s_leaves = [tree_leaves(s) for s in states]
    if len(p_leaves) != n or any(len(s) != n for s in s_leaves):
        raise ValueError(
            f"leafwise: expected params and states with {n} leaves like grads, got "
            f"{len(p_leaves)} and {[len(s) for s in s_leaves]}"
        )
    updates: list[Any] = []
    new_states: list[list[Any]] = [[] for _ in states]
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        olds = [s[i] for s in s_leaves]
        if g is None:
            out: Sequence[Any] = (None, *olds)
        else:
            out = fn(g, p, *olds)
        updates.append(out[0])
        for acc, leaf in zip(new_states, out[1:]):
            acc.append(leaf)
    return (
        pytree.tree_unflatten(updates, spec),
        tuple(pytree.tree_unflatten(s, spec) for s in new_states),
    )


def zeros_like_tree(tree: PyTree) -> PyTree:
    """Zeros shaped like each tensor leaf (``None`` stays ``None``)."""
    return tree_map(lambda x: None if x is None else torch.zeros_like(x), tree)
