"""What checkpoints call the fields of a sharded state: torch.optim's keys, and piece accessors."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import torch
from torch.utils import _pytree as pytree

from shardopt.core import Transformation
from shardopt.core.blocks import TORCH_COMPAT
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._state import (
    FieldGranularity,
    ShardedState,
    StateField,
    piece_list_pred,
    piece_slots,
    without_hyperparams,
)

__all__ = [
    "STATE_KEYS",
    "FieldKeys",
    "ListField",
    "Field",
    "OptimizerKeys",
    "ShapedState",
    "field_keys",
    "has_state",
    "keys_of",
    "outside_tensors",
    "piece_slots",
    "piece_value",
    "sanitised_key",
    "state_keys",
]


class OptimizerKeys(NamedTuple):
    """The torch.optim state keys of a core state type, in torch's order.

    ``keys``: (NamedTuple field, key, whether torch.optim keeps it); ``eager``: torch.optim
    creates the state of every parameter at construction, not at its first gradient.
    """

    keys: tuple[tuple[str, str, bool], ...]
    eager: bool = False
    factory: Callable[..., Transformation] | None = None


# [Note: torch state keys]
# From core state fields to torch.optim's per-parameter state keys: derived from core's torch
# compatibility records ([Note: torch compatibility records] in shardopt.core), one entry per
# state type (Adam and AdamW share theirs). A field that is None in the state (no ``nu_max``
# without amsgrad, no ``grad_avg`` unless centered) is simply absent, as in torch. torch.optim.SGD
# keeps no step count: ``count`` of TraceState is set to 1 for parameters that have a momentum
# buffer when a torch dict is loaded (torch creates it at the first step).
STATE_KEYS: dict[type, OptimizerKeys] = {
    r.state_type: OptimizerKeys(r.state_keys, r.eager, r.factory) for r in TORCH_COMPAT
}

# [Note: shaped state]
# Adafactor keeps each matrix's second moment as ``row_var`` and ``col_var``, tensors of other
# shapes than the matrix (and ``variance`` for 0-d and 1-d parameters, which are None for
# matrices). They are not fields (``probe_fields`` keeps only the piece's shape and 0-d values):
# they stay in ``inner`` as ``tx.init`` made them, one per piece or None, and the update writes
# them in place. Only plans of whole tensors have them (a transformation that needs whole tensors
# is refused a flat plan), so each parameter's tensors are on one rank, its owner, whole. The
# torch form reads them as ShapedStates: ``consolidate_state_dict`` gathers them from the owners
# after one small all-reduce of their dtypes, ``load_torch_state_dict`` copies each owner's
# entries in. Which keys a parameter has and their shapes come from the optimizer's ``init`` on a
# meta tensor of the parameter's shape (``FieldKeys.shapes``), the same on every rank, so every
# rank checks every entry alike. ``save_checkpoint`` (DCP) saves each as a plain tensor from its
# owner, which DCP reshards by key (not with DTensor parameters, whose row means would be a
# shard's).


class ShapedState(NamedTuple):
    """A per-piece state outside the fields (see [Note: shaped state]): piece k's tensor in a
    shape of its own, or None, under torch's ``key``."""

    path: str
    key: str
    tensors: tuple[torch.Tensor | None, ...]


class ListField(NamedTuple):
    """A per-parameter field of one label of a sharded partition ([Note: labels of a sharded
    partition]), left in its label's list: ``tensors[k]`` is piece k's value in the piece's shape
    (None for a piece of another label); ``dtypes[g]`` its dtype in plan group g."""

    path: str
    granularity: FieldGranularity
    tensors: tuple[torch.Tensor | None, ...]
    dtypes: tuple[torch.dtype, ...]


Field: TypeAlias = StateField | ListField


