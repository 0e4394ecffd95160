"""Wrappers as optax's: ``lookahead``, ``schedule_free_adamw`` (``schedule_free``) and
``apply_if_finite``.

``lookahead`` and ``schedule_free`` are elementwise around their inner optimizer (they take its
kind); ``apply_if_finite`` adds a whole-tree count of non-finite values (``Kind.WHOLE_TREE``),
taken through a reduction block on every call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from shardopt.core._base import Transformation, chain, init_count
from shardopt.core._checks import check_learning_rate, expect
from shardopt.core._kinds import Kind, declared, inherit_kind, with_kind
from shardopt.core._moments import decayed_weights, moment_per_elem_norm, zeros_in
from shardopt.core._optax_adaptive import debias
from shardopt.core._reduce import tree_nonfinite_count
from shardopt.core._schedules import ScalarOrSchedule, linear_warmup, resolve
from shardopt.core._transforms import scale_by_learning_rate
from shardopt.core._tree import PyTree, leafwise, tree_leaves, tree_map

__all__ = [
    "ApplyIfFiniteState",
    "LookaheadState",
    "ScheduleFreeState",
    "apply_if_finite",
    "lookahead",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
]


def _needs_params(api: str, params: PyTree | None) -> PyTree:
    if params is None:
        raise ValueError(f"{api}: expected params, got None")
    return params


class LookaheadState(NamedTuple):
    """The fast optimizer's state, the slow parameters and per-parameter counts."""

    fast_state: Any
    slow: PyTree
    count: PyTree


def lookahead(
    fast_optimizer: Transformation, sync_period: int, slow_step_size: float
) -> Transformation:
    """Lookahead (Zhang et al., 2019), as ``optax.lookahead`` with the slow weights kept in the
    state (the params are the fast weights): every ``sync_period``-th update of a parameter,
    with ``d = p + u - slow``, ``slow' = slow + a d`` and ``p' = slow'`` (``a`` is
    ``slow_step_size``); other updates are the fast optimizer's ``u``. Needs ``params``.

    Example:
        >>> import torch
        >>> from shardopt.core import sgd
        >>> tx = lookahead(sgd(lr=1.0), sync_period=2, slow_step_size=0.5)
        >>> p = [torch.zeros(1)]
        >>> u1, state = tx.update([torch.ones(1)], tx.init(p), p)
        >>> u2, state = tx.update([torch.ones(1)], state, [p[0] + u1[0]])
        >>> u1, u2
        ([tensor([-1.])], [tensor([0.])])
    """
    expect(sync_period >= 1, "lookahead", "sync_period >= 1", sync_period)

    def init(params: PyTree) -> LookaheadState:
        slow = tree_map(lambda p: None if p is None else p.detach().clone(), params)
        return LookaheadState(fast_optimizer.init(params), slow, init_count(params))

    def rule(u: torch.Tensor, p: Any, slow: Any, count: Any) -> tuple[Any, ...]:
        sync = torch.remainder(count, sync_period) == sync_period - 1
        diff = p + u - slow
        u = torch.where(sync, u - (1 - slow_step_size) * diff, u)
        return u, torch.where(sync, slow + slow_step_size * diff, slow), count + 1

    def update(updates: PyTree, state: LookaheadState, params: PyTree | None = None) -> Any:
        params = _needs_params("lookahead", params)
        fast, fast_state = fast_optimizer.update(updates, state.fast_state, params)
        new, (slow, count) = leafwise(rule, fast, params, state.slow, state.count)
        return new, LookaheadState(fast_state, slow, count)

    return inherit_kind(Transformation(init, update), [fast_optimizer])


class ScheduleFreeState(NamedTuple):
    """Per parameter: the count, ``b1``, the sum of the weights ``max_lr**power``, the largest
    learning rate so far, and ``z``; and the base optimizer's state."""

    count: PyTree
    b1: PyTree
    weight_sum: PyTree
    max_lr: PyTree
    base_optimizer_state: Any
    z: PyTree


