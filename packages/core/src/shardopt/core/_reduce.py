"""Reductions that give the whole tensor's (or whole tree's) value wherever they run.

[Note: reductions across shards]
A per-tensor or whole-tree transformation (see [Note: kinds]) needs sums, norms or maxima over
whole tensors. In one process its leaves are whole and these blocks compute directly (and trace
under ``torch.func``). Under ``shard`` its leaves are this rank's pieces of the tensors: the
engine installs a :class:`Scope` for the update (``in_scope``), which says which plan tensor each
leaf is a piece of, and a :class:`Reducer` that sums (or maxes) a vector of per-tensor partials
over the ranks holding pieces. Each block call then costs one small all-reduce of one float32 per
plan tensor (or one scalar for a whole-tree block), made on every rank whatever it holds: blocks
must be called unconditionally, not behind a test of local values (a rank with no pieces still
takes part). ``masked`` and ``partition`` narrow the scope to the leaves they pass on
(``sub_scope``), so nested blocks still know their tensors; they resolve their masks and labels
on the whole parameters the scope describes (``whole_reference``), never on the pieces.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from shardopt.core._tree import PyTree, tree_leaves, tree_map

__all__ = [
    "Reducer",
    "row_norm",
    "resolved",
    "Scope",
    "current_scope",
    "in_scope",
    "safe_norm",
    "sub_scope",
    "tensor_max_abs",
    "tensor_norm",
    "tensor_norms",
    "tensor_sum",
    "tensor_sum_sq",
    "tree_max_abs",
    "tree_nonfinite_count",
    "tree_norm",
    "tree_sum_sq",
    "whole_reference",
]


class Reducer(Protocol):
    """What the engine gives the blocks: ``combine(values, ids, op)`` takes one partial per leaf
    (``values``, float32) and the plan tensor of each (``ids``; -1 for the whole tree), and
    returns each leaf's value over the whole tensor, or the tree's, after one collective; ``op``
    is ``"sum"`` or ``"max"``, or ``"rows"``: ``values`` holds one slot per output row of every
    tensor in scope (``row_norm``), summed as it is. ``parts`` (one per value, default all 0)
    keeps the values of ``trees`` trees apart in the same collective (``tensor_norms``). With
    ``total``, the leaves are pieces of the tree's tensors and the answer is one value: ``op``
    over every tensor's whole value (``tree_sum_sq``, ``tree_max_abs``), so that an engine whose
    tensors are themselves split (tensor parallelism) can count each tensor once."""

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
        total: bool = False,
    ) -> torch.Tensor: ...


class Scope(NamedTuple):
    """The leaves a transformation is updating, as pieces of whole tensors.

    ``tree``: the whole parameters in scope, as the user structured them, with meta tensors of
    their shapes and dtypes (what masks and labels are resolved on); ``ids``: the plan tensor of
    each of ``tree``'s leaves; ``of_leaf``: for each leaf being updated, the index of its whole
    tensor among ``tree``'s leaves; ``reducer``: the collective behind the blocks.
    """

    tree: PyTree
    ids: tuple[int, ...]
    of_leaf: tuple[int, ...]
    reducer: Reducer
    cache: dict[Any, Any] | None = None  # what depends on ``tree`` alone (see ``resolved``)
    starts: tuple[int, ...] | None = None  # each leaf's first element in its whole tensor


# [Note: the scope under torch.compile]
# The active scope is a context variable (each thread and task its own), which dynamo cannot
# read: every block that asked for it would break the graph there, and a compiled update would
# come out in pieces. While dynamo traces, the blocks read the innermost scope entered instead,
# a plain global it can guard on; the compiled update runs under one scope per layout, made
# once, so the guard holds from step to step.
_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("shardopt_scope")
_TRACED: list[Scope | None] = [None]


def current_scope() -> Scope | None:
    """The active :class:`Scope`, or None in one process."""
    if torch.compiler.is_compiling():  # see [Note: the scope under torch.compile]
        return _TRACED[0]
    return _SCOPE.get(None)


@contextlib.contextmanager
def in_scope(scope: Scope | None) -> Iterator[None]:
    """Runs the body with ``scope`` active (None: as in one process)."""
    token, outer = _SCOPE.set(scope), _TRACED[0]
    _TRACED[0] = scope
    try:
        yield
    finally:
        _SCOPE.reset(token)
        _TRACED[0] = outer


def whole_reference(reference: PyTree) -> tuple[PyTree, tuple[int, ...]] | None:
    """Under a scope whose leaves are ``reference``'s: (the whole parameters in scope, the index
    of each of ``reference``'s leaves among theirs); None in one process."""
    scope = current_scope()
    if scope is None:
        return None
    n = len(tree_leaves(reference))
    if n != len(scope.of_leaf):
        raise ValueError(
            f"shard: expected a transformation to be given the {len(scope.of_leaf)} leaves of its "
            f"scope, got {n} (a combinator that passes on part of its leaves must narrow the "
            "scope with shardopt.core.blocks.sub_scope)"
        )
    return scope.tree, scope.of_leaf


