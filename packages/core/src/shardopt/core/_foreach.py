"""Shared parts of rmsprop, adamax, nadam, radam, adadelta, rprop, asgd: rounding, piece rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from shardopt.core._base import Transformation
from shardopt.core._schedules import ScalarOrSchedule, resolve
from shardopt.core._transforms import add_decayed_weights, scale
from shardopt.core._tree import PyTree, tree_leaves

__all__: list[str] = []  # private helpers of the optimizer modules

Tensors = list[torch.Tensor]

# ---------------------------------------------------------------------------------------------
# Shared chain prologue of the six factories.


def decays(weight_decay: float | torch.Tensor) -> bool:
    """Whether a weight decay is applied: torch skips a zero one; a tensor always counts."""
    return isinstance(weight_decay, torch.Tensor) or weight_decay != 0


def prologue(maximize: bool, weight_decay: float | torch.Tensor) -> list[Transformation]:
    """The first links of torch's order: negate the gradient, then add ``weight_decay * param``."""
    links = [scale(-1.0)] if maximize else []
    if decays(weight_decay):
        links.append(add_decayed_weights(weight_decay))
    return links


# [Note: torch's parameter rounding]
# The pure rules return the update ``u`` that ``apply_updates`` adds, but torch writes the new
# parameter with fused kernels: ``addcdiv_`` (computes ``p + (value * t1) / t2``), ``add_`` with
# ``alpha`` (a fused multiply-add on CPU) or two of them in a row (NAdam). Where torch's result
# is ``p + x`` for an ``x`` we can compute (addcdiv, ``alpha=-1``) we return ``u = x``. Otherwise
# we compute torch's new parameter ``q`` with the same kernels and return ``u = q - p``: the
# difference is exact while ``q`` and ``p`` are within a factor 2 (Sterbenz), so ``p + u == q``.
# This is what keeps float32 runs within 1e-6 of torch (a rounding of its own per step drifts
# further over 50 steps). The scalars (bias corrections, step sizes) are computed in float64
# like torch's Python floats, or in the dtype of a tensor ``lr``, as torch does.