@dataclass(frozen=True, slots=True)
class FieldKeys:
    """The checkpoint key of every field of a state, in save order.

    ``entries``: (field, key, in_torch) where ``key`` is torch's key for a core optimizer's state
    (see [Note: torch state keys]) and the field's sanitised path otherwise; ``count``: the field
    deciding whether a parameter has state yet (None: every parameter has); ``eager``: every
    parameter has state (Adagrad); ``shaped``: the states outside fields ([Note: shaped
    state]); ``factory``: the core optimizer's, for :meth:`shapes`; ``order``: torch's keys in
    torch's order; ``label`` and ``tensors``: for one label of a partition, the label and its
    plan tensors (None: every tensor; see [Note: labels of a sharded partition]).
    """

    entries: tuple[tuple[Field, str, bool], ...]
    count: Field | None
    eager: bool
    shaped: tuple[ShapedState, ...] = ()
    factory: Callable[..., Transformation] | None = None
    order: tuple[str, ...] = ()
    label: Hashable = None
    tensors: frozenset[int] | None = None

    def covers(self, t: int) -> bool:
        """Whether plan tensor ``t``'s state is keyed by these keys."""
        return self.tensors is None or t in self.tensors

    def __post_init__(self) -> None:
        keys = [key for _, key, _ in self.entries] + [s.key for s in self.shaped]
        if len(set(keys)) != len(keys):
            raise ValueError(f"FieldKeys: expected distinct keys, got {keys}")

    def shapes(self, shape: Sequence[int], dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
        """The shaped keys a parameter of ``shape`` has, with their shapes (see [Note: shaped
        state]); raises ValueError for a shape the optimizer refuses."""
        if not self.shaped or self.factory is None:
            return {}
        state = self.factory().init([torch.empty(tuple(shape), dtype=dtype, device="meta")])
        found = _known_states(state)[0][1]
        out = {}
        for s in self.shaped:
            leaf = getattr(found, s.path.rsplit(".", 1)[1])[0]
            if leaf is not None:
                out[s.key] = tuple(leaf.shape)
        return out

    def ordered(self, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``entry`` with its keys in torch's order."""
        rank = {key: i for i, key in enumerate(self.order)}
        return dict(sorted(entry.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _known_states(inner: Any) -> list[tuple[str, Any]]:
    leaves, _ = pytree.tree_flatten_with_path(inner, is_leaf=lambda x: type(x) in STATE_KEYS)
    return [(pytree.keystr(p), x) for p, x in leaves if type(x) in STATE_KEYS]


def sanitised_key(path: str) -> str:
    """A pytree path as a checkpoint key: runs of other characters than ``[0-9A-Za-z_]`` become
    one ``_``.

    Example:
        >>> sanitised_key("[1].mu"), sanitised_key("[0]['scale'].count")
        ('1_mu', '0_scale_count')
    """
    return re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_") or "state"


def field_keys(state: ShardedState, api: str, *, torch_only: bool = False) -> FieldKeys:
    """The keys of ``state.fields``: torch's where the state is one core optimizer's.

    With ``torch_only``, a state that torch.optim cannot represent raises ValueError naming
    ``api``; otherwise its fields are keyed by :func:`sanitised_key` of their paths and every
    parameter counts as having state (a count of its own says nothing about the rest: the
    gradients ``multi_steps`` accumulates before the first inner step, say).
    """
    by_path = {f.path: f for f in state.fields}
    known = _known_states(state.inner)
    if len(known) == 1:
        prefix, value = known[0]
        spec = STATE_KEYS[type(value)]
        entries, shaped = [], []
        lists = _piece_lists(state)
        for name, key, in_torch in spec.keys:
            path = f"{prefix}.{name}"
            field = by_path.pop(path, None)
            if field is not None:
                entries.append((field, key, in_torch))
            elif in_torch and path in lists:
                shaped.append(ShapedState(path, key, lists[path]))
        inside = {s.path for s in shaped}
        others = [p for p, _, _ in outside_tensors(state) if p.rsplit("[", 1)[0] not in inside]
        if not by_path and not others:
            count = next((f for f, key, _ in entries if key == "step"), None)
            order = tuple(key for _, key, kept in spec.keys if kept)
            return FieldKeys(tuple(entries), count, spec.eager, tuple(shaped), spec.factory, order)
    if torch_only and (state.fields or outside_tensors(state)):
        names = sorted({type(x).__name__ for _, x in known}) or "none"
        raise ValueError(
            f"{api}: expected the state of one of the core optimizers "
            f"({', '.join(t.__name__ for t in STATE_KEYS)}) and nothing else, got fields "
            f"{[f.path for f in state.fields]} with core states {names}"
        )
    entries = [(f, sanitised_key(f.path), False) for f in state.fields]
    return FieldKeys(tuple(entries), None, False)


def state_keys(state: ShardedState, api: str, *, torch_only: bool = False) -> tuple[FieldKeys, ...]:
    """The keys of ``state``: :func:`field_keys`, or for a sharded partition one FieldKeys per
    label, over that label's tensors (see [Note: labels of a sharded partition]); each label's
    state must be one core optimizer's (or none), which raises ValueError naming ``api``."""
    if state.labels is None:
        return (field_keys(state, api, torch_only=torch_only),)
    return tuple(_label_keys(state, api, label, torch_only) for label in state.labels.fields)


def keys_of(keysets: Sequence[FieldKeys], t: int) -> FieldKeys | None:
    """The keys of plan tensor ``t``'s state among ``keysets`` (of :func:`state_keys`)."""
    return next((keys for keys in keysets if keys.covers(t)), None)


def _label_keys(state: ShardedState, api: str, label: Hashable, torch_only: bool) -> FieldKeys:
    labels, pieces = state.labels, state.param_buffers.pieces
    assert labels is not None
    sub = state.inner.inner_states[label]
    mine = [k for k, p in enumerate(pieces) if labels.of_tensor[p.tensor] == label]
    tensors = frozenset(t for t, x in enumerate(labels.of_tensor) if x == label)
    lists = _tensor_lists(sub)
    known, probed = _known_states(sub), labels.fields[label]
    prefix = f".inner_states[{label!r}]"

    def expand(values: list[Any]) -> tuple[torch.Tensor | None, ...]:
        return _per_piece(values, mine, len(pieces))

    def listed(path: str) -> ListField:
        kind, dtypes = probed[path]
        return ListField(prefix + path, kind, expand(lists.pop(path, [])), dtypes)

    if len(known) != 1:
        if torch_only and (known or lists):
            names = sorted({type(x).__name__ for _, x in known}) or "none"
            raise ValueError(
                f"{api}: expected the state of partition label {label!r} to be one core "
                f"optimizer's, got core states {names}"
            )
        # as field_keys keys a state of no (or several) core optimizers: by path, all stated
        generic = tuple((listed(path), sanitised_key(path), False) for path in probed)
        keys = FieldKeys(generic, None, False, label=label, tensors=tensors)
        return _no_other_lists(api, label, lists, keys)
    where, value = known[0]
    spec = STATE_KEYS[type(value)]
    entries, shaped = [], []
    for name, key, in_torch in spec.keys:
        path = f"{where}.{name}"
        if path in probed:
            entries.append((listed(path), key, in_torch))
        elif in_torch and path in lists:
            shaped.append(ShapedState(prefix + path, key, expand(lists.pop(path))))
    count = next((f for f, key, _ in entries if key == "step"), None)
    order = tuple(key for _, key, kept in spec.keys if kept)
    keys = FieldKeys(
        tuple(entries), count, spec.eager, tuple(shaped), spec.factory, order, label, tensors
    )
    return _no_other_lists(api, label, lists, keys)


def _tensor_lists(sub: Any) -> dict[str, list[Any]]:
    """The lists of ``sub`` (a label's state) that hold tensors, by path."""
    leaves = pytree.tree_flatten_with_path(sub, is_leaf=lambda x: type(x) is list)[0]
    return {
        pytree.keystr(p): x
        for p, x in leaves
        if type(x) is list and any(isinstance(e, torch.Tensor) for e in x)
    }


def _per_piece(values: list[Any], mine: Sequence[int], n: int) -> tuple[torch.Tensor | None, ...]:
    """A label's list ``values`` placed at its pieces ``mine`` among ``n`` (None elsewhere)."""
    out: list[torch.Tensor | None] = [None] * n
    for k, v in zip(mine, values):
        out[k] = v
    return tuple(out)


def _no_other_lists(api: str, label: Hashable, lists: dict[str, Any], keys: FieldKeys) -> FieldKeys:
    """``keys``, if no per-parameter list of the label's state is left out of them."""
    if lists:
        raise ValueError(
            f"{api}: expected the state of partition label {label!r} to be one core "
            f"optimizer's and nothing else, got per-parameter tensors at {sorted(lists)}"
        )
    return keys


def _piece_lists(state: ShardedState) -> dict[str, tuple[torch.Tensor | None, ...]]:
    """The per-piece lists of ``state.inner`` (one tensor or None per piece), by path."""
    is_list = piece_list_pred(len(state.param_buffers.pieces))
    leaves = pytree.tree_flatten_with_path(state.inner, is_leaf=is_list)[0]
    return {pytree.keystr(p): tuple(x) for p, x in leaves if is_list(x)}


def _in_list(tree: Any, path: Sequence[Any]) -> bool:
    """Whether the leaf at ``path`` of ``tree`` lies inside a list (per-parameter state)."""
    node = tree
    for key in path:
        if type(node) is list:
            return True
        node = key.get(node)
    return False


def outside_tensors(state: ShardedState) -> list[tuple[str, torch.Tensor, bool]]:
    """The tensors of ``state.inner`` outside its fields, by path, each with whether it is
    replicated (a plain leaf, the same on every rank) rather than per-parameter: one of a
    per-piece list, or of any list (``partition``'s per-label sub-lists hold this rank's pieces
    of the label, so they differ between ranks). Injected hyperparameters are not state (see
    [Note: hyperparameters of a sharded state])."""
    paths = {f.path for f in state.fields}
    is_field = piece_list_pred(len(state.param_buffers.pieces))
    out = []
    inner = without_hyperparams(state.inner)
    for path, leaf in pytree.tree_flatten_with_path(inner, is_leaf=is_field)[0]:
        key = pytree.keystr(path)
        if key in paths:
            continue
        if isinstance(leaf, torch.Tensor):
            out.append((key, leaf, not _in_list(inner, path)))
        elif is_field(leaf):
            out.extend((f"{key}[{i}]", t, False) for i, t in enumerate(leaf) if t is not None)
    return out


def piece_value(
    field: Field, param_buffers: ParamBuffers, k: int, slots: Sequence[int]
) -> torch.Tensor:
    """The value of ``field`` for piece ``k``: a 1-D view (ELEMENTWISE) or a 0-d view.

    Example:
        >>> import torch
        >>> from shardopt.core import plan_partition
        >>> from shardopt.functional.engine._param_buffers import build_param_buffers
        >>> params = [torch.ones(3), torch.ones(2)]
        >>> buffers = build_param_buffers(plan_partition(params, 1, align=1), params, 0)
        >>> mu = StateField("[0].mu", FieldGranularity.ELEMENTWISE, (torch.arange(5.0),))
        >>> piece_value(mu, buffers, 1, piece_slots(buffers))
        tensor([3., 4.])
    """
    if isinstance(field, ListField):
        value = field.tensors[k]
        if value is None:
            raise ValueError(f"piece_value: piece {k} has no value of {field.path}")
        return value.view(()) if field.granularity is FieldGranularity.PER_PIECE else value.view(-1)
    piece = param_buffers.pieces[k]
    buf = field.buffers[piece.group]
    if field.granularity is FieldGranularity.ELEMENTWISE:
        return buf[piece.offset : piece.offset + piece.numel]
    return buf[slots[k]]


def has_state(keys: FieldKeys, count: torch.Tensor | float | None) -> bool:
    """Whether a parameter whose count is ``count`` has a state entry (torch: once stepped)."""
    if not keys.entries:  # a stateless transformation: torch.optim.SGD without momentum
        return False
    if keys.eager or keys.count is None or count is None:
        return True
    return float(count) > 0