@contextlib.contextmanager
def sub_scope(selected_whole: Sequence[int], index: Sequence[int]) -> Iterator[None]:
    """Narrows the active scope (if any) for an inner transformation that gets leaves ``index``
    of the current ones, whose whole tensors are ``selected_whole`` (indices among the scope's
    whole leaves, in order): the inner one's whole tree is the list of those."""
    scope = current_scope()
    if scope is None:
        yield
        return
    key = ("sub", tuple(selected_whole))
    cache = scope.cache if scope.cache is not None else {}
    if key not in cache:  # the narrowed whole tree, made once per selection
        whole = tree_leaves(scope.tree)
        cache[key] = ([whole[w] for w in selected_whole], {})
    tree, inner_cache = cache[key]
    position = {w: k for k, w in enumerate(selected_whole)}
    narrowed = Scope(
        tree,
        tuple(scope.ids[w] for w in selected_whole),
        tuple(position[scope.of_leaf[i]] for i in index),
        scope.reducer,
        inner_cache,
        None if scope.starts is None else tuple(scope.starts[i] for i in index),
    )
    with in_scope(narrowed):
        yield


def resolved(spec: Any, compute: Any) -> Any:
    """``compute()``, a value of the active scope's whole tree alone (a mask or labels of
    ``spec``), made once per scope and spec: an update resolves them at every call, bucket by
    bucket, on the same tree. Without a scope (or its cache), computed each time."""
    scope = current_scope()
    if scope is None or scope.cache is None:
        return compute()
    entry = scope.cache.get(id(spec))
    if entry is None or entry[0] is not spec:  # the spec itself is kept: its id is not reused
        entry = (spec, compute())
        scope.cache[id(spec)] = entry
    return entry[1]


def _per_leaf(tree: PyTree, partial: Any, op: str) -> PyTree:
    """Each leaf's ``partial(leaf)`` (a 0-d tensor), combined over whole tensors in a scope."""
    scope = current_scope()
    if scope is None:
        return tree_map(lambda x: None if x is None else partial(x), tree)
    leaves = tree_leaves(tree)
    if len(leaves) != len(scope.of_leaf):
        whole_reference(tree)  # raises the message naming the scope
    values = _stacked([None if x is None else partial(x) for x in leaves])
    ids = [scope.ids[w] for w in scope.of_leaf]
    combined = scope.reducer.combine(values, ids, op)
    out = [None if x is None else combined[i].to(x.device) for i, x in enumerate(leaves)]
    return _unflatten_like(tree, out)


def _stacked(parts: list[torch.Tensor | None]) -> torch.Tensor:
    """The float32 vector of ``parts`` (0 for None), on their device (no host sync)."""
    device = next((p.device for p in parts if p is not None), torch.device("cpu"))
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([zero if p is None else p.float().to(device) for p in parts])


def _unflatten_like(tree: PyTree, leaves: list[Any]) -> PyTree:
    from torch.utils import _pytree as pytree

    _, spec = pytree.tree_flatten(tree, is_leaf=lambda x: x is None)
    return pytree.tree_unflatten(leaves, spec)


