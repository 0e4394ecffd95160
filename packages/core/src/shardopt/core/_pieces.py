"""The in-place fast path for flat 1-D buffers: rules registered by the optimizer factories."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core._base import WHOLE_TENSORS, Transformation, needs_whole_tensors
from shardopt.core._tree import tree_leaves

__all__ = ["PieceRule", "piece_rule", "update_pieces_", "update_whole_", "with_piece_rule"]

PieceRule = Callable[[list[torch.Tensor], list[torch.Tensor | None], Any], None]

# [Note: piece fast path]
# Sharded code steps a few long 1-D tensors (a rank's shard of a flat buffer, or views of it),
# not a tree of parameters. For that case an optimizer factory registers a *piece rule*: a
# function ``rule(params, grads, state)`` that performs exactly the update of ``tx.update`` +
# ``apply_updates``, but in place, on the lists ``params``/``grads`` and on the tensors of
# ``state = tx.init(params)``, through torch's fused kernels where they exist for the device
# (``torch._fused_adam_`` and friends) and foreach kernels otherwise (SGD on CPU is foreach: see
# [Note: SGD on CPU is foreach] in _fused.py). A ``None`` gradient skips its parameter (no state
# change), as in the pure path. Rules are keyed by the identity of ``tx.update`` (a NamedTuple
# cannot carry attributes); a transformation without a rule still works through
# :func:`update_pieces_`, which falls back to the pure path and copies back.
_RULES: weakref.WeakKeyDictionary[Callable[..., Any], PieceRule] = weakref.WeakKeyDictionary()


def with_piece_rule(tx: Transformation, rule: PieceRule) -> Transformation:
    """Registers ``rule`` as the in-place piece fast path of ``tx`` and returns ``tx``."""
    _RULES[tx.update] = rule
    return tx


def piece_rule(tx: Transformation) -> PieceRule | None:
    """The registered piece rule of ``tx``, or ``None`` if it has none."""
    return _RULES.get(tx.update)


@torch.no_grad()
def update_pieces_(
    tx: Transformation,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    state: Any,
) -> None:
    """Updates ``params`` and ``state`` in place with ``tx``, by its fast path where it has one.

    ``state`` must come from ``tx.init(list(params))``. Without a registered rule, the pure path
    runs and its results are copied back into ``params`` and into the tensors of ``state``.

    Example:
        >>> import torch
        >>> from shardopt.core import scale_by_learning_rate
        >>> tx = scale_by_learning_rate(0.5)
        >>> p = [torch.ones(3)]
        >>> update_pieces_(tx, p, [torch.ones(3)], tx.init(p))
        >>> p
        [tensor([0.5000, 0.5000, 0.5000])]

    Raises:
        ValueError: if there are not as many grads as params, or if ``tx`` needs whole tensors
            (see [Note: whole tensors]): the params here may be slices of flat buffers.
    """
    if needs_whole_tensors(tx):
        raise ValueError(
            f"update_pieces_: {WHOLE_TENSORS[tx.update]} needs whole tensors (it is not "
            "elementwise), so it cannot step slices of flat buffers; run tx.update on the "
            "parameters themselves"
        )
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(
            f"update_pieces_: expected as many grads as params, got {len(grads)} and {len(params)}"
        )
    rule = piece_rule(tx)
    if rule is not None:
        rule(params, grads, state)
    else:  # the pure path, copied back (elementwise: slices are fine)
        update_whole_(tx, params, grads, state)


@torch.no_grad()
def update_whole_(
    tx: Transformation,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    state: Any,
) -> None:
    """Updates whole ``params`` and ``state`` in place with ``tx``'s pure update.

    For transformations that need whole tensors (see [Note: whole tensors]), on tensors of their
    own shapes, e.g. the matrices a rank owns whole: ``tx.update`` runs, its updates are added to
    ``params`` and its new state is copied into the tensors of ``state``.

    Example:
        >>> import torch
        >>> from shardopt.core import muon
        >>> tx, p = muon(lr=0.1, weight_decay=0.0), [torch.eye(2)]
        >>> update_whole_(tx, p, [torch.eye(2)], tx.init(p))
        >>> [round(x, 4) for x in p[0].diagonal().tolist()]
        [0.8875, 0.8875]
    """
    updates, new_state = tx.update(list(grads), state, list(params))
    for p, u in zip(params, updates):
        if u is not None:
            p.add_(u.to(p.dtype))
    for old, new in zip(tree_leaves(state), tree_leaves(new_state)):
        if isinstance(old, torch.Tensor) and old is not new:
            old.copy_(new)
