"""The SGD piece rule and its preparer: foreach on the CPU (bitwise torch.optim.SGD), fused on
CUDA (see [Note: piece rules] in _fused.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardopt.core._fused import (
    Kernel,
    Lr,
    Tensors,
    _drive,
    _first,
    _fused_groups,
    _Hyperparams,
    _kernel_lr,
    _pick,
    _prepare_grads,
)
from shardopt.core._prepared import Prepared, advance, prepared_update

__all__ = ["prepare_sgd_", "update_sgd_"]


class SGDLike(_Hyperparams, Protocol):
    @property
    def momentum(self) -> float: ...
    @property
    def dampening(self) -> float: ...
    @property
    def nesterov(self) -> bool: ...


_SGD_FUSED_DEVICES = frozenset({"cuda"})  # see [Note: SGD on CPU is foreach]
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _scale_(xs: Tensors, factor: float) -> None:
    """``x.mul_(factor)`` for each ``x``: torch's CPU foreach mul rounds a Python scalar factor to
    a float16/bfloat16 tensor's dtype first (0.9 becomes 0.8984375), ``mul_`` does not."""
    if not _HALF_DTYPES.isdisjoint({x.dtype for x in xs}):
        for x in xs:
            x.mul_(factor)
    else:
        torch._foreach_mul_(xs, factor)


def _descend_(ps: Tensors, us: Tensors, lrs: list[Lr]) -> None:
    """``p -= lr * u`` as torch.optim.SGD: ``p.add_(u, alpha=-lr)``.

    torch reads a tensor lr as a Python scalar there; so do we for one on the CPU (no device
    sync). Another goes to ``addcmul_``, as in ``step_by_learning_rate``: the same bits in float32
    and float64, not in float16/bfloat16, where ``lr.to(p.dtype)`` rounds the lr.
    """
    lrs = [
        float(lr) if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" else lr for lr in lrs
    ]
    if {type(lr) for lr in lrs} <= {int, float} and len(set(lrs)) == 1:
        torch._foreach_add_(ps, us, alpha=-float(lrs[0]))
        return
    for p, u, lr in zip(ps, us, lrs):
        if isinstance(lr, torch.Tensor):
            p.addcmul_(u, lr.to(p.dtype), value=-1)
        else:
            p.add_(u, alpha=-lr)


# SGD ----------------------------------------------------------------------------------------


# [Note: SGD on CPU is foreach]
# torch._fused_sgd_'s CPU kernel rounds its scalar tail (the last elements of a tensor, fewer than
# a vector) otherwise than its vectorised body, so its result depends on where a tensor is cut. A
# rank's shard cuts tensors anywhere: sharded SGD was 1e-8..1e-7 (relative, float32) off
# torch.optim.SGD. torch's own CPU SGD (for-loop, the default, and foreach) uses per-tensor ops
# that round every element alike. So on CPU the rule runs ``_foreach_sgd``: torch's ops in torch's
# order (``neg``; ``add(p, alpha=wd)``; ``mul_(momentum)``, ``add_(g, alpha=1 - dampening)``;
# ``add(buf, alpha=momentum)``; ``p.add_(u, alpha=-lr)``), bitwise equal to
# torch.optim.SGD(foreach=False) on whole tensors and on any split in float32 and float64. In
# float16/bfloat16 it is bitwise equal on whole tensors only: CPU ``add`` with alpha is itself
# split-dependent there (and torch's foreach SGD differs from its for-loop, see ``_scale_``).
# Bitwise SGD is the product's claim, worth more than the fused kernel's speed: the step takes
# torch.optim.SGD's own time, more than the fused one on one thread, as the ops walk memory three
# to five times (measured: docs/performance.md; benchmarks/bench_flat_adam.py, sgd row). CUDA keeps
# the fused kernel (one launch instead of up to five; its split-invariance is untested here):
# compare it with torch.optim.SGD(fused=True).


def update_sgd_(hp: SGDLike, params: Tensors, grads: list[Any], state: Any) -> None:
    """The piece rule of :func:`~shardopt.core.sgd` (see [Note: piece rules] and
    [Note: SGD on CPU is foreach])."""
    damped = hp.momentum != 0 and hp.dampening != 0
    plain = not isinstance(hp.weight_decay, torch.Tensor)
    kernels = {Kernel.FUSED: _fused_sgd, Kernel.FOREACH: _foreach_sgd}
    fused_on = frozenset() if damped else _SGD_FUSED_DEVICES
    _drive(hp, params, grads, state, kernels, fused_on=fused_on, supported=plain)


def prepare_sgd_(
    hp: SGDLike, params: Tensors, state: Any, base: Any = None
) -> Callable[[Tensors, Any], bool] | None:
    """The preparer of :func:`~shardopt.core.sgd` (see [Note: prepared pieces])."""
    if hp.momentum != 0 and hp.dampening != 0:  # its first step reads each count (the rule's)
        return None
    plain = not isinstance(hp.weight_decay, torch.Tensor)
    kernels = (_fused_sgd, _foreach_sgd)
    return prepared_update(
        hp, params, state, base, kernels, fused_on=_SGD_FUSED_DEVICES, supported=plain
    )


def _fused_sgd(
    hp: SGDLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    # Zero buffers make is_first_step unnecessary: see [Note: momentum buffer starts at zero].
    bufs = lists.get("momentum", [])
    for group in _fused_groups(ps, lrs, whole):
        torch._fused_sgd_(
            _pick(ps, group),
            _pick(gs, group),
            _pick(bufs, group) if bufs else [],
            weight_decay=float(hp.weight_decay),
            momentum=hp.momentum,
            lr=_kernel_lr(lrs[_first(group)], ps[_first(group)].device),
            dampening=hp.dampening,
            nesterov=hp.nesterov,
            maximize=hp.maximize,
            is_first_step=False,
        )
    if "count" in lists:
        advance(lists["count"], whole)


def _foreach_sgd(
    hp: SGDLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    gs = _prepare_grads(hp.maximize, float(hp.weight_decay), ps, gs)
    if hp.momentum != 0:
        bufs, counts = lists["momentum"], lists["count"]
        _scale_(bufs, hp.momentum)
        torch._foreach_add_(bufs, gs, alpha=1 - hp.dampening)
        if hp.dampening != 0:
            for buf, g, n in zip(bufs, gs, counts):
                buf.copy_(torch.where(n == 0, g, buf))
        gs = list(torch._foreach_add(gs, bufs, alpha=hp.momentum)) if hp.nesterov else bufs
        advance(counts, whole)
    _descend_(ps, gs, lrs)
