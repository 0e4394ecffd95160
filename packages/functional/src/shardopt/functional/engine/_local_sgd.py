"""Local SGD as pure functions: a local update, then a periodic average of parameters."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from shardopt.core import Transformation, apply_updates
from shardopt.core.blocks import PyTree, tree_leaves, tree_map, tree_structure
from shardopt.functional.engine._collectives import all_reduce_op
from shardopt.functional.engine._failure import fails_together
from shardopt.functional.engine._renamed import renamed_keyword
from shardopt.functional.engine._rooted import ProcessGroup

__all__ = ["average_params", "averaging_due", "local_sgd_step"]

# [Note: local SGD schedule]
# Post-local SGD (Lin et al., 2018) runs the local optimizer at every step and, once
# ``warmup_steps`` steps have been taken, averages the parameters across the group every
# ``period`` steps. ``step`` counts the steps taken before this one (0 at the first step), so
# averaging happens at steps ``warmup_steps``, ``warmup_steps + period``, ... -- the rule of
# ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``, which
# ``shardopt.optim.PeriodicModelAverager`` shares through :func:`averaging_due`.

# [Note: divide before the sum]
# Each rank divides its flat buffer by the group size and the all-reduce sums the quotients, in
# this order, as torch's ``average_parameters`` does: the averages are then bitwise equal to
# torch's whenever the buffer holds a single dtype, and a sum of low-precision values cannot
# overflow where their mean would not. One buffer per (dtype, device) is reduced, so no tensor is
# ever up-cast (torch concatenates all dtypes into one buffer of the promoted dtype instead).


def check_schedule(api: str, period: Any, warmup_steps: Any) -> None:
    """Raises a clear error for a ``period`` below 1 or a negative ``warmup_steps``."""
    for name, value in (("warmup_steps", warmup_steps), ("period", period)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{api}: expected an integer {name}, got {value!r}")
    if warmup_steps < 0:
        raise ValueError(f"{api}: expected warmup_steps >= 0, got {warmup_steps}")
    if period < 1:
        raise ValueError(f"{api}: expected period >= 1, got {period}")


def averaging_due(step: int, *, period: int, warmup_steps: int = 0) -> bool:
    """Whether the parameters are averaged after step ``step`` (see [Note: local SGD schedule]).

    Example:
        >>> [s for s in range(12) if averaging_due(s, period=4, warmup_steps=3)]
        [3, 7, 11]

    Raises:
        ValueError: if ``period < 1``, ``warmup_steps < 0`` or ``step < 0``.
    """
    check_schedule("averaging_due", period, warmup_steps)
    if step < 0:
        raise ValueError(f"averaging_due: expected step >= 0, got {step}")
    return step >= warmup_steps and (step - warmup_steps) % period == 0


def resolve_group(api: str, group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group (``WORLD``) when ``None``; a clear error without one."""
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{api}: expected an initialized default process group "
            "(torch.distributed.init_process_group), got none"
        )
    return dist.group.WORLD


def in_group(group: ProcessGroup) -> bool:
    """Whether this rank belongs to ``group``."""
    return dist.get_rank(group) >= 0


@fails_together("average_parameters")
def average_flat(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> list[torch.Tensor]:
    """The mean of each tensor across ``group``: one flat all-reduce per (dtype, device).

    Returns new tensors (views of the reduced buffers); the inputs are not modified. This rank
    must be in ``group``. See [Note: divide before the sum].
    """
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.dtype, t.device), []).append(i)
    size = dist.get_world_size(group)
    out: list[torch.Tensor] = list(tensors)
    for indices in buckets.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
        flat.div_(size)
        all_reduce_op(flat, dist.ReduceOp.SUM, group=group)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view(tensors[i].shape)
            offset += n
    return out


@renamed_keyword("average_params", "group", "process_group")
@fails_together("average_params")
def average_params(
    params: PyTree, process_group: ProcessGroup | None = None, *, where: PyTree | None = None
) -> PyTree:
    """The leaves of ``params`` averaged across ``process_group`` (default: the whole world), as a
    new tree.

    A collective: every rank of ``process_group`` calls it with trees of the same structure, shapes
    and dtypes. ``where`` (a tree of booleans, or of tensors and ``None``, like the gradients) picks
    the leaves to average; the others, ``None`` leaves, and the whole tree on a rank outside
    ``process_group`` come back as they are. The inputs are not modified.

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> average_params({"w": torch.ones(2)}, where={"w": True})
        {'w': tensor([1., 1.])}
        >>> dist.destroy_process_group()

    Raises:
        ValueError: if a selected leaf is not a floating-point or complex tensor.
    """
    mask = tree_map(lambda p: True, params) if where is None else where
    flags = [m is not None and m is not False for m in tree_leaves(mask)]
    leaves = tree_leaves(params)
    if len(flags) != len(leaves):
        raise ValueError(
            f"average_params: expected where with {len(leaves)} leaves like params, "
            f"got {len(flags)}"
        )
    picked = [i for i, (p, f) in enumerate(zip(leaves, flags)) if f and p is not None]
    for i in picked:
        check_averageable("average_params", leaves[i])
    process_group = resolve_group("average_params", process_group)
    if not picked or not in_group(process_group):
        return params
    averaged = average_flat([leaves[i] for i in picked], process_group)
    new_leaves = list(leaves)
    for i, a in zip(picked, averaged):
        new_leaves[i] = a
    return pytree.tree_unflatten(new_leaves, tree_structure(params))


def check_averageable(api: str, t: Any) -> None:
    """Raises unless ``t`` is a floating-point or complex tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{api}: expected tensors, got {type(t).__name__}")
    if not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"{api}: expected floating-point or complex tensors, got {t.dtype}")


@renamed_keyword("local_sgd_step", "group", "process_group")
@fails_together("local_sgd_step")
def local_sgd_step(
    tx: Transformation,
    params: PyTree,
    grads: PyTree,
    state: Any,
    *,
    step: int,
    period: int,
    warmup_steps: int = 0,
    process_group: ProcessGroup | None = None,
) -> tuple[PyTree, Any]:
    """One step of post-local SGD: a local update by ``tx``, then maybe an average across
    ``process_group``.

    Returns ``(new_params, new_state)``: ``tx``'s update applied to ``params`` and, when
    :func:`averaging_due` says so for ``step`` (the number of steps taken before this one), the
    parameters averaged across ``process_group`` (default: the whole world). As torch's averagers
    do, only parameters with a gradient (a non-``None`` leaf of ``grads``) are averaged. The
    functional counterpart of ``PostLocalSGDOptimizer(optim, PeriodicModelAverager(period,
    warmup_steps))``. The inputs are not modified. A collective on averaging steps: every rank of
    ``process_group`` calls it with the same ``step``, ``period`` and ``warmup_steps``.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from shardopt.core import scale_by_learning_rate
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> tx = scale_by_learning_rate(0.5)
        >>> params = [torch.ones(2)]
        >>> state = tx.init(params)
        >>> for step in range(3):
        ...     params, state = local_sgd_step(tx, params, [torch.ones(2)], state, step=step,
        ...                                    period=2)
        >>> params
        [tensor([-0.5000, -0.5000])]
        >>> dist.destroy_process_group()

    Raises:
        ValueError: if ``period < 1``, ``warmup_steps < 0`` or ``step < 0``.
    """
    due = averaging_due(step, period=period, warmup_steps=warmup_steps)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)
    if due:
        params = average_params(params, process_group, where=grads)
    return params, state
