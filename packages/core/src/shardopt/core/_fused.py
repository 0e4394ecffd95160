"""Flat in-place rules of sgd, adam, adamw and adagrad: torch's fused kernels, else foreach."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from shardopt.core._base import Transformation
from shardopt.core._pieces import update_pieces_
from shardopt.core._prepared import (
    FLOAT_DTYPES,
    Prepared,
    advance,
    leaves_of,
    prepared_update,
    split_state,
)
from shardopt.core._schedules import ScalarOrSchedule, resolve

__all__ = [
    "Kernel",
    "prepare_adagrad_",
    "prepare_adam_",
    "select_kernel",
    "update_adagrad_",
    "update_adam_",
]

T = TypeVar("T")
Tensors = list[torch.Tensor]
Lr = float | torch.Tensor


class _Hyperparams(Protocol):
    """What the rules read of an optimizer's validated hyperparameters (``SGDHyperparams`` and
    the others, in the optimizers' modules, frozen dataclasses; typed by shape here, so that
    this module imports none of the optimizers that import it). Read-only: properties."""

    @property
    def lr(self) -> ScalarOrSchedule: ...
    @property
    def weight_decay(self) -> float | torch.Tensor: ...
    @property
    def maximize(self) -> bool: ...
    def build(self) -> Transformation: ...


class AdamLike(_Hyperparams, Protocol):
    @property
    def eps(self) -> float: ...
    @property
    def betas(self) -> tuple[float | torch.Tensor, float | torch.Tensor]: ...
    @property
    def amsgrad(self) -> bool: ...
    @property
    def decoupled_weight_decay(self) -> bool: ...
    def step_scalars(self, count: torch.Tensor, lr: Lr) -> tuple[torch.Tensor, torch.Tensor]: ...


class AdagradLike(_Hyperparams, Protocol):
    @property
    def eps(self) -> float: ...
    @property
    def lr_decay(self) -> float: ...
    def step_size(self, count: torch.Tensor, lr: Lr) -> torch.Tensor: ...


# [Note: piece rules]
# A rule (see [Note: piece fast path]) drops the parameters without a gradient, picks a kernel for
# the rest and updates parameters and state tensors in place:
# - FUSED: ``torch._fused_<name>_`` on CPU and CUDA (SGD: CUDA only, see
#   [Note: SGD on CPU is foreach]), one launch per (device, dtype, lr) group.
#   Counts are float32 0-d tensors on the parameter's device, which is what the kernels take as
#   ``state_steps``. A schedule gives each parameter its own lr tensor (its count may differ
#   when some parameters skipped steps), hence one launch per parameter: telling equal values
#   apart would need a device-to-host read.
# - FOREACH: ``torch._foreach_*`` kernels with the arithmetic of the pure path, for other devices,
#   SGD on CPU, non-contiguous tensors and what the fused kernels lack (SGD's dampened first
#   step).
# - PURE: the pure transformation, copied back, for tensor hyperparameters other than lr, and
#   for parameters whose gradients have another dtype or device.
# Every count of the factory's chain advances by one per parameter stepped, as in the pure path,
# so the pure path and the piece rule can take turns on the same state.


class Kernel(enum.Enum):
    """How a piece rule updates its tensors (see [Note: piece rules])."""

    FUSED = "fused"
    FOREACH = "foreach"
    PURE = "pure"


FUSED_DEVICES = frozenset({"cpu", "cuda"})


def select_kernel(
    params: Tensors, grads: Tensors, *, fused_on: frozenset[str] = FUSED_DEVICES
) -> Kernel:
    """The kernel for these parameters and their (non-None) gradients; ``fused_on`` are the
    device types where the rule calls its fused kernel (none: never).

    Example:
        >>> import torch
        >>> select_kernel([torch.zeros(2)], [torch.ones(2)])
        <Kernel.FUSED: 'fused'>
        >>> select_kernel([torch.zeros(2)], [torch.ones(2)], fused_on=frozenset({"cuda"}))
        <Kernel.FOREACH: 'foreach'>
    """
    kernel = Kernel.FUSED
    for p, g in zip(params, grads):  # one pass: step() asks every step
        device = p.device
        if g.dtype != p.dtype or g.device != device or p.dtype not in FLOAT_DTYPES:
            return Kernel.PURE
        # The fused kernels walk memory in order: every tensor must be laid out the same way.
        if device.type not in fused_on or not (p.is_contiguous() and g.is_contiguous()):
            kernel = Kernel.FOREACH
    return kernel


def _pick(xs: Sequence[T], idx: Sequence[int] | None) -> list[T]:
    """``xs`` at ``idx``; all of ``xs`` for None."""
    return list(xs) if idx is None else [xs[i] for i in idx]


def _learning_rates(lr: ScalarOrSchedule, counts: Tensors | None, n: int) -> list[Lr]:
    if callable(lr):
        assert counts is not None, "a schedule needs counts in the state"
        return [resolve(lr, c) for c in counts]
    return [lr] * n


def _fused_groups(
    params: Tensors, lrs: list[Lr], whole: Prepared | None = None
) -> list[list[int] | None]:
    """Indices of the parameters one fused launch can take: same device, dtype and lr (None:
    all of them, one launch: prepared tensors with one lr, see [Note: prepared pieces])."""
    if whole is not None:
        return [None]
    groups: dict[Any, list[int]] = {}
    for i, (p, lr) in enumerate(zip(params, lrs)):
        key = lr if isinstance(lr, (int, float)) else id(lr)
        groups.setdefault((p.device, p.dtype, key), []).append(i)
    return list(groups.values())


def _first(group: list[int] | None) -> int:
    return 0 if group is None else group[0]


def _kernel_lr(lr: Lr, device: torch.device) -> Lr:
    """A float, or a tensor as the fused kernels read it (CUDA reads a float32 on the GPU)."""
    if not isinstance(lr, torch.Tensor):
        return float(lr)
    if device.type == "cuda" and lr.device.type == "cuda":
        return lr.to(dtype=torch.float32)
    return lr


def _drive(
    hp: Any,
    params: Tensors,
    grads: list[torch.Tensor | None],
    state: Sequence[Any],
    kernels: dict[Kernel, Callable[..., None]],
    *,
    fused_on: frozenset[str],
    supported: bool,
) -> None:
    """The common part of the rules: see [Note: piece rules]."""
    idx = [i for i, g in enumerate(grads) if g is not None]
    if not idx:
        return
    every = len(idx) == len(grads)
    ps, gs = params if every else _pick(params, idx), [g for g in grads if g is not None]
    kernel = select_kernel(ps, gs, fused_on=fused_on) if supported else Kernel.PURE
    if kernel is Kernel.PURE:
        update_pieces_(hp.build(), params, grads, state)
        return
    main, schedule_counts = split_state(state)

    def select(tree: Any) -> Tensors:
        return leaves_of(tree) if every else _pick(leaves_of(tree), idx)

    lists: dict[str, Tensors] = {}
    if main is not None:
        lists = {f: select(v) for f, v in zip(main._fields, main) if v is not None}
    others = [select(c) for c in schedule_counts]
    counts = lists.get("count", others[0] if others else None)
    kernels[kernel](hp, ps, gs, lists, _learning_rates(hp.lr, counts, len(idx)))
    if others:
        torch._foreach_add_([c for cs in others for c in cs], 1)


def _prepare_grads(maximize: bool, weight_decay: float, ps: Tensors, gs: Tensors) -> Tensors:
    """``-g`` with maximize, ``+ weight_decay * p`` (L2): new tensors, the inputs are kept."""
    if maximize:
        gs = list(torch._foreach_neg(gs))
    if weight_decay != 0:
        gs = list(torch._foreach_add(gs, ps, alpha=weight_decay))
    return list(gs)


def _scalars_like(values: Sequence[Lr], ps: Tensors) -> list[Any]:
    """Per-parameter scalars cast to the parameter's dtype, as the pure path's ops cast them."""
    return [v.to(p.dtype) if isinstance(v, torch.Tensor) else v for v, p in zip(values, ps)]


# Adam and AdamW ------------------------------------------------------------------------------

# [Note: fused Adam on CPU depends on the split]
# ``torch._fused_adam_`` / ``_fused_adamw_`` on CPU are split-dependent too: a tensor stepped whole
# or cut at random offsets differs by an ulp in a few elements (5 steps, any of amsgrad, maximize,
# weight decay: 14-18% of float32 splits, up to 4.5e-8 relative; float64 3-11%, up to 4e-17).
# ``torch._fused_adagrad_`` showed no difference in float32 and float64 (it did in float16 and
# bfloat16, like the foreach ops). The rules keep these kernels: Adam, AdamW and Adagrad are held
# to float32 tolerances against torch.optim, which a sharded step meets.


def update_adam_(hp: AdamLike, params: Tensors, grads: list[Any], state: Any) -> None:
    """The piece rule of :func:`~shardopt.core.adam` and :func:`~shardopt.core.adamw`."""
    plain = not any(isinstance(x, torch.Tensor) for x in (*hp.betas, hp.weight_decay))
    kernels = {Kernel.FUSED: _fused_adam, Kernel.FOREACH: _foreach_adam}
    _drive(hp, params, grads, state, kernels, fused_on=FUSED_DEVICES, supported=plain)


def prepare_adam_(
    hp: AdamLike, params: Tensors, state: Any, base: Any = None
) -> Callable[[Tensors, Any], bool] | None:
    """The preparer of :func:`~shardopt.core.adam` and :func:`~shardopt.core.adamw`."""
    plain = not any(isinstance(x, torch.Tensor) for x in (*hp.betas, hp.weight_decay))
    kernels = (_fused_adam, _foreach_adam)
    return prepared_update(
        hp, params, state, base, kernels, fused_on=FUSED_DEVICES, supported=plain
    )


def _fused_adam(
    hp: AdamLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    fn = torch._fused_adamw_ if hp.decoupled_weight_decay else torch._fused_adam_
    maxs = lists.get("nu_max", [])
    for group in _fused_groups(ps, lrs, whole):
        steps = _pick(lists["count"], group)
        advance(steps, whole)
        fn(
            _pick(ps, group),
            _pick(gs, group),
            _pick(lists["mu"], group),
            _pick(lists["nu"], group),
            _pick(maxs, group) if maxs else [],
            steps,
            lr=_kernel_lr(lrs[_first(group)], ps[_first(group)].device),
            beta1=float(hp.betas[0]),
            beta2=float(hp.betas[1]),
            weight_decay=float(hp.weight_decay),
            eps=hp.eps,
            amsgrad=hp.amsgrad,
            maximize=hp.maximize,
        )


def _foreach_adam(
    hp: AdamLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    b1, b2 = float(hp.betas[0]), float(hp.betas[1])
    wd, decoupled = float(hp.weight_decay), hp.decoupled_weight_decay
    gs = _prepare_grads(hp.maximize, 0.0 if decoupled else wd, ps, gs)
    if decoupled and wd != 0:
        for p, factor in zip(ps, _scalars_like([1 - lr * wd for lr in lrs], ps)):
            p.mul_(factor)
    mus, nus, counts = lists["mu"], lists["nu"], lists["count"]
    torch._foreach_lerp_(mus, gs, 1 - b1)
    torch._foreach_mul_(nus, b2)
    torch._foreach_addcmul_(nus, gs, gs, value=1 - b2)
    if hp.amsgrad:
        torch._foreach_maximum_(lists["nu_max"], nus)
    denoms = torch._foreach_sqrt(lists["nu_max"] if hp.amsgrad else nus)
    scalars = [hp.step_scalars(n, lr) for n, lr in zip(counts, lrs)]
    torch._foreach_div_(denoms, _scalars_like([bc2_sqrt for _, bc2_sqrt in scalars], ps))
    torch._foreach_add_(denoms, hp.eps)
    updates = torch._foreach_mul(mus, _scalars_like([-step for step, _ in scalars], ps))
    torch._foreach_div_(updates, denoms)
    torch._foreach_add_(ps, updates)
    advance(counts, whole)


# Adagrad -------------------------------------------------------------------------------------


def update_adagrad_(hp: AdagradLike, params: Tensors, grads: list[Any], state: Any) -> None:
    """The piece rule of :func:`~shardopt.core.adagrad` (see [Note: piece rules])."""
    plain = not isinstance(hp.weight_decay, torch.Tensor)
    kernels = {Kernel.FUSED: _fused_adagrad, Kernel.FOREACH: _foreach_adagrad}
    _drive(hp, params, grads, state, kernels, fused_on=FUSED_DEVICES, supported=plain)


def prepare_adagrad_(
    hp: AdagradLike, params: Tensors, state: Any, base: Any = None
) -> Callable[[Tensors, Any], bool] | None:
    """The preparer of :func:`~shardopt.core.adagrad` (see [Note: prepared pieces])."""
    plain = not isinstance(hp.weight_decay, torch.Tensor)
    kernels = (_fused_adagrad, _foreach_adagrad)
    return prepared_update(
        hp, params, state, base, kernels, fused_on=FUSED_DEVICES, supported=plain
    )


def _fused_adagrad(
    hp: AdagradLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    for group in _fused_groups(ps, lrs, whole):
        steps = _pick(lists["count"], group)
        advance(steps, whole)
        torch._fused_adagrad_(
            _pick(ps, group),
            _pick(gs, group),
            _pick(lists["sum"], group),
            steps,
            lr=_kernel_lr(lrs[_first(group)], ps[_first(group)].device),
            lr_decay=hp.lr_decay,
            weight_decay=float(hp.weight_decay),
            eps=hp.eps,
            maximize=hp.maximize,
        )


def _foreach_adagrad(
    hp: AdagradLike,
    ps: Tensors,
    gs: Tensors,
    lists: dict,
    lrs: list[Lr],
    whole: Prepared | None = None,
) -> None:
    gs = _prepare_grads(hp.maximize, float(hp.weight_decay), ps, gs)
    sums, counts = lists["sum"], lists["count"]
    torch._foreach_addcmul_(sums, gs, gs, value=1)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, hp.eps)
    steps = [-hp.step_size(n, lr) for n, lr in zip(counts, lrs)]
    updates = torch._foreach_mul(gs, _scalars_like(steps, ps))
    torch._foreach_div_(updates, std)
    torch._foreach_add_(ps, updates)
    advance(counts, whole)
