"""The sharded state: the optimizer's state over this rank's pieces, stored in flat shards."""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from shardopt.core import InjectHyperparamsState, Transformation
from shardopt.core.blocks import in_scope, needs_whole_tensors, partition_rule
from shardopt.functional.engine._collectives import ProcessGroup, all_reduce_op, comm_device
from shardopt.functional.engine._masters import Masters
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._renamed import warn_renamed

__all__ = [
    "FieldGranularity",
    "Labels",
    "ShardedState",
    "StateField",
    "StepStats",
    "flatten_state",
    "init_values",
    "injected_states",
    "piece_list_pred",
    "piece_slots",
    "probe_fields",
    "slice_state",
    "tensor_labels",
    "without_hyperparams",
]

# [Note: sharded state layout]
# ``init`` returns a ShardedState; on rank r it holds only what rank r owns:
#
# - ``param_buffers`` (a ParamBuffers, [Note: engine]): ``plan``, ``rank``, ``buffers[g]``
#   the full flat parameter buffer of ``plan.groups[g]`` (the parameters are views of it),
#   ``pieces = plan.pieces(rank)``, the gradient shards and the collectives in flight.
# - ``inner``: ``tx.init(pieces)`` where ``pieces`` is the list of this rank's pieces as 1-D views
#   (of ``master.full(g)`` where that is set, of the parameter buffer otherwise). Piece
#   k of the list is ``param_buffers.pieces[k]``. Its per-piece lists (the "fields", e.g. the ``mu``
#   of Adam, a list with one tensor per piece) are re-pointed into flat storage:
# - ``fields``: one StateField per field, in ``tree_flatten`` order of ``inner``, with ``path``
#   the pytree key path of the field in ``inner`` (e.g. ``"[1].mu"``), ``granularity`` and
#   ``buffers`` (one per plan group g):
#     ELEMENTWISE: ``buffers[g]`` is compact ([Note: buffer storage]): ``shard_numels[rank]``
#       elements, the state of piece k at ``[piece.offset, piece.offset + piece.numel)``, the
#       rank's shards of the group's buckets end to end; padding holds zeros.
#     PER_PIECE: one value per piece (a 0-d leaf, e.g. the per-parameter step count):
#       ``buffers[g][j]`` is the value of the j-th piece of group g in ``param_buffers.pieces``. The
#       pieces of one tensor on different ranks hold the same value (they see the same gradients),
#       so a consolidated state takes it from the rank owning the tensor's first element.
#   The field set, granularities and dtypes are the same on every rank (found by ``probe_fields``
#   from the plan, not from the pieces), so ranks owning nothing still hold (zero) buffers.
# - ``master`` (a Masters, [Note: master weights] in engine/_masters.py): ``master[g]`` the
#   rank's compact shard of the float32 (``master_dtype``) master weights of a low precision
#   group, laid out like the ELEMENTWISE fields, or None; with ``master_remainders`` a bfloat16
#   group's is an int16 shard of remainders instead ([Note: master remainders]), and
#   ``master.full(g)`` gives the float32 masters of either.
# - ``reducer``: the gradient reducer (hooks; its GradShards hold the gradient shards) when the
#   sharded transformation reduces gradients (stage 2; stage 1 without ``grads_averaged``).
# - ``stats``: the global gradient norm and whether the last step was skipped (or None).
# - ``labels``: for a core ``partition``, each plan tensor's label and each label's fields (see
#   [Note: labels of a sharded partition]), or None.
# - ``updates``: each bucket's update prepared on its first step ([Note: prepared bucket
#   updates] in engine/_update.py); it holds views of the tensors above, nothing of its own.
#
# Leaves of ``inner`` outside fields (a transform with a global, not per-parameter, state) stay as
# they are; they are replicated, never sharded. The hyperparameters of an ``inject_hyperparams``
# state are neither: see [Note: hyperparameters of a sharded state].


class FieldGranularity(enum.Enum):
    """How a state field is stored: one element per parameter element, or one value per piece."""

    ELEMENTWISE = "elementwise"
    PER_PIECE = "per_piece"