def _over_tree(tree: PyTree, partial: Any, op: str) -> torch.Tensor:
    """``partial`` of every non-None leaf, combined by ``op`` over the whole tree (0-d). In a
    scope whose pieces the leaves are, each leaf's partial goes by its tensor (``total``);
    a tree of other leaves goes as this rank's one partial (id -1)."""
    leaves = tree_leaves(tree)
    scope = current_scope()
    if scope is not None and len(leaves) == len(scope.of_leaf):
        values = _stacked([None if x is None else partial(x) for x in leaves])
        ids = [scope.ids[w] for w in scope.of_leaf]
        return scope.reducer.combine(values, ids, op, total=True)[0]
    parts = _stacked([partial(x) for x in leaves if x is not None])
    if parts.numel() == 0:
        local = parts.new_zeros(())
    else:
        local = parts.sum() if op == "sum" else parts.max()
    if scope is None:
        return local
    return scope.reducer.combine(local.reshape(1), [-1], op)[0]


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.float(), 2.0).square()


def tensor_sum_sq(tree: PyTree) -> PyTree:
    """Per leaf: the sum of squares of its whole tensor (float32 0-d; None stays None).

    Example:
        >>> import torch
        >>> tensor_sum_sq([torch.tensor([3.0, 4.0]), None])
        [tensor(25.), None]
    """
    return _per_leaf(tree, _sum_sq, "sum")


def tensor_norm(tree: PyTree) -> PyTree:
    """Per leaf: the 2-norm of its whole tensor, ``sqrt(sum x**2)`` (float32 0-d).

    Example:
        >>> import torch
        >>> tensor_norm([torch.tensor([3.0, 4.0])])
        [tensor(5.)]
    """
    if current_scope() is None:  # one process: torch's own norm, bitwise as clip_grad_norm_
        return tree_map(lambda x: None if x is None else torch.linalg.vector_norm(x, 2.0), tree)
    return tree_map(lambda s: None if s is None else s.sqrt(), tensor_sum_sq(tree))


def tensor_norms(*trees: PyTree) -> tuple[PyTree, ...]:
    """Per leaf of each tree, the 2-norm of its whole tensor, as :func:`tensor_norm` gives, with
    every tree's reductions in one collective under a scope (LAMB's ``||p||`` and ``||u||`` at
    one point of a chain travel together).

    Example:
        >>> import torch
        >>> tensor_norms([torch.tensor([3.0, 4.0])], [torch.tensor([1.0, 0.0])])
        ([tensor(5.)], [tensor(1.)])
    """
    scope = current_scope()
    if scope is None:
        return tuple(tensor_norm(tree) for tree in trees)
    all_leaves = [tree_leaves(tree) for tree in trees]
    for tree, leaves in zip(trees, all_leaves):
        if len(leaves) != len(scope.of_leaf):
            whole_reference(tree)  # raises the message naming the scope
    parts = [k for k, leaves in enumerate(all_leaves) for _ in leaves]
    values = _stacked([None if x is None else _sum_sq(x) for ls in all_leaves for x in ls])
    ids = [scope.ids[w] for _ in all_leaves for w in scope.of_leaf]
    combined = scope.reducer.combine(values, ids, "sum", parts, len(trees)).sqrt()
    out, at = [], 0
    for tree, leaves in zip(trees, all_leaves):
        norms = [None if x is None else combined[at + i].to(x.device) for i, x in enumerate(leaves)]
        out.append(_unflatten_like(tree, norms))
        at += len(leaves)
    return tuple(out)


def tensor_sum(tree: PyTree) -> PyTree:
    """Per leaf: the sum of the elements of its whole tensor (float32 0-d)."""
    return _per_leaf(tree, lambda x: x.float().sum(), "sum")


def tensor_max_abs(tree: PyTree) -> PyTree:
    """Per leaf: the largest absolute value in its whole tensor (float32 0-d; 0 for empty)."""
    return _per_leaf(tree, lambda x: x.abs().max().float() if x.numel() else x.new_zeros(()), "max")


def _rows(shape: Sequence[int]) -> int:
    """How many units a whole tensor of ``shape`` has: its first dimension's size where it has
    two or more dimensions that are not all 1 (torch's layouts: a unit is an output row), else
    one unit, the whole tensor."""
    squeezed = [n for n in shape if n != 1]
    return int(shape[0]) if len(squeezed) > 1 else 1