def lr_scalar(lr: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``lr`` as a 0-d tensor: itself if a tensor, else float64 on ``like``'s device."""
    if isinstance(lr, torch.Tensor):
        return lr
    return torch.tensor(lr, dtype=torch.float64, device=like.device)


def operand(x: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A scalar as torch uses a Python scalar with ``like``: a tensor is cast to its dtype.

    Without the cast a float64 0-d scalar would promote a 0-d float32 parameter's arithmetic.
    """
    return x.to(like.dtype) if isinstance(x, torch.Tensor) else x


def add_like_torch(p: torch.Tensor, x: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """``p.add(x, alpha=alpha)`` rounded like torch's kernel (one rounding of ``p + alpha * x``).

    A tensor ``alpha`` (possibly traced) cannot be passed to the kernel: for float32 and float64
    ``torch.addcmul(p, x, alpha)`` rounds as it does (the same fused multiply-add, also batched
    under vmap); narrower dtypes compute in float64 and round once.
    """
    if not isinstance(alpha, torch.Tensor):
        return torch.add(p, x, alpha=alpha)
    a = alpha.to(device=p.device, dtype=p.dtype)
    if p.dtype in (torch.float16, torch.bfloat16):
        return (p.double() + x.double() * a.double()).to(p.dtype)
    return torch.addcmul(p, x, a)


def sqrt_like_python(x: torch.Tensor) -> torch.Tensor:
    """``x ** 0.5`` rounded like Python's float power (``x ** 0.5`` on a tensor is a sqrt)."""
    return torch.pow(x, torch.tensor(0.5, dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# Piece rules.
#
# [Note: foreach rules]
# Each rule does, on the parameters that have a gradient, the sequence of foreach kernels of
# torch's ``foreach=True`` implementation of the same optimizer, with the same per-tensor Python
# float scalars (bias corrections, step sizes), so its results are bitwise equal to
# ``torch.optim.<Class>(foreach=True)`` where torch's arithmetic is the same (see test_foreach).
# The counts are read to the host once per step for those scalars (twice for NAdam, whose
# scalars also read the updated ``mu_product``), as torch reads its ``step`` tensors. Gradients
# are never modified: a kernel that would write into them works on a copy. A schedule ``lr`` is
# resolved per tensor from the counts before the step, as in the pure path, whose state the
# rules update (the two are interchangeable). No case falls back to the pure path: tensor and
# schedule learning rates become per-tensor Python floats, as torch reads a tensor lr.


def _pick(tree: PyTree, index: list[int]) -> Tensors:
    leaves = tree_leaves(tree)
    return [leaves[i] for i in index]


def _host_floats(tensors: Sequence[torch.Tensor]) -> list[float]:
    if not tensors:
        return []
    return torch.stack([t.detach().to("cpu", torch.float64) for t in tensors]).tolist()


def _steps_and_lrs(counts: Tensors, lr: ScalarOrSchedule) -> tuple[list[float], list[float]]:
    """Advances the counts; returns the new step numbers and each tensor's learning rate."""
    if callable(lr):
        values = [torch.as_tensor(resolve(lr, c), dtype=torch.float64) for c in counts]
        host = _host_floats(counts + values)
        steps, lrs = host[: len(counts)], host[len(counts) :]
    else:
        steps = _host_floats(counts)
        lrs = [float(lr)] * len(counts)
    torch._foreach_add_(counts, 1.0)
    return [s + 1.0 for s in steps], lrs


def _active(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> tuple[list[int], Tensors, Tensors]:
    index = [i for i, g in enumerate(grads) if g is not None]
    return index, [params[i] for i in index], [grads[i] for i in index]  # type: ignore[misc]


def _prologue_grads(gs: Tensors, ps: Tensors, hp: Any) -> Tensors:
    """Negated for ``maximize``, plus coupled weight decay: a new list, ``gs`` untouched."""
    if hp.maximize:
        gs = list(torch._foreach_neg(gs))
    if decays(hp.weight_decay) and not getattr(hp, "decoupled_weight_decay", False):
        gs = list(torch._foreach_add(gs, ps, alpha=float(hp.weight_decay)))
    return gs


class _Active(NamedTuple):
    """What a piece rule steps: the tensors that have a gradient and their per-tensor scalars."""

    positions: list[int]  # in the rule's lists
    params: Tensors
    grads: Tensors  # as _prologue_grads returns them (the caller's tensors are never written)
    steps: list[float]  # the advanced step numbers
    lrs: list[float]


def _begin(params: Tensors, grads: list[torch.Tensor | None], st: Any, hp: Any) -> _Active | None:
    """The common start of a piece rule: ``None`` if no tensor has a gradient; else advances their
    counts in ``st`` and returns them with their learning rates and prologue gradients."""
    index, ps, gs = _active(params, grads)
    if not index:
        return None
    steps, lrs = _steps_and_lrs(_pick(st.count, index), hp.lr)
    return _Active(index, ps, _prologue_grads(gs, ps, hp), steps, lrs)


def _average_square_(avgs: Tensors, xs: Tensors, decay: float) -> None:
    """``avg = decay * avg + (1 - decay) * x * x`` in place, with torch's two kernels."""
    torch._foreach_mul_(avgs, decay)
    torch._foreach_addcmul_(avgs, xs, xs, value=1 - decay)


def _adam_moments_(st: Any, act: _Active, betas: tuple[float, float]) -> tuple[Tensors, Tensors]:
    """Updates and returns the ``exp_avg`` and ``exp_avg_sq`` of the active tensors."""
    index, gs = act.positions, act.grads
    exp_avgs, exp_avg_sqs = _pick(st.exp_avg, index), _pick(st.exp_avg_sq, index)
    torch._foreach_lerp_(exp_avgs, gs, 1 - betas[0])
    _average_square_(exp_avg_sqs, gs, betas[1])
    return exp_avgs, exp_avg_sqs


def _add_scaled_(ps: Tensors, xs: Tensors, scalars: list[float]) -> None:
    """``p += s * x`` per tensor: torch's fused ``alpha`` kernel when all ``s`` are equal (always
    but for a schedule at unequal counts, where the product is rounded first)."""
    if len(set(scalars)) == 1:
        torch._foreach_add_(ps, xs, alpha=scalars[0])
    else:
        torch._foreach_add_(ps, torch._foreach_mul(xs, scalars))


def _decay_decoupled_(ps: Tensors, lrs: list[float], hp: Any) -> None:
    if hp.decoupled_weight_decay and decays(hp.weight_decay):
        torch._foreach_mul_(ps, [1 - lr * float(hp.weight_decay) for lr in lrs])


def rmsprop_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``rmsprop``: ``state[at]`` is its transformation's state."""
    rms = state[at]
    if (act := _begin(params, grads, rms, hp)) is None:
        return
    index, ps, gs, _, lrs = act
    square_avgs = _pick(rms.square_avg, index)
    _average_square_(square_avgs, gs, hp.alpha)
    if hp.centered:
        grad_avgs = _pick(rms.grad_avg, index)
        torch._foreach_lerp_(grad_avgs, gs, 1 - hp.alpha)
        avg = list(torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1))
        torch._foreach_sqrt_(avg)
    else:
        avg = list(torch._foreach_sqrt(square_avgs))
    torch._foreach_add_(avg, hp.eps)
    neg_lrs = [-lr for lr in lrs]
    if hp.momentum > 0:
        bufs = _pick(rms.momentum, index)
        torch._foreach_mul_(bufs, hp.momentum)
        torch._foreach_addcdiv_(bufs, gs, avg)
        _add_scaled_(ps, bufs, neg_lrs)
    else:
        torch._foreach_addcdiv_(ps, gs, avg, neg_lrs)


def adamax_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``adamax``: ``state[at]`` is its transformation's state."""
    st = state[at]
    if (act := _begin(params, grads, st, hp)) is None:
        return
    index, ps, gs, steps, lrs = act
    beta1, beta2 = hp.betas
    exp_avgs, exp_infs = _pick(st.exp_avg, index), _pick(st.exp_inf, index)
    torch._foreach_lerp_(exp_avgs, gs, 1 - beta1)
    torch._foreach_mul_(exp_infs, beta2)
    norms = list(torch._foreach_abs(gs))
    torch._foreach_add_(norms, hp.eps)
    torch._foreach_maximum_(exp_infs, norms)
    step_sizes = [(lr / (1 - beta1**s)) * -1 for lr, s in zip(lrs, steps)]
    torch._foreach_addcdiv_(ps, exp_avgs, exp_infs, step_sizes)


def nadam_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``nadam``: ``state[at]`` is its transformation's state."""
    st = state[at]
    if (act := _begin(params, grads, st, hp)) is None:
        return
    index, ps, gs, steps, lrs = act
    _decay_decoupled_(ps, lrs, hp)
    beta1, beta2 = hp.betas
    exp_avgs, exp_avg_sqs = _adam_moments_(st, act, hp.betas)
    denom = list(torch._foreach_sqrt(exp_avg_sqs))
    decay = hp.momentum_decay
    mus = [beta1 * (1.0 - 0.5 * (0.96 ** (s * decay))) for s in steps]
    mu_nexts = [beta1 * (1.0 - 0.5 * (0.96 ** ((s + 1) * decay))) for s in steps]
    mu_products = _pick(st.mu_product, index)
    torch._foreach_mul_(mu_products, mus)
    torch._foreach_div_(denom, [(1 - beta2**s) ** 0.5 for s in steps])
    torch._foreach_add_(denom, hp.eps)
    products = _host_floats(mu_products)
    grad_sizes = [(lr * (1.0 - mu) / (1.0 - mp)) * -1 for lr, mu, mp in zip(lrs, mus, products)]
    avg_sizes = [(lr * nxt / (1.0 - mp * nxt)) * -1 for lr, nxt, mp in zip(lrs, mu_nexts, products)]
    torch._foreach_addcdiv_(ps, gs, denom, grad_sizes)
    torch._foreach_addcdiv_(ps, exp_avgs, denom, avg_sizes)


def _radam_sizes(
    steps: list[float], lrs: list[float], beta1: float, beta2: float
) -> tuple[list[float], list[float]]:
    """Per tensor: the adaptive (rectified) and the plain (unrectified) step sizes, one is 0."""
    rho_inf = 2 / (1 - beta2) - 1
    adaptive, plain = [], []
    for s, lr in zip(steps, lrs):
        rho_t = rho_inf - 2 * s * (beta2**s) / (1 - beta2**s)
        rect = 0.0
        if rho_t > 5:
            ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            rect = ratio**0.5
        bias_correction1 = 1 - beta1**s
        plain.append((lr * (0.0 if rect > 0 else 1.0) / bias_correction1) * -1)
        adaptive.append(((1 - beta2**s) ** 0.5) * (lr * rect / bias_correction1) * -1)
    return adaptive, plain


def radam_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``radam``: ``state[at]`` is its transformation's state."""
    st = state[at]
    if (act := _begin(params, grads, st, hp)) is None:
        return
    _, ps, _, steps, lrs = act
    _decay_decoupled_(ps, lrs, hp)
    beta1, beta2 = hp.betas
    exp_avgs, exp_avg_sqs = _adam_moments_(st, act, hp.betas)
    adaptive, plain = _radam_sizes(steps, lrs, beta1, beta2)
    # Rectified: factor = adaptive / (sqrt(v) + eps); else 1 / (.. / 0) = 0 and plain applies.
    factors = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_add_(factors, hp.eps)
    torch._foreach_div_(factors, adaptive)
    torch._foreach_reciprocal_(factors)
    torch._foreach_add_(factors, plain)
    torch._foreach_addcmul_(ps, exp_avgs, factors)


def adadelta_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``adadelta``: ``state[at]`` is its transformation's state."""
    st = state[at]
    if (act := _begin(params, grads, st, hp)) is None:
        return
    index, ps, gs, _, lrs = act
    square_avgs, acc_deltas = _pick(st.square_avg, index), _pick(st.acc_delta, index)
    _average_square_(square_avgs, gs, hp.rho)
    std = list(torch._foreach_add(square_avgs, hp.eps))
    torch._foreach_sqrt_(std)
    deltas = list(torch._foreach_add(acc_deltas, hp.eps))
    torch._foreach_sqrt_(deltas)
    torch._foreach_div_(deltas, std)
    torch._foreach_mul_(deltas, gs)
    _average_square_(acc_deltas, deltas, hp.rho)
    _add_scaled_(ps, deltas, [-lr for lr in lrs])


def rprop_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``rprop``: ``state[at]`` is scale_by_rprop's state."""
    st = state[at]
    index, ps, gs = _active(params, grads)
    if not index:
        return
    torch._foreach_add_(_pick(st.count, index), 1.0)
    prevs, sizes = _pick(st.prev, index), _pick(st.step_size, index)
    signs = list(torch._foreach_mul(gs, prevs))
    torch._foreach_copy_(prevs, gs)
    if hp.maximize:
        torch._foreach_neg_(signs)
        torch._foreach_neg_(prevs)
    torch._foreach_sign_(signs)
    eta_minus, eta_plus = hp.etas
    factors = [
        torch.where(s > 0, eta_plus, torch.where(s < 0, eta_minus, torch.ones_like(s)))
        for s in signs
    ]
    torch._foreach_mul_(sizes, factors)
    torch._foreach_clamp_min_(sizes, hp.step_sizes[0])
    torch._foreach_clamp_max_(sizes, hp.step_sizes[1])
    for prev, s in zip(prevs, signs):
        prev.masked_fill_(s < 0, 0.0)  # no step where the gradient changed sign
    torch._foreach_addcmul_(ps, torch._foreach_sign(prevs), sizes, value=-1)


def _asgd_etas(hp: Any, lrs: list[float], counts: Tensors) -> list[torch.Tensor]:
    """torch's foreach ``eta = lr / (1 + lambd * lr * t) ** alpha``: tensor arithmetic on each
    advanced count (float32), with the lr a Python float, or the 0-d tensor itself."""
    etas = []
    for lr, t in zip(lrs, counts):
        lr_t: float | torch.Tensor = hp.lr if isinstance(hp.lr, torch.Tensor) else lr
        etas.append(lr_t / ((1 + hp.lambd * lr_t * t) ** hp.alpha))
    return etas


def asgd_(
    params: Tensors, grads: list[torch.Tensor | None], state: Any, *, hp: Any, at: int
) -> None:
    """The piece rule of ``asgd``: ``state[at]`` is its transformation's state.

    torch's foreach ASGD folds the decay into one ``addcmul``: ``p -= eta * (g + lambd * p)``,
    and computes the next ``eta`` in float32 on the counts (its single-tensor path, which the pure
    rule follows, in double precision): both within float32 rounding of the pure path.
    """
    st = state[at]
    if (act := _begin(params, grads, st, hp)) is None:
        return
    index, ps, gs, steps, lrs = act
    if decays(hp.weight_decay):  # gs are new tensors (the decayed gradients)
        torch._foreach_add_(gs, ps, alpha=hp.lambd)
        decayed = gs
    else:
        decayed = list(torch._foreach_add(gs, ps, alpha=hp.lambd))
    etas, mus, axs = _pick(st.eta, index), _pick(st.mu, index), _pick(st.ax, index)
    torch._foreach_addcmul_(ps, decayed, etas, value=-1)
    torch._foreach_addcmul_(axs, torch._foreach_sub(ps, axs), mus)
    torch._foreach_copy_(etas, _asgd_etas(hp, lrs, _pick(st.count, index)))
    mu_values = [1 / max(1.0, s - hp.t0) for s in steps]
    torch._foreach_copy_(mus, [torch.tensor(v, device=m.device) for v, m in zip(mu_values, mus)])