class StateField(NamedTuple):
    """A per-piece field of the optimizer state, in flat storage ([Note: sharded state layout])."""

    path: str
    granularity: FieldGranularity
    buffers: tuple[torch.Tensor, ...]


class StepStats(NamedTuple):
    """The global gradient norm of the last step (before clipping) and whether it was skipped."""

    grad_norm: torch.Tensor
    skipped: bool


class ShardedState(NamedTuple):
    """This rank's part of a sharded optimizer (see [Note: sharded state layout])."""

    inner: Any
    fields: tuple[StateField, ...]
    param_buffers: ParamBuffers
    master: Masters
    reducer: Any
    stats: StepStats | None
    labels: Labels | None = None
    updates: Any = None  # the buckets' prepared updates (BucketUpdates, in _update.py)

    @property
    def layout(self) -> ParamBuffers:
        """Renamed :attr:`param_buffers` (issue 39); warns, and goes in a later release."""
        warn_renamed("ShardedState.layout", "ShardedState.param_buffers")
        return self.param_buffers


def piece_list_pred(n: int) -> Callable[[Any], bool]:
    """A pytree ``is_leaf`` that stops at per-piece lists: lists of ``n`` tensors or Nones."""

    def is_field(x: Any) -> bool:
        return (
            type(x) is list
            and len(x) == n
            and all(e is None or isinstance(e, torch.Tensor) for e in x)
        )

    return is_field


def _key(path: tuple[Any, ...]) -> str:
    return pytree.keystr(path)


def probe_fields(
    tx: Transformation, probes: Sequence[torch.Tensor]
) -> dict[str, tuple[FieldGranularity, tuple[torch.dtype, ...]]]:
    """The fields of ``tx``'s state, with their granularity and dtype per group, from one probe
    per group.

    ``probes[g]`` is a 2-element tensor of the dtype and device the pieces of group ``g`` have
    (2 x 3 for whole-tensor transformations). A field whose probe leaves all have their probe's
    shape is ELEMENTWISE, all 0-d PER_PIECE; any other per-piece list is left out (stored as it
    comes).
    """
    state = tx.init(list(probes))
    leaves, _ = pytree.tree_flatten_with_path(state, is_leaf=piece_list_pred(len(probes)))
    out = {}
    for path, leaf in leaves:
        if not piece_list_pred(len(probes))(leaf) or any(e is None for e in leaf):
            continue
        if all(e.shape == q.shape for e, q in zip(leaf, probes)):
            out[_key(path)] = (FieldGranularity.ELEMENTWISE, tuple(e.dtype for e in leaf))
        elif all(e.dim() == 0 for e in leaf):
            out[_key(path)] = (FieldGranularity.PER_PIECE, tuple(e.dtype for e in leaf))
    return out


def flatten_state(
    inner: Any,
    param_buffers: ParamBuffers,
    probed: dict[str, tuple[FieldGranularity, tuple[torch.dtype, ...]]],
) -> tuple[Any, tuple[StateField, ...], bool]:
    """Moves the fields of ``inner = tx.init(pieces)`` into flat buffers; their leaves become views.

    Returns ``(inner, fields, sliceable)``: ``sliceable`` is False when ``inner`` holds tensors
    outside fields, which :func:`slice_state` cannot split by pieces.
    """
    n = len(param_buffers.pieces)
    is_field = piece_list_pred(n)
    leaves, spec = pytree.tree_flatten_with_path(inner, is_leaf=is_field)
    index_in_group = piece_slots(param_buffers)
    fields: list[StateField] = []
    new_leaves: list[Any] = []
    sliceable = True
    for path, leaf in leaves:
        info = probed.get(_key(path)) if is_field(leaf) else None
        if info is None:
            sliceable = sliceable and not _holds_tensors(leaf)
            new_leaves.append(leaf)
            continue
        granularity, dtypes = info
        buffers = _alloc(param_buffers, granularity, dtypes)
        views = []
        for k, (piece, value) in enumerate(zip(param_buffers.pieces, leaf)):
            buf = buffers[piece.group]
            if granularity is FieldGranularity.ELEMENTWISE:  # in its shape: a whole tensor's, maybe
                view = buf[piece.offset : piece.offset + piece.numel].view(value.shape)
            else:
                view = buf[index_in_group[k]]
            view.copy_(value)
            views.append(view)
        fields.append(StateField(_key(path), granularity, buffers))
        new_leaves.append(views)
    return pytree.tree_unflatten(new_leaves, spec), tuple(fields), sliceable


