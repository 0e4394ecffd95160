"""Flat in-place rules of sgd, adam, adamw and adagrad: torch's fused kernels, else foreach."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from shardopt.core._base import EmptyState, Transformation
from shardopt.core._pieces import update_pieces_
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._transforms import ScaleByScheduleState
from shardopt.core._tree import tree_leaves

__all__ = ["Kernel", "select_kernel", "update_adagrad_", "update_adam_", "update_sgd_"]

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


class SGDLike(_Hyperparams, Protocol):
    @property
    def momentum(self) -> float: ...
    @property
    def dampening(self) -> float: ...
    @property
    def nesterov(self) -> bool: ...


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
_SGD_FUSED_DEVICES = frozenset({"cuda"})  # see [Note: SGD on CPU is foreach]
_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


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
        if g.dtype != p.dtype or g.device != device or p.dtype not in _FLOAT_DTYPES:
            return Kernel.PURE
        # The fused kernels walk memory in order: every tensor must be laid out the same way.
        if device.type not in fused_on or not (p.is_contiguous() and g.is_contiguous()):
            kernel = Kernel.FOREACH
    return kernel


def split_state(state: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The algorithm's own state in a factory's chain state, and the count trees of its
    schedule pieces (``ScaleByScheduleState``)."""
    main, counts = None, []
    for part in state:
        if isinstance(part, ScaleByScheduleState):
            counts.append(part.count)
        elif not isinstance(part, EmptyState):
            main = part
    return main, counts


def _pick(xs: Sequence[T], idx: Sequence[int]) -> list[T]:
    return [xs[i] for i in idx]


def _leaves(tree: Any) -> list[Any]:
    """``tree_leaves``, without the pytree walk for the usual case of a list of tensors."""
    return tree if type(tree) is list else tree_leaves(tree)


def _learning_rates(lr: ScalarOrSchedule, counts: Tensors | None, n: int) -> list[Lr]:
    if callable(lr):
        assert counts is not None, "a schedule needs counts in the state"
        return [resolve(lr, c) for c in counts]
    return [lr] * n


def _fused_groups(params: Tensors, lrs: list[Lr]) -> list[list[int]]:
    """Indices of the parameters one fused launch can take: same device, dtype and lr."""
    groups: dict[Any, list[int]] = {}
    for i, (p, lr) in enumerate(zip(params, lrs)):
        key = lr if isinstance(lr, (int, float)) else id(lr)
        groups.setdefault((p.device, p.dtype, key), []).append(i)
    return list(groups.values())


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
        return _leaves(tree) if every else _pick(_leaves(tree), idx)

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


def _scale_(xs: Tensors, factor: float) -> None:
    """``x.mul_(factor)`` for each ``x``: torch's CPU foreach mul rounds a Python scalar factor to
    a float16/bfloat16 tensor's dtype first (0.9 becomes 0.8984375), ``mul_`` does not."""
    if any(x.dtype in _HALF_DTYPES for x in xs):
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
    if all(isinstance(lr, (int, float)) for lr in lrs) and len(set(lrs)) == 1:
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


def _fused_sgd(hp: SGDLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
    # Zero buffers make is_first_step unnecessary: see [Note: momentum buffer starts at zero].
    bufs = lists.get("momentum", [])
    for group in _fused_groups(ps, lrs):
        torch._fused_sgd_(
            _pick(ps, group),
            _pick(gs, group),
            _pick(bufs, group) if bufs else [],
            weight_decay=float(hp.weight_decay),
            momentum=hp.momentum,
            lr=_kernel_lr(lrs[group[0]], ps[group[0]].device),
            dampening=hp.dampening,
            nesterov=hp.nesterov,
            maximize=hp.maximize,
            is_first_step=False,
        )
    if "count" in lists:
        torch._foreach_add_(lists["count"], 1)


def _foreach_sgd(hp: SGDLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
    gs = _prepare_grads(hp.maximize, float(hp.weight_decay), ps, gs)
    if hp.momentum != 0:
        bufs, counts = lists["momentum"], lists["count"]
        _scale_(bufs, hp.momentum)
        torch._foreach_add_(bufs, gs, alpha=1 - hp.dampening)
        if hp.dampening != 0:
            for buf, g, n in zip(bufs, gs, counts):
                buf.copy_(torch.where(n == 0, g, buf))
        gs = list(torch._foreach_add(gs, bufs, alpha=hp.momentum)) if hp.nesterov else bufs
        torch._foreach_add_(counts, 1)
    _descend_(ps, gs, lrs)


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


def _fused_adam(hp: AdamLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
    fn = torch._fused_adamw_ if hp.decoupled_weight_decay else torch._fused_adam_
    maxs = lists.get("nu_max", [])
    for group in _fused_groups(ps, lrs):
        steps = _pick(lists["count"], group)
        torch._foreach_add_(steps, 1)
        fn(
            _pick(ps, group),
            _pick(gs, group),
            _pick(lists["mu"], group),
            _pick(lists["nu"], group),
            _pick(maxs, group) if maxs else [],
            steps,
            lr=_kernel_lr(lrs[group[0]], ps[group[0]].device),
            beta1=float(hp.betas[0]),
            beta2=float(hp.betas[1]),
            weight_decay=float(hp.weight_decay),
            eps=hp.eps,
            amsgrad=hp.amsgrad,
            maximize=hp.maximize,
        )


def _foreach_adam(hp: AdamLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
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
    torch._foreach_add_(counts, 1)


# Adagrad -------------------------------------------------------------------------------------


def update_adagrad_(hp: AdagradLike, params: Tensors, grads: list[Any], state: Any) -> None:
    """The piece rule of :func:`~shardopt.core.adagrad` (see [Note: piece rules])."""
    plain = not isinstance(hp.weight_decay, torch.Tensor)
    kernels = {Kernel.FUSED: _fused_adagrad, Kernel.FOREACH: _foreach_adagrad}
    _drive(hp, params, grads, state, kernels, fused_on=FUSED_DEVICES, supported=plain)


def _fused_adagrad(hp: AdagradLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
    for group in _fused_groups(ps, lrs):
        steps = _pick(lists["count"], group)
        torch._foreach_add_(steps, 1)
        torch._fused_adagrad_(
            _pick(ps, group),
            _pick(gs, group),
            _pick(lists["sum"], group),
            steps,
            lr=_kernel_lr(lrs[group[0]], ps[group[0]].device),
            lr_decay=hp.lr_decay,
            weight_decay=float(hp.weight_decay),
            eps=hp.eps,
            maximize=hp.maximize,
        )


def _foreach_adagrad(hp: AdagradLike, ps: Tensors, gs: Tensors, lists: dict, lrs: list[Lr]) -> None:
    gs = _prepare_grads(hp.maximize, float(hp.weight_decay), ps, gs)
    sums, counts = lists["sum"], lists["count"]
    torch._foreach_addcmul_(sums, gs, gs, value=1)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, hp.eps)
    steps = [-hp.step_size(n, lr) for n, lr in zip(counts, lrs)]
    updates = torch._foreach_mul(gs, _scalars_like(steps, ps))
    torch._foreach_div_(updates, std)
    torch._foreach_add_(ps, updates)
    torch._foreach_add_(counts, 1)
