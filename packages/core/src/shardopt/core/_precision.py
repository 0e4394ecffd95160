"""Per-state precision: an optimizer's per-element state stored in a narrower dtype."""

from __future__ import annotations

from typing import Any

import torch

from shardopt.core._base import Transformation, inherit_whole_tensors
from shardopt.core._tree import PyTree, tree_map

__all__ = ["with_state_dtype"]

# [Note: state precision]
# ``with_state_dtype(tx, torch.bfloat16)`` stores the per-element state of ``tx`` (Adam's
# ``exp_avg`` and ``exp_avg_sq``, a momentum buffer, ...) in bfloat16 and computes every update in
# ``compute_dtype`` (float32): each step reads the stored state, the gradients and the parameters
# up to float32, runs ``tx``'s own update unchanged (its rules want one dtype: ``torch.lerp``
# refuses a float32 moment and a bfloat16 gradient), rounds the new state back to bfloat16
# (round to nearest even, ``.to``) and returns each update in its gradient's dtype. The
# parameters stay in their dtype; a low precision model keeps its float32 master weights with
# shardopt.functional's ``master_dtype``. So the result equals ``tx`` run in float32 whose state
# is rounded to bfloat16 after every step, which is how the tests check it against torch.optim.
# A gradient wider than ``compute_dtype`` (float64 under the float32 default) is refused rather
# than rounded: pass ``compute_dtype=torch.float64``.
#
# Which leaves are "per-element state": floating tensors with at least one dimension. Step
# counts and hyperparameters (``inject_hyperparams``) are 0-d and keep their dtype: a bfloat16
# count would stop at 256 (its 8-bit significand), and a bfloat16 learning rate would drift from
# the schedule. The one loss of that rule: the state of a 0-d parameter stays in its dtype too.
#
# Being a plain transformation, it composes (inside ``chain``, ``partition``, around
# ``inject_hyperparams``) and shards: shardopt.functional finds the state's fields and their
# dtypes by probing ``init``, so the sharded flat buffers are bfloat16 and hold half the bytes,
# and its cost model is told the dtype (``shard_cost(..., state_dtype=...)``). What it gives up is
# the fused flat kernels (torch's fused Adam wants one dtype for parameters and state): the
# sharded update runs the pure rule, which reads and writes each state element once more.


def _checked_dtype(api: str, name: str, dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{api}: expected a floating torch.dtype as {name}, got {dtype!r}")
    return dtype


def _is_state(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0


def _widener(compute_dtype: torch.dtype) -> Any:
    def widen(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if x.dtype.itemsize > compute_dtype.itemsize:
            raise ValueError(
                f"with_state_dtype: expected gradients and parameters no wider than "
                f"compute_dtype {compute_dtype}, got {x.dtype} (pass compute_dtype={x.dtype})"
            )
        return x.to(compute_dtype)

    return widen


def with_state_dtype(
    tx: Transformation, dtype: torch.dtype, *, compute_dtype: torch.dtype = torch.float32
) -> Transformation:
    """``tx`` with its per-element state stored in ``dtype`` and updates computed in
    ``compute_dtype``; step counts, other 0-d leaves and the parameters keep their dtypes, and
    each update has its gradient's dtype.

    See [Note: state precision]. Wrap an elementwise optimizer (Adam, SGD with momentum, ...):
    the result equals ``tx`` in ``compute_dtype`` with its state rounded to ``dtype`` after every
    step.

    Example:
        >>> import torch
        >>> from shardopt.core import adam
        >>> tx = with_state_dtype(adam(lr=0.1), torch.bfloat16)
        >>> state = tx.init([torch.zeros(3)])
        >>> state[0].mu[0].dtype, state[0].count[0].dtype
        (torch.bfloat16, torch.float32)
        >>> updates, state = tx.update([torch.tensor([1.0, 2.0, 3.0])], state, [torch.zeros(3)])
        >>> updates[0].dtype, state[0].nu[0]
        (torch.float32, tensor([0.0010, 0.0040, 0.0090], dtype=torch.bfloat16))

    Raises:
        ValueError: if ``dtype`` or ``compute_dtype`` is not a floating torch.dtype; at update,
            if a gradient or parameter is wider than ``compute_dtype``.
    """
    _checked_dtype("with_state_dtype", "dtype", dtype)
    _checked_dtype("with_state_dtype", "compute_dtype", compute_dtype)

    def store(state: Any) -> Any:
        return tree_map(lambda x: x.to(dtype) if _is_state(x) else x, state)

    def load(state: Any) -> Any:
        return tree_map(lambda x: x.to(compute_dtype) if _is_state(x) else x, state)

    def widen(tree: PyTree) -> PyTree:
        return tree_map(_widener(compute_dtype), tree)

    def init(params: PyTree) -> Any:
        return store(tx.init(params))

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> tuple[PyTree, Any]:
        wide = params if params is None else widen(params)
        new_updates, new_state = tx.update(widen(updates), load(state), wide)
        narrowed = tree_map(lambda u, g: u if g is None else u.to(g.dtype), new_updates, updates)
        return narrowed, store(new_state)

    return inherit_whole_tensors(Transformation(init, update), [tx])