def _holds_tensors(leaf: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(leaf))


def piece_slots(param_buffers: ParamBuffers) -> list[int]:
    """For each piece of ``param_buffers``, its index among its group's pieces (PER_PIECE slot)."""
    counts = [0] * len(param_buffers.plan.groups)
    out = []
    for piece in param_buffers.pieces:
        out.append(counts[piece.group])
        counts[piece.group] += 1
    return out


def _alloc(
    param_buffers: ParamBuffers, granularity: FieldGranularity, dtypes: tuple[torch.dtype, ...]
) -> tuple[torch.Tensor, ...]:
    sizes = [0] * len(param_buffers.plan.groups)
    for piece in param_buffers.pieces:
        sizes[piece.group] += 1
    out = []
    for g, group in enumerate(param_buffers.plan.groups):
        numel = (
            group.shard_numels[param_buffers.rank]
            if granularity is FieldGranularity.ELEMENTWISE
            else sizes[g]
        )
        out.append(torch.zeros(numel, dtype=dtypes[g], device=param_buffers.buffers[g].device))
    return tuple(out)


def slice_state(inner: Any, n: int, lo: int, hi: int) -> Any:
    """The state of pieces ``[lo, hi)`` of a state over ``n`` pieces: its fields cut to that range.

    The leaves are the same tensor objects, so an in-place update of the slice updates ``inner``.

    Example:
        >>> import torch
        >>> s = {"mu": [torch.zeros(1), torch.ones(1), torch.zeros(2)], "t": ()}
        >>> slice_state(s, 3, 1, 2)
        {'mu': [tensor([1.])], 't': ()}
    """
    is_field = piece_list_pred(n)
    leaves, spec = pytree.tree_flatten(inner, is_leaf=is_field)
    return pytree.tree_unflatten([x[lo:hi] if is_field(x) else x for x in leaves], spec)


def init_values(
    tx: Transformation, dtypes: Sequence[torch.dtype], shape: tuple[int, ...] = (2,)
) -> dict[str, list[float]]:
    """Each field's initial value per plan group (every element starts alike), from ``tx.init``
    of probes of ``shape`` (a matrix for a transformation that needs whole tensors).

    Example:
        >>> from shardopt.core import rprop
        >>> init_values(rprop(lr=0.5), [torch.float32])["[0].step_size"]
        [0.5]
    """
    state = tx.init([torch.zeros(shape, dtype=d) for d in dtypes])
    is_field = piece_list_pred(len(dtypes))
    leaves, _ = pytree.tree_flatten_with_path(state, is_leaf=is_field)
    return {
        _key(path): [e.reshape(-1)[0].item() for e in leaf]
        for path, leaf in leaves
        if is_field(leaf) and all(isinstance(e, torch.Tensor) for e in leaf)
    }


def _is_injected(x: Any) -> bool:
    return isinstance(x, InjectHyperparamsState)


def injected_states(inner: Any, prefix: str = "") -> list[tuple[str, InjectHyperparamsState]]:
    """Every ``inject_hyperparams`` state in ``inner`` with its path, an outer one before those
    in its ``inner`` (see [Note: hyperparameters of a sharded state]).

    Example:
        >>> from shardopt.core import inject_hyperparams, sgd
        >>> [(p, s.hyperparams) for p, s in injected_states(
        ...     (inject_hyperparams(sgd, lr=0.1).init([torch.zeros(1)]),))]
        [('[0]', {'lr': 0.1})]
    """
    out = []
    for path, leaf in pytree.tree_flatten_with_path(inner, is_leaf=_is_injected)[0]:
        if _is_injected(leaf):
            where = prefix + _key(path)
            out += [(where, leaf), *injected_states(leaf.inner, f"{where}.inner")]
    return out


