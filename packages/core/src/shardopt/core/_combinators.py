"""Combinators: a transformation for some leaves (``masked``) or one per label (``partition``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

from torch.utils import _pytree as pytree

from shardopt.core._base import Transformation, inherit_whole_tensors, needs_whole_tensors
from shardopt.core._reduce import resolved, sub_scope, whole_reference
from shardopt.core._tree import PyTree, tree_leaves, tree_structure

__all__ = [
    "MaskedState",
    "PartitionState",
    "masked",
    "PartitionRule",
    "partition",
    "partition_rule",
    "whole_tensor_mask",
]

LeafSpec = PyTree | Callable[[PyTree], PyTree]

# [Note: sub-lists as param groups]
# ``masked`` and ``partition`` hand each inner transformation the flat *list* of its leaves, in
# the leaf order of the params tree (``None`` counted as a leaf), not a copy of the tree with
# holes. That is exactly the ``params`` list of a torch.optim param group, so the inner state of
# a label reads like the state of that group; and an inner transformation never sees (and never
# has to skip) a leaf that is not its own. A ``None`` gradient inside a group still reaches the
# inner transformation, which skips it as usual. The mask or labels are plain Python values
# (bools, hashable labels), resolved again at every call: they are static structure, so the
# combinators trace under torch.func.grad and torch.func.vmap.


class MaskedState(NamedTuple):
    """The state of :func:`masked`: the inner state over the list of selected leaves."""

    inner_state: Any


class PartitionState(NamedTuple):
    """The state of :func:`partition`: one inner state per label, over that label's leaves."""

    inner_states: dict[Hashable, Any]


# [Note: masks and labels of whole tensors]
# Under ``shard`` the leaves are pieces of tensors (1-D slices on a flat plan) and a rank holds
# only some. A mask or labels computed on them would see slices (``dim() == 1``), and a static
# tree would not match their structure. So where a scope is active (see [Note: reductions across
# shards]) both are resolved on the whole parameters it describes (meta tensors of the user's
# tree: shape, dim, numel, dtype, and the tree's keys as names), and each piece takes its
# tensor's value; the inner transformations run in a narrowed scope (``sub_scope``) whose whole
# parameters are those of their group, so nested combinators and reduction blocks still see
# whole tensors.


def _resolve(api: str, what: str, spec: LeafSpec, reference: PyTree) -> list[Any]:
    """The per-leaf values of ``spec`` (a tree shaped like ``reference``, or a callable of it):
    of the leaves' whole tensors where a scope is active."""
    return _resolve_whole(api, what, spec, reference)[0]


def _resolve_whole(
    api: str, what: str, spec: LeafSpec, reference: PyTree
) -> tuple[list[Any], list[Any] | None]:
    """(the per-leaf values of ``spec``, the values of every whole tensor in scope or None)."""
    whole = whole_reference(reference)
    if whole is None:
        return _resolve_on(api, what, spec, reference), None
    tree, of_leaf = whole
    values = resolved(spec, lambda: _resolve_on(api, what, spec, tree))
    return [values[w] for w in of_leaf], values


def _resolve_on(api: str, what: str, spec: LeafSpec, reference: PyTree) -> list[Any]:
    tree = spec(reference) if callable(spec) else spec
    got, expected = tree_structure(tree), tree_structure(reference)
    if got != expected:
        raise ValueError(
            f"{api}: expected {what} with the tree structure of the params {expected}, got {got}"
        )
    return tree_leaves(tree)


def _check_same_structure(api: str, updates: PyTree, params: PyTree | None) -> None:
    if params is not None and tree_structure(updates) != tree_structure(params):
        raise ValueError(
            f"{api}: expected updates and params of the same structure, got "
            f"{tree_structure(updates)} and {tree_structure(params)}"
        )


class _Group(NamedTuple):
    """The leaves of one mask value or label: their indices, and in a scope the indices of their
    whole tensors among the scope's (None in one process)."""

    members: list[int]
    whole: list[int] | None


def _groups(values: list[Any], whole: list[Any] | None, keys: Sequence[Any]) -> dict[Any, _Group]:
    """The leaves (and whole tensors) of each key, from per-leaf and per-whole values."""
    out = {}
    for key in keys:
        index = [i for i, v in enumerate(values) if v == key]
        wholes = None if whole is None else [w for w, v in enumerate(whole) if v == key]
        out[key] = _Group(index, wholes)
    return out


