"""Item b: every core optimizer through shard's flat fused path against torch.optim, in float32
and in bfloat16 with float32 master weights."""

from __future__ import annotations

from typing import Any

import torch

from shardopt.devtools.gpu_check._report import Item, Status, failed_item
from shardopt.devtools.gpu_check._variants import max_rel_error, rel_error

__all__ = ["KWARGS", "TOLERANCE", "check_optimizer", "check_optimizers", "tolerance"]

STEPS = 10
SHAPES = ((64, 48), (48,), (256, 33), (1000,))
MATRICES = ((64, 48), (33, 256), (128, 128))  # Muon takes matrices only
KWARGS: dict[str, dict[str, Any]] = {  # torch's defaults, except where they would do nothing
    "SGD": {"lr": 0.01, "momentum": 0.9},
    "Adam": {"lr": 1e-3},
    "AdamW": {"lr": 1e-3},
    "Muon": {"lr": 0.02},
}

# [Note: optimizer tolerances]
# Relative to each tensor's largest magnitude, worst over tensors, after 10 steps. shardopt's piece
# fast path runs torch's fused kernels (Adam, AdamW, SGD, Adagrad) or core's pure rule, torch.optim
# on CUDA its foreach kernels by default: the same formula in another order of operations (and FMA
# contractions), a few float32 roundings (~1e-7 relative) a step apart. 1e-5 leaves a 10x margin
# over 10 steps, while a wrong rule (bias correction, weight decay, eps placement) is off by 1e-4 or
# more at these learning rates. Muon's Newton–Schulz iteration runs in bfloat16 in both
# (torch.optim.Muon casts to bfloat16): one bfloat16 rounding (2**-8) of an orthogonalised entry
# moves a parameter by lr * 2**-8 * |entry|, so Muon gets 1e-3. bfloat16 parameters with float32
# masters: the masters are held to the float32 tolerance against torch.optim on float32 copies (the
# same bfloat16-valued gradients), and the bfloat16 parameters, which are the masters rounded, to
# one bfloat16 rounding, 2**-8.
TOLERANCE = {"float32": 1e-5, "Muon": 1e-3, "bfloat16 params": 2.0**-8}


def tolerance(name: str) -> float:
    """The float32 (and master-weight) tolerance of optimizer ``name``.

    Example:
        >>> tolerance("Muon"), tolerance("AdamW")
        (0.001, 1e-05)
    """
    return TOLERANCE.get(name, TOLERANCE["float32"])


def _params(shapes: Any, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(0.5 * torch.randn(s, generator=gen)).to(dtype).to(device) for s in shapes]


def _grads(shapes: Any, step: int, dtype: torch.dtype, device: torch.device) -> list[Any]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes]


def _master_error(state: Any, ref: list[torch.Tensor]) -> float:
    """Worst relative error of the float32 master pieces against the reference's elements."""
    errors = [
        rel_error(
            m[p.offset : p.offset + p.numel], ref[p.tensor].detach().view(-1)[p.start : p.stop]
        )
        for p in state.param_buffers.pieces
        if (m := state.master.full(p.group)) is not None
    ]
    return max(errors, default=float("nan"))


def check_optimizer(cls: type, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Steps ``cls``'s core form through ``shard`` (W of the default group must be 1) beside
    ``cls`` itself on float32 copies; returns the figures."""
    from shardopt.core import plan_partition
    from shardopt.core.blocks import needs_whole_tensors, torch_compat
    from shardopt.functional import shard

    kwargs = KWARGS.get(cls.__name__, {})
    record = torch_compat(cls)
    if record is None:
        raise ValueError(f"{cls.__name__} has no shardopt.core form")
    tx = record.factory(**kwargs)  # the same hyperparameter names as torch's
    shapes = MATRICES if cls.__name__ == "Muon" else SHAPES
    params = _params(shapes, dtype, device)
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = cls(ref, **kwargs)
    strategy = "greedy" if needs_whole_tensors(tx) else "flat"
    master = torch.float32 if dtype != torch.float32 else None
    sharded = shard(tx, plan_partition(params, 1, strategy=strategy), master_dtype=master)
    state = sharded.init(params)
    for step in range(STEPS):
        grads = _grads(shapes, step, dtype, device)
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        state = sharded.step(params, grads, state)
    figures = {"plan": strategy, "steps": STEPS, "param_rel_error": max_rel_error(params, ref)}
    if master is not None:
        figures["master_rel_error"] = _master_error(state, ref)
    return figures


def _judge(name: str, dtype: torch.dtype, figures: dict[str, Any]) -> Item:
    tol = tolerance(name)
    label = f"b/{name}/{str(dtype).removeprefix('torch.')}"
    if dtype == torch.float32:
        worst, limits = figures["param_rel_error"], [("param_rel_error", tol)]
    else:
        worst = figures["master_rel_error"]
        limits = [("master_rel_error", tol), ("param_rel_error", TOLERANCE["bfloat16 params"])]
    figures = {"worst_rel_error": worst, **figures, "tolerance": tol}
    over = [f"{k} {figures[k]:.3g} > {t:.3g}" for k, t in limits if not figures[k] <= t]
    if over:
        return Item(label, Status.FAIL, "; ".join(over), figures)
    within = ", ".join(f"{k} <= {t:.3g}" for k, t in limits)
    return Item(label, Status.PASS, "within " + within, figures)


def check_optimizers(device: torch.device) -> list[Item]:
    """Item b over every torch.optim class with a core form, float32 and bfloat16 + masters."""
    from shardopt.core.blocks import TORCH_COMPAT

    items = []
    for record in TORCH_COMPAT:
        name = record.torch_class.__name__
        for dtype in (torch.float32, torch.bfloat16):
            try:
                figures = check_optimizer(record.torch_class, dtype, device)
                items.append(_judge(name, dtype, figures))
            except Exception as exc:
                items.append(failed_item(f"b/{name}/{str(dtype).removeprefix('torch.')}", exc))
    return items