def row_norm(tree: PyTree) -> PyTree:
    """Per leaf, each element's unit norm: the 2-norm of its output row of the whole tensor (every
    dimension but the first; the whole tensor for scalars and vectors), broadcast to the leaf.
    Under a scope a leaf may be a 1-D piece of its tensor's flattened elements (one float32 per
    row of every tensor travels in one all-reduce).

    Example:
        >>> import torch
        >>> row_norm([torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.tensor([3.0, 4.0])])
        [tensor([[5., 5.],
                [1., 1.]]), tensor([5., 5.])]
    """
    scope = current_scope()
    if scope is None:
        return tree_map(lambda x: None if x is None else _local_row_norm(x), tree)
    leaves = tree_leaves(tree)
    whole = tree_leaves(scope.tree)
    shapes = [tuple(whole[w].shape) for w in range(len(whole))]
    base = [0]
    for shape in shapes:
        base.append(base[-1] + _rows(shape))
    slots, values = [], []
    for i, x in enumerate(leaves):
        if x is None:
            continue
        w = scope.of_leaf[i]
        start = 0 if scope.starts is None else scope.starts[i]
        width = max(1, math.prod(shapes[w]) // _rows(shapes[w]))
        rows = (torch.arange(x.numel(), device=x.device) + start) // width + base[w]
        slots.append(rows)
        values.append(x.reshape(-1).float().square())
    total = _row_sums(slots, values, base[-1], leaves)
    rows_of = iter(slots)  # in the order of the non-None leaves
    out = [None if x is None else total[next(rows_of)].sqrt().reshape(x.shape) for x in leaves]
    return _unflatten_like(tree, out)


def _row_sums(slots: list[torch.Tensor], values: list[torch.Tensor], n: int, leaves: Any) -> Any:
    """The sum of squares of every row of every tensor in scope, after one all-reduce."""
    scope = current_scope()
    assert scope is not None
    device = next((x.device for x in leaves if x is not None), torch.device("cpu"))
    local = torch.zeros(n, dtype=torch.float32, device=device)
    for rows, v in zip(slots, values):
        local.index_add_(0, rows, v)
    return scope.reducer.combine(local, list(range(n)), "rows").to(device)


def _local_row_norm(x: torch.Tensor) -> torch.Tensor:
    if _rows(tuple(x.shape)) == 1:
        return torch.linalg.vector_norm(x, 2.0).expand(x.shape)
    dims = tuple(range(1, x.dim()))
    return torch.linalg.vector_norm(x, 2.0, dim=dims, keepdim=True).expand(x.shape)


def tree_sum_sq(tree: PyTree) -> torch.Tensor:
    """The sum of squares of every element of every non-None leaf (float32 0-d).

    Example:
        >>> import torch
        >>> tree_sum_sq({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
        tensor(25.)
    """
    return _over_tree(tree, _sum_sq, "sum")


def tree_norm(tree: PyTree) -> torch.Tensor:
    """The 2-norm of every non-None leaf seen as one vector (float32 0-d)."""
    return tree_sum_sq(tree).sqrt()


def tree_max_abs(tree: PyTree) -> torch.Tensor:
    """The largest absolute value over every non-None leaf (float32 0-d; 0 for none)."""
    return _over_tree(tree, lambda x: x.abs().max() if x.numel() else x.new_zeros(()), "max")


def tree_nonfinite_count(tree: PyTree) -> torch.Tensor:
    """How many elements of the tree are inf or nan (float32 0-d, exact below 2**24).

    Example:
        >>> import torch
        >>> tree_nonfinite_count([torch.tensor([1.0, float("nan"), float("inf")])])
        tensor(2.)
    """
    return _over_tree(tree, lambda x: (~torch.isfinite(x)).sum(), "sum")


def safe_norm(
    x: torch.Tensor, min_norm: float, dim: Any = None, keepdim: bool = False
) -> torch.Tensor:
    """``max(norm(x), min_norm)`` along ``dim`` (all of ``x`` when None), elementwise local: a
    norm whose gradient stays finite at zero. For a whole tensor's norm across shards use
    :func:`tensor_norm`.

    Example:
        >>> import torch
        >>> safe_norm(torch.zeros(3), 1e-6), safe_norm(torch.tensor([3.0, 4.0]), 1e-6)
        (tensor(1.0000e-06), tensor(5.))
    """
    norm = torch.linalg.vector_norm(x, 2.0, dim=dim, keepdim=keepdim)
    return torch.clamp(norm, min=min_norm)