def _update_group(
    api: str,
    tx: Transformation,
    group: _Group,
    updates: list[Any],
    params: list[Any] | None,
    state: Any,
    out: list[Any],
) -> Any:
    """Runs ``tx`` on the leaves of ``group``, puts their updates in ``out``, returns its state."""
    index = group.members
    sub_params = None if params is None else [params[i] for i in index]
    with sub_scope(group.whole or [], index):
        sub_updates, new_state = tx.update([updates[i] for i in index], state, sub_params)
    sub_leaves = tree_leaves(sub_updates)
    if len(sub_leaves) != len(index):
        raise ValueError(
            f"{api}: expected the inner transformation to return {len(index)} updates, got "
            f"{len(sub_leaves)}"
        )
    for i, u in zip(index, sub_leaves):
        out[i] = u
    return new_state


def masked(inner: Transformation, mask: LeafSpec) -> Transformation:
    """Applies ``inner`` to the leaves where ``mask`` is True; the other updates pass unchanged.

    ``mask`` is a tree of Python bools with the structure of the params, or a callable that
    returns one from the params (from the updates when ``update`` gets no params). ``inner``
    sees the list of the selected leaves (see [Note: sub-lists as param groups]). Masked-out
    updates are passed through as they come (to freeze parameters, partition them to
    ``scale(0.0)``). It needs whole tensors if ``inner`` does (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> from shardopt.core import add_decayed_weights
        >>> tx = masked(add_decayed_weights(1.0), {"w": True, "b": False})
        >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update({"w": torch.zeros(1), "b": torch.zeros(1)}, tx.init(params), params)[0]
        {'w': tensor([1.]), 'b': tensor([0.])}

    Raises:
        ValueError: if the mask has another structure than the params or a non-bool leaf.
    """

    def selected(reference: PyTree) -> _Group:
        flags, whole = _resolve_whole("masked", "a mask", mask, reference)
        for i, flag in enumerate(flags if whole is None else whole):
            if not isinstance(flag, bool):
                raise ValueError(
                    f"masked: expected a mask of Python bools, got {type(flag).__name__} "
                    f"at leaf {i}"
                )
        return _groups(flags, whole, [True])[True]

    def init(params: PyTree) -> MaskedState:
        leaves, group = tree_leaves(params), selected(params)
        with sub_scope(group.whole or [], group.members):
            return MaskedState(inner.init([leaves[i] for i in group.members]))

    def update(
        updates: PyTree, state: MaskedState, params: PyTree | None = None
    ) -> tuple[PyTree, MaskedState]:
        _check_same_structure("masked", updates, params)
        leaves, spec = pytree.tree_flatten(updates, is_leaf=lambda x: x is None)
        group = selected(updates if params is None else params)
        out = list(leaves)
        p_leaves = None if params is None else tree_leaves(params)
        inner_state = _update_group(
            "masked", inner, group, leaves, p_leaves, state.inner_state, out
        )
        return pytree.tree_unflatten(out, spec), MaskedState(inner_state)

    return inherit_whole_tensors(Transformation(init, update), [inner])


