"""Gradient accumulation: one inner step on the mean gradient of every ``k`` micro-steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation, inherit_whole_tensors
from shardopt.core._tree import PyTree, tree_leaves, tree_map, zeros_like_tree

__all__ = ["MultiStepsState", "multi_steps"]

# [Note: branch-free accumulation]
# ``multi_steps`` must trace under torch.func.grad and torch.func.vmap (where each ensemble
# member could in principle carry its own counter), so it never branches in Python on the
# micro-step counter. Every call sums the gradient into the accumulator and runs the inner
# transformation on the mean so far, ``(sum + g) / k``; ``torch.where`` on ``emit = (counter + 1
# == k)`` then picks the inner updates and the new inner state at the last micro-step of a
# window, and zero updates and the old inner state before it. The price is one discarded inner
# update per micro-step, small next to the forward and backward passes it accompanies.
#
# Between emits the updates are zeros, not ``None``: ``None`` would make the structure of the
# output depend on the counter's value, which cannot be traced; ``apply_updates`` leaves the
# parameters bitwise unchanged with a zero update (up to the sign of a zero parameter).
#
# ``None`` gradients: a ``None`` leaf adds nothing to its sum in that micro-step, as a parameter
# without a gradient in one backward pass adds nothing to ``p.grad`` in torch. The inner
# transformation always sees a tensor (the window's mean) for every parameter, so a parameter
# whose gradient is ``None`` in *every* micro-step of a window is stepped with a zero gradient,
# where torch.optim would skip it (that needs a branch on values); leave such parameters out
# with ``masked``/``partition``.


class MultiStepsState(NamedTuple):
    """The state of :func:`multi_steps`.

    Attributes:
        mini_step: int64 0-d tensor, the micro-steps already summed in the current window.
        acc_grads: the sums of the window's gradients so far (zeros at the start of a window).
        inner_state: the state of the inner transformation, advanced once per window.
    """

    mini_step: torch.Tensor
    acc_grads: PyTree
    inner_state: Any


def _select(emit: torch.Tensor, new: Any, old: Any) -> Any:
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return torch.where(emit, new, old)
    return new


def multi_steps(inner: Transformation, every_k: int) -> Transformation:
    """Accumulates ``every_k`` micro-step gradients, then steps ``inner`` on their mean.

    The result after ``k`` micro-steps equals one ``inner`` step on the mean gradient (``k``
    backward passes, then one ``optimizer.step()``, in torch). The micro-steps before the last of
    a window return zero updates. See [Note: branch-free accumulation].

    Example:
        >>> import torch
        >>> from shardopt.core import scale
        >>> tx = multi_steps(scale(-1.0), every_k=2)
        >>> state = tx.init([torch.zeros(1)])
        >>> u1, state = tx.update([torch.tensor([1.0])], state)
        >>> u2, state = tx.update([torch.tensor([3.0])], state)
        >>> u1, u2
        ([tensor([0.])], [tensor([-2.])])

    Raises:
        ValueError: if ``every_k`` is not an int >= 1.
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"multi_steps: expected an int every_k >= 1, got {every_k!r}")

    def init(params: PyTree) -> MultiStepsState:
        tensors = [p for p in tree_leaves(params) if isinstance(p, torch.Tensor)]
        device = tensors[0].device if tensors else None
        counter = torch.zeros((), dtype=torch.int64, device=device)
        return MultiStepsState(counter, zeros_like_tree(params), inner.init(params))

    def update(
        updates: PyTree, state: MultiStepsState, params: PyTree | None = None
    ) -> tuple[PyTree, MultiStepsState]:
        step = state.mini_step + 1
        emit = step >= every_k
        sums = tree_map(
            lambda g, acc: acc if g is None or acc is None else acc + g.to(acc.dtype),
            updates,
            state.acc_grads,
        )
        means = tree_map(lambda s: None if s is None else s / every_k, sums)
        inner_updates, inner_state = inner.update(means, state.inner_state, params)
        new_updates = tree_map(
            lambda u: None if u is None else torch.where(emit, u, torch.zeros_like(u)),
            inner_updates,
        )
        new_state = MultiStepsState(
            mini_step=torch.where(emit, torch.zeros_like(step), step),
            acc_grads=tree_map(
                lambda s: None if s is None else torch.where(emit, torch.zeros_like(s), s), sums
            ),
            inner_state=tree_map(lambda n, o: _select(emit, n, o), inner_state, state.inner_state),
        )
        return new_updates, new_state

    return inherit_whole_tensors(Transformation(init, update), [inner])
