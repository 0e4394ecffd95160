"""Global-norm clipping over shards and the all-ranks skip of non-finite steps: one all-reduce."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from shardopt.functional.engine._collectives import ProcessGroup, all_reduce_sum, comm_device

__all__ = [
    "Health",
    "TensorParallel",
    "clip_coefficient",
    "global_health",
    "local_sq_norm",
    "scale_grads",
]

# [Note: one small all-reduce]
# The pieces of all ranks partition every parameter element exactly once, so the squared norm of
# the full gradient is the sum over ranks of each rank's sum of squares of its pieces. One
# all-reduce of a float64 pair per step gives every rank ``[sum of squares, error count]``:
# - the norm, for clipping like ``torch.nn.utils.clip_grad_norm_`` (coefficient
#   ``max_norm / (norm + 1e-6)`` capped at 1);
# - non-finiteness: an inf or nan gradient element makes its rank's sum inf or nan, and so the
#   total, on every rank alike. The decision to skip is therefore taken from the same number on
#   every rank: all skip or none does, nobody waits for a collective the others left out;
# - the count of ranks that found a bad gradient (see [Note: gradient checks]);
# - where gradients are reduced, how many ranks have a gradient for each tensor (see
#   [Note: gradient presence]).


class Health(NamedTuple):
    """What every rank knows after the all-reduce: the global norm, the failed-rank count and,
    if asked, which tensors have a gradient on some rank."""

    norm: torch.Tensor
    errors: int
    present: tuple[bool, ...] | None = None

    @property
    def finite(self) -> bool:
        """Whether every gradient element of every rank is finite."""
        return bool(torch.isfinite(self.norm).item())


def local_sq_norm(
    grads: Sequence[torch.Tensor | None], device: torch.device | None = None
) -> torch.Tensor:
    """The float64 sum of squares of the present ``grads`` (0 if there are none), on ``device``
    (default: the CPU).

    Example:
        >>> local_sq_norm([torch.tensor([3.0]), None, torch.tensor([4.0])])
        tensor(25., dtype=torch.float64)
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g is not None and g.numel():
            wide = torch.float64 if g.dtype == torch.float64 else torch.float32
            groups.setdefault((g.device, wide), []).append(g)
    for (_, wide), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=wide)
        total = total + torch.stack(norms).double().square().sum().to(total.device)
    return total


def global_health(
    grads: Sequence[torch.Tensor | None],
    failed: bool,
    present: Sequence[bool] | None = None,
    *,
    group: ProcessGroup,
    split: TensorParallel | None = None,
) -> Health:
    """Sums this rank's squared norm, error flag and presence flags over ranks (see
    [Note: one small all-reduce]); with ``split``, the squares of the tensor-parallel gradients
    are summed over their group too (see [Note: tensor-parallel norms])."""
    device = comm_device(group)
    flags = [float(failed), *(float(p) for p in present or ())]
    tail = torch.tensor(flags, dtype=torch.float64, device=device)
    cut = [False] * len(grads) if split is None else list(split.sharded)
    whole = local_sq_norm([None if c else g for g, c in zip(grads, cut)], device)
    parts = local_sq_norm([g if c else None for g, c in zip(grads, cut)], device)
    row = torch.cat([whole.view(1), parts.view(1), tail])
    row = all_reduce_sum(row, group=group)
    if split is not None:
        row[1:2] = all_reduce_sum(row[1:2].clone(), group=split.group)
    row = row.cpu()
    anywhere = None if present is None else tuple(bool(c > 0) for c in row[3:].tolist())
    return Health((row[0] + row[1]).sqrt(), int(row[2].item()), anywhere)


class TensorParallel(NamedTuple):
    """Which gradients (one flag per piece) are parts of tensors sharded over ``group``, the
    tensor-parallel group (see [Note: tensor-parallel norms])."""

    group: ProcessGroup
    sharded: tuple[bool, ...]


# [Note: tensor-parallel norms]
# Under tensor parallelism a rank's pieces are parts of its local tensors. Those of a DTensor
# sharded over the tensor-parallel group are other elements on each of its ranks, so their squares
# are summed over that group as well as over the data-parallel one; a replicated parameter (a
# plain tensor, or a DTensor replicated over that group) is the same on all of them and is counted
# once. So the norm, and with it clipping and the skip of non-finite steps, is that of the full
# gradient, as ``clip_grad_norm_`` computes it on one process.


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)`` as a float32 0-d tensor, as torch's clipping.

    Example:
        >>> clip_coefficient(torch.tensor(10.0), 1.0)
        tensor(0.1000)
    """
    return (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)


def scale_grads(
    grads: Sequence[torch.Tensor | None], coef: torch.Tensor, *, in_place: bool
) -> list[torch.Tensor | None]:
    """``grads`` times ``coef``: in place, or into new tensors (the caller's gradients stay as is).

    Example:
        >>> scale_grads([torch.ones(2), None], torch.tensor(0.5), in_place=False)
        [tensor([0.5000, 0.5000]), None]
    """
    out = list(grads)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            by_device.setdefault(g.device, []).append((i, g))
    for device, items in by_device.items():
        tensors = [g for _, g in items]
        c = coef.to(device)
        if in_place:
            torch._foreach_mul_(tensors, c)
        else:
            for (i, _), t in zip(items, torch._foreach_mul(tensors, c)):
                out[i] = t
    return out