def without_hyperparams(inner: Any) -> Any:
    """``inner`` with an empty dict in place of the hyperparameters of each ``inject_hyperparams``
    state in it (every other path unchanged): the optimizer state proper.

    Example:
        >>> from shardopt.core import inject_hyperparams, sgd
        >>> without_hyperparams(inject_hyperparams(sgd, lr=torch.tensor(0.1)).init([]))
        InjectHyperparamsState(hyperparams={}, inner=(EmptyState(),))
    """

    def strip(x: Any) -> Any:
        return InjectHyperparamsState({}, without_hyperparams(x.inner)) if _is_injected(x) else x

    return pytree.tree_map(strip, inner, is_leaf=_is_injected)


# [Note: labels of a sharded partition]
# A core ``partition`` keeps one inner state per label over the list of that label's leaves, and
# on a rank the leaves are its pieces: so its per-parameter state is neither in per-piece lists
# nor in flat fields, and which piece each element of a label's lists belongs to follows from
# the labels alone. ``init`` records them once (``ShardedState.labels``), the same on every rank:
# - ``of_tensor``: each plan tensor's label. Each rank resolves the labels of its pieces (the
#   partition's ``labels_of``, as its own ``init`` did), and one all-reduce of each tensor's
#   label index (its largest and its negated smallest over every rank's pieces) gives every rank
#   every tensor's label. The pieces of one tensor must share a label: a rule that labels by more
#   than a piece's shape and dtype (its numel, say: cut tensors arrive as 1-D slices of several
#   sizes) is refused on every rank. A tensor without elements has no piece and no label (None).
# - ``fields``: per label, its state's per-piece fields probed as ``probe_fields`` probes a whole
#   state (from the plan's dtypes, not the pieces), so every rank knows their kinds and dtypes,
#   including a rank without a piece of the label.
# Checkpoints read each label's state as that label's optimizer's, over that label's tensors.


class Labels(NamedTuple):
    """The labels of a sharded partition (see [Note: labels of a sharded partition])."""

    of_tensor: tuple[Hashable | None, ...]
    fields: dict[Hashable, dict[str, tuple[FieldGranularity, tuple[torch.dtype, ...]]]]


def tensor_labels(
    tx: Transformation,
    pieces: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    param_buffers: ParamBuffers,
    group: ProcessGroup,
) -> Labels | None:
    """The :class:`Labels` of ``tx`` over this rank's ``pieces`` if it is a core ``partition``,
    else None; collective over ``group`` then. ``dtypes``: the pieces' dtype per plan group.
    Raises ValueError on every rank if the pieces of a tensor differ in label."""
    rule = partition_rule(tx)
    if rule is None:
        return None
    order = list(rule.transforms)
    n = len(param_buffers.plan.tensors)
    codes = torch.full((2, n), -1, dtype=torch.int64)
    with in_scope(param_buffers.scope):  # labels of the whole tensors ([Note: kinds] in core)
        of_pieces = rule.labels_of(list(pieces))
    for piece, label in zip(param_buffers.pieces, of_pieces):
        i = order.index(label)
        codes[0, piece.tensor] = max(int(codes[0, piece.tensor]), i)
        codes[1, piece.tensor] = max(int(codes[1, piece.tensor]), -i)
    merged = codes.to(comm_device(group))
    if dist.get_world_size(group) > 1:
        all_reduce_op(merged, dist.ReduceOp.MAX, group=group)
    high, low = merged.cpu().tolist()
    split = [t for t in range(n) if high[t] >= 0 and high[t] != -low[t]]
    if split:
        t = split[0]
        raise ValueError(
            f"shard: expected the pieces of each tensor to share one partition label, got "
            f"tensor {t} labelled {order[-low[t]]!r} and {order[high[t]]!r} on different pieces "
            f"(label by the pieces' dim or dtype: cut tensors arrive as 1-D slices)"
        )
    fields = {}
    for label, inner in rule.transforms.items():
        shape = (2, 3) if needs_whole_tensors(inner) else (2,)
        fields[label] = probe_fields(inner, [torch.zeros(shape, dtype=d) for d in dtypes])
    return Labels(tuple(order[i] if i >= 0 else None for i in high), fields)