def schedule_free(
    base_optimizer: Transformation,
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> Transformation:
    """Schedule-free wrapping (Defazio et al., 2024), as ``optax.contrib.schedule_free``: the
    params are ``y``; with the base optimizer's step ``u``, ``z' = z + u``,
    ``x = (y - (1 - b1) z) / b1``, ``c = w / (W + w)`` for ``w = max_lr**weight_lr_power``
    (``W`` the sum of earlier weights; 0 when both are 0), ``x' = (1 - c) x + c z'`` and
    ``y' = b1 x' + (1 - b1) z'``. Evaluate at ``x``: :func:`schedule_free_eval_params`.

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates, scale_by_learning_rate
        >>> tx = schedule_free(scale_by_learning_rate(0.5), lr=0.5, b1=0.5)
        >>> p = [torch.zeros(1)]
        >>> u, state = tx.update([torch.ones(1)], tx.init(p), p)
        >>> y = apply_updates(p, u)
        >>> y, schedule_free_eval_params(state, y)
        ([tensor([-0.5000])], [tensor([-0.5000])])
    """

    def init(params: PyTree) -> ScheduleFreeState:
        zeros = tree_map(lambda p: None if p is None else p.new_zeros(()), params)
        z = tree_map(
            lambda p: None if p is None else p.detach().to(state_dtype or p.dtype, copy=True),
            params,
        )
        b1s = tree_map(lambda p: None if p is None else p.new_full((), b1), params)
        state = (init_count(params), b1s, zeros, zeros, base_optimizer.init(params), z)
        return ScheduleFreeState(*state)

    def rule(g: Any, y: Any, u: Any, count: Any, b1_: Any, w_sum: Any, max_lr: Any, z: Any) -> Any:
        max_lr = torch.clamp(max_lr, min=torch.as_tensor(resolve(lr, count)).to(max_lr))
        weight = max_lr**weight_lr_power
        total = w_sum + weight
        ck = torch.where(total > 0, weight / total, torch.zeros_like(total))
        new_z = (z + u).to(z.dtype)
        x = (1 - ck) * ((y - (1 - b1) * z) / b1) + ck * new_z
        new_y = b1 * x + (1 - b1) * new_z
        return (new_y - y).to(y.dtype), u, count + 1, b1_, total, max_lr, new_z

    def update(updates: PyTree, state: ScheduleFreeState, params: PyTree | None = None) -> Any:
        params = _needs_params("schedule_free", params)
        base, base_state = base_optimizer.update(updates, state.base_optimizer_state, params)
        parts = (state.count, state.b1, state.weight_sum, state.max_lr)
        new, out = leafwise(rule, updates, params, base, *parts, state.z)
        count, b1s, weight_sum, max_lr = out[1:5]
        return new, ScheduleFreeState(count, b1s, weight_sum, max_lr, base_state, out[5])

    return inherit_kind(Transformation(init, update), [base_optimizer])


def schedule_free_eval_params(state: ScheduleFreeState, params: PyTree) -> PyTree:
    """The point to evaluate a schedule-free model at: ``x = (y - (1 - b1) z) / b1`` (see
    :func:`schedule_free`)."""
    return tree_map(
        lambda y, z, b: None if y is None else (y - (1 - b) * z) / b, params, state.z, state.b1
    )


def _scale_by_rms_debiased(b2: float, eps: float) -> Transformation:
    """optax's ``scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True)``."""

    def init(params: PyTree) -> tuple[PyTree, PyTree]:
        return init_count(params), zeros_in(params)

    def rule(g: torch.Tensor, p: Any, count: Any, nu: Any) -> tuple[Any, ...]:
        nu = moment_per_elem_norm(g, nu, b2, 2)
        return g / (debias(nu, b2, count + 1).sqrt() + eps), count + 1, nu

    def update(updates: PyTree, state: Any, params: PyTree | None = None) -> Any:
        del params
        new, parts = leafwise(rule, updates, None, *state)
        return new, parts

    return with_kind(Transformation(init, update), Kind.ELEMENTWISE, "scale_by_rms")


def schedule_free_adamw(
    lr: float = 0.0025,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> Transformation:
    """Schedule-free AdamW, as ``optax.contrib.schedule_free_adamw``: :func:`schedule_free`
    around ``g / (sqrt(nu_hat) + eps)`` (``nu`` the debiased moving average of ``g**2`` with
    ``b2``) plus ``weight_decay * y``, times ``-lr``; ``warmup_steps`` warms ``lr`` up linearly
    from 0. The schedule is read at the count of updates already applied, for both the step and
    ``max_lr`` (optax reads ``max_lr``'s one update later).

    Example:
        >>> import torch
        >>> tx = schedule_free_adamw(lr=0.1, b1=0.5)
        >>> p = [torch.zeros(1)]
        >>> tx.update([torch.tensor([2.0])], tx.init(p), p)[0]
        [tensor([-0.1000])]
    """
    check_learning_rate("schedule_free_adamw", lr, schedule=False)
    schedule: ScalarOrSchedule = lr
    if warmup_steps is not None:
        schedule = linear_warmup(float(lr), warmup_steps)
    base = chain(
        _scale_by_rms_debiased(b2, eps),
        decayed_weights(weight_decay, None),
        scale_by_learning_rate(schedule),
    )
    tx = schedule_free(
        with_kind(base, Kind.ELEMENTWISE, "schedule_free_adamw"),
        schedule,
        b1,
        weight_lr_power,
        state_dtype,
    )
    return with_kind(tx, Kind.ELEMENTWISE, "schedule_free_adamw")


class ApplyIfFiniteState(NamedTuple):
    """Consecutive and total counts of rejected updates, whether the last was finite, and the
    inner state (0-d tensors, the same on every rank)."""

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def _select(keep: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where ``keep``, else ``old``, leaf by leaf of two trees of one structure."""

    def pick(n: Any, o: Any) -> Any:
        if isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor):
            return torch.where(keep.to(n.device), n, o)
        return n

    return pytree.tree_map(pick, new, old, is_leaf=lambda x: x is None)


def apply_if_finite(inner: Transformation, max_consecutive_errors: int) -> Transformation:
    """Applies ``inner`` only to gradients whose every element in the whole tree is finite, as
    ``optax.apply_if_finite``: a rejected step gives zero updates and keeps the inner state,
    until more than ``max_consecutive_errors`` in a row are rejected (then it applies anyway).

    Example:
        >>> import torch
        >>> from shardopt.core import sgd
        >>> tx = apply_if_finite(sgd(lr=1.0), max_consecutive_errors=2)
        >>> p = [torch.zeros(2)]
        >>> u, state = tx.update([torch.tensor([1.0, float("inf")])], tx.init(p), p)
        >>> u, int(state.notfinite_count)
        ([tensor([0., 0.])], 1)
    """

    def init(params: PyTree) -> ApplyIfFiniteState:
        leaves = [p for p in tree_leaves(params) if p is not None]
        device = leaves[0].device if leaves else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.int32, device=device)
        yes = torch.ones((), dtype=torch.bool, device=device)
        return ApplyIfFiniteState(zero, yes, zero.clone(), inner.init(params))

    def update(updates: PyTree, state: ApplyIfFiniteState, params: PyTree | None = None) -> Any:
        finite = tree_nonfinite_count(updates) == 0  # every rank, every call
        finite = finite.to(state.notfinite_count.device)
        count = torch.where(
            finite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1
        )
        apply = finite | (count > max_consecutive_errors)
        new, inner_state = inner.update(updates, state.inner_state, params)
        new = tree_map(
            lambda u: (
                None if u is None else torch.where(apply.to(u.device), u, torch.zeros_like(u))
            ),
            new,
        )
        total = torch.where(finite, state.total_notfinite, state.total_notfinite + 1)
        kept = _select(apply, inner_state, state.inner_state)
        return new, ApplyIfFiniteState(count, finite, total, kept)

    tx = Transformation(init, update)
    found = declared(inner)
    if found is None:
        return tx
    return with_kind(tx, found.kind | Kind.WHOLE_TREE, "apply_if_finite")
