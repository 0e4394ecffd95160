"""The in-place fast path for flat 1-D buffers: rules registered by the optimizer factories."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core._base import WHOLE_TENSORS, Transformation, needs_whole_tensors
from shardopt.core._tree import tree_leaves

__all__ = [
    "PieceRule",
    "PiecePreparer",
    "PreparedPieces",
    "piece_rule",
    "prepare_pieces",
    "update_pieces_",
    "update_whole_",
    "with_piece_rule",
]

PieceRule = Callable[[list[torch.Tensor], list[torch.Tensor | None], Any], None]
# update(grads, state) -> whether it updated (False: run the rule instead); see [Note: prepared
# pieces]. ``base`` is what the last preparation for the same tensors left (its ``base``).
PreparedPieces = Callable[[list[torch.Tensor], Any], bool]
PiecePreparer = Callable[..., "PreparedPieces | None"]

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
_PREPARERS: weakref.WeakKeyDictionary[Callable[..., Any], PiecePreparer] = (
    weakref.WeakKeyDictionary()
)

# [Note: prepared pieces]
# A rule does some work per tensor at every call: it drops the parameters without a gradient,
# picks a kernel, gathers each state field into a list and groups the launches. The sharding
# engine steps the same pieces with the same state tensors at every step, so that work is the
# same each time. A factory may register a *preparer* beside its rule:
# ``prepare(params, state, base=None)`` does the per-tensor work once and returns
# ``update(grads, state)``, which updates ``params`` and the tensors of ``state`` in place with one
# launch per kernel (a list of tensors is one operator), and nothing per tensor in Python. It
# serves a step where every parameter has a gradient of its own dtype and device, contiguous;
# that is the caller's promise, not checked. It computes exactly what the rule computes (the same
# kernels on the same tensors in the same order), and returns False where the rule would take
# another path (a schedule, tensor hyperparameters); the caller then runs the rule. Counts that
# are consecutive elements of one tensor (the engine's per-piece buffers) advance by one ``add_``
# on that slice instead of a list of 0-d tensors. ``base`` (the returned function's ``base``
# attribute) lets a later preparation for the same tensors skip the walk (inject_hyperparams
# prepares again when its values change).


def with_piece_rule(
    tx: Transformation, rule: PieceRule, prepare: PiecePreparer | None = None
) -> Transformation:
    """Registers ``rule`` as the in-place piece fast path of ``tx`` (and ``prepare`` as its
    preparer, see [Note: prepared pieces]) and returns ``tx``."""
    _RULES[tx.update] = rule
    if prepare is not None:
        _PREPARERS[tx.update] = prepare
    return tx


def prepare_pieces(
    tx: Transformation, params: Sequence[torch.Tensor], state: Any, base: Any = None
) -> PreparedPieces | None:
    """``update(grads, state)`` for these ``params`` and ``state`` (``tx.init(params)``), with
    the per-tensor work of ``tx``'s piece rule done now; None where ``tx`` has no preparer or
    these tensors do not suit it (see [Note: prepared pieces]).

    Example:
        >>> import torch
        >>> from shardopt.core import adamw
        >>> from shardopt.core.blocks import prepare_pieces
        >>> tx, p = adamw(lr=0.1), [torch.ones(3), torch.ones(2)]
        >>> state = tx.init(p)
        >>> update = prepare_pieces(tx, p, state)
        >>> update([torch.ones(3), torch.ones(2)], state), [round(x, 4) for x in p[1].tolist()]
        (True, [0.899, 0.899])
    """
    prepare = _PREPARERS.get(tx.update)
    if prepare is None or needs_whole_tensors(tx) or not params:
        return None
    return prepare(list(params), state, base)


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
