"""Hyperparameter checks shared by the optimizer factories: one message format for all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardopt.core._schedules import ScalarOrSchedule

__all__: list[str] = []  # private helpers of the optimizer modules


def expect(ok: Any, api: str, rule: str, value: object) -> None:
    """Raises ``ValueError: {api}: expected {rule}, got {value}`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{api}: expected {rule}, got {value}")


def check_learning_rate(api: str, lr: ScalarOrSchedule, *, schedule: bool = True) -> None:
    """A float ``>= 0``, a 0-d tensor (value not inspected: it may be traced) or a schedule."""
    if isinstance(lr, torch.Tensor):
        expect(lr.dim() == 0, api, "a 0-d tensor lr", f"shape {tuple(lr.shape)}")
        return
    if callable(lr):
        expect(schedule, api, "lr a float or a 0-d tensor (the initial step size)", "a schedule")
        return
    expect(isinstance(lr, (int, float)) and not isinstance(lr, bool), api, "a float lr", lr)
    expect(lr >= 0.0, api, "0 <= lr", lr)


def check_weight_decay(api: str, weight_decay: float | torch.Tensor) -> None:
    """A float ``>= 0`` or a 0-d tensor (value not inspected)."""
    if isinstance(weight_decay, torch.Tensor):
        shape = tuple(weight_decay.shape)
        expect(weight_decay.dim() == 0, api, "a 0-d tensor weight_decay", f"shape {shape}")
        return
    expect(weight_decay >= 0.0, api, "0 <= weight_decay", weight_decay)


def check_pair(api: str, name: str, value: Sequence[float]) -> None:
    """A sequence of two numbers."""
    expect(isinstance(value, Sequence) and len(value) == 2, api, f"{name} a pair", value)


def check_betas(api: str, betas: Sequence[float]) -> None:
    """Two coefficients in ``[0, 1)``."""
    check_pair(api, "betas", betas)
    for i, beta in enumerate(betas):
        expect(0.0 <= beta < 1.0, api, f"0 <= betas[{i}] < 1", beta)


def expect_nonnegative(api: str, name: str, value: ScalarOrSchedule) -> None:
    """Checks a float or 1-element-tensor hyperparameter is ``>= 0`` (not NaN; a schedule is not
    checked).

    A tensor must have one element. Its value is checked only when it is a plain tensor: inside
    ``torch.func`` transforms (e.g. ``vmap`` over learning rates) it cannot be read.
    """
    if callable(value):
        return
    if isinstance(value, torch.Tensor):
        expect(value.numel() == 1, api, f"{name} with 1 element", f"shape {tuple(value.shape)}")
        if torch._C._functorch.is_functorch_wrapped_tensor(value):
            return
    expect(bool(value >= 0), api, f"0 <= {name}", value)