def partition(transforms: Mapping[Hashable, Transformation], labels: LeafSpec) -> Transformation:
    """Applies ``transforms[label]`` to the leaves of each label: param groups, functionally.

    ``labels`` is a tree of hashable labels with the structure of the params, or a callable that
    returns one from the params (from the updates when ``update`` gets no params). Every label
    must be a key of ``transforms``; each transformation sees the list of its leaves (see
    [Note: sub-lists as param groups]), and a label without leaves gets an empty list. It needs
    whole tensors if one of the transformations does (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> from shardopt.core import scale
        >>> tx = partition({"a": scale(2.0), "b": scale(0.0)}, ["a", "b"])
        >>> tx.update([torch.ones(1), torch.ones(1)], tx.init([torch.ones(1)] * 2))[0]
        [tensor([2.]), tensor([0.])]

    Raises:
        ValueError: if ``transforms`` is empty, if the labels have another structure than the
            params, or if a label is not a key of ``transforms``.
    """
    txs = dict(transforms)
    if not txs:
        raise ValueError("partition: expected at least one transformation, got none")

    def labels_of(reference: PyTree) -> list[Hashable]:
        return _known_labels(labels, reference, txs)[0]

    def groups_of(reference: PyTree) -> dict[Hashable, _Group]:
        return _groups(*_known_labels(labels, reference, txs), list(txs))

    def init(params: PyTree) -> PartitionState:
        leaves = tree_leaves(params)
        states = {}
        for k, group in groups_of(params).items():
            with sub_scope(group.whole or [], group.members):
                states[k] = txs[k].init([leaves[i] for i in group.members])
        return PartitionState(states)

    def update(
        updates: PyTree, state: PartitionState, params: PyTree | None = None
    ) -> tuple[PyTree, PartitionState]:
        _check_same_structure("partition", updates, params)
        if list(state.inner_states) != list(txs):
            raise ValueError(
                f"partition: expected a state with labels {list(txs)}, got "
                f"{list(state.inner_states)}"
            )
        leaves, spec = pytree.tree_flatten(updates, is_leaf=lambda x: x is None)
        groups = groups_of(updates if params is None else params)
        p_leaves = None if params is None else tree_leaves(params)
        out = list(leaves)
        new_states = {
            k: _update_group(
                "partition", txs[k], groups[k], leaves, p_leaves, state.inner_states[k], out
            )
            for k in txs
        }
        return pytree.tree_unflatten(out, spec), PartitionState(new_states)

    tx = inherit_whole_tensors(Transformation(init, update), txs.values())
    _PARTITIONS[tx.update] = PartitionRule(txs, labels_of)
    return tx


def _known_labels(
    labels: LeafSpec, reference: PyTree, txs: Mapping[Hashable, Transformation]
) -> tuple[list[Hashable], list[Hashable] | None]:
    """partition's label of each leaf of ``reference`` (and in a scope of each whole tensor);
    raises unless each is a key of ``txs``."""
    out, whole = _resolve_whole("partition", "labels", labels, reference)
    for i, label in enumerate(out if whole is None else whole):
        if label not in txs:
            raise ValueError(
                f"partition: expected every label to be one of {list(txs)}, got {label!r} "
                f"at leaf {i}"
            )
    return out, whole


class PartitionRule(NamedTuple):
    """What :func:`partition` made a transformation of: its transformation per label, in order,
    and ``labels_of(params)``, the label of each leaf (resolved and checked as its ``init``
    does)."""

    transforms: dict[Hashable, Transformation]
    labels_of: Callable[[PyTree], list[Hashable]]


# The partitions made here, by the identity of their update (as [Note: whole tensors] marks):
# what ``whole_tensor_mask`` and ``partition_rule`` read.
_PARTITIONS: weakref.WeakKeyDictionary[Callable[..., Any], PartitionRule] = (
    weakref.WeakKeyDictionary()
)


def whole_tensor_mask(tx: Transformation, params: PyTree) -> list[bool]:
    """For each leaf of ``params``, whether the transformation that updates it needs it whole: per
    label for a :func:`partition` (its labels resolved on ``params``), the same for every leaf
    otherwise (see [Note: whole tensors]). A plan that cuts tensors checks it.

    Example:
        >>> import torch
        >>> from shardopt.core import adamw, muon
        >>> labels = lambda ps: ["m" if p.dim() == 2 else "a" for p in ps]
        >>> tx = partition({"m": muon(), "a": adamw()}, labels)
        >>> whole_tensor_mask(tx, [torch.zeros(2, 2), torch.zeros(2)])
        [True, False]
    """
    rule = _PARTITIONS.get(tx.update)
    if rule is not None:
        return [needs_whole_tensors(rule.transforms[x]) for x in rule.labels_of(params)]
    return [needs_whole_tensors(tx)] * len(tree_leaves(params))


def partition_rule(tx: Transformation) -> PartitionRule | None:
    """The :class:`PartitionRule` of ``tx`` if :func:`partition` made it, else None. A sharded
    state records each plan tensor's label with it, so that its checkpoints keep each label's
    state as that label's optimizer's.

    Example:
        >>> import torch
        >>> from shardopt.core import adamw, muon
        >>> labels = lambda ps: ["m" if p.dim() == 2 else "a" for p in ps]
        >>> rule = partition_rule(partition({"m": muon(), "a": adamw()}, labels))
        >>> list(rule.transforms), rule.labels_of([torch.zeros(2, 2), torch.zeros(2)])
        (['m', 'a'], ['m', 'a'])
        >>> partition_rule(adamw()) is None
        True
    """
    return _PARTITIONS.get(tx.update)
