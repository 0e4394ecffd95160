"""Scalar arithmetic shared by the optimizers: learning rates, their schedules, torch's rounding."""

from __future__ import annotations

import torch

from shardopt.core._schedules import ScalarOrSchedule, resolve

__all__ = [
    "cast_like",
    "divide_learning_rate",
    "is_zero",
    "learning_rate_at",
    "python_float_pow_half",
]


def is_zero(value: float | torch.Tensor) -> bool:
    """True for a float equal to 0; a tensor counts as non-zero (its value is not read)."""
    return not isinstance(value, torch.Tensor) and value == 0


def cast_like(value: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A scalar tensor in ``like``'s dtype, as torch casts a Python scalar operand.

    Needed because two 0-d tensors promote to the wider dtype: a float64 step size would turn a
    0-d float32 parameter's update into float64 arithmetic.
    """
    return value.to(like.dtype) if isinstance(value, torch.Tensor) else value


def learning_rate_at(
    learning_rate: ScalarOrSchedule, counts: tuple[torch.Tensor, ...]
) -> float | torch.Tensor:
    """A schedule's value at ``counts[0]`` (the parameter's count), or the float or tensor lr."""
    if callable(learning_rate):
        return resolve(learning_rate, counts[0])
    return learning_rate


def python_float_pow_half(x: torch.Tensor) -> torch.Tensor:
    """``x ** 0.5`` for a float64 ``x`` standing for a Python float: C ``pow``, not ``sqrt``.

    [Note: scalar arithmetic of the count]
    torch turns the step into a Python float and computes ``1 - beta ** step``, ``lr / bc1`` and
    ``bc2 ** 0.5`` in double precision; we compute them as float64 0-d tensors so they trace under
    ``torch.func``. ``pow``, ``-`` and ``/`` round the same way, with two traps: ``float ** 0.5``
    calls C ``pow``, which differs from ``sqrt`` in the last bit for some inputs, while a tensor
    ``** 0.5`` is lowered to ``sqrt`` (a tensor exponent keeps ``pow``); and ``float / tensor``
    is ``reciprocal(tensor) * float`` in torch, which rounds twice. Where torch itself computes
    with tensors (a tensor lr or tensor betas) we use its very expressions.
    """
    return x ** torch.full_like(x, 0.5)


def divide_learning_rate(lr: float | torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """torch's ``lr / by`` for a Python-float ``by`` held in float64: in double precision for a
    float ``lr``, in ``lr``'s dtype for a tensor ``lr`` (``tensor / float``)."""
    if isinstance(lr, torch.Tensor):
        return lr / by.to(lr.dtype)
    return torch.full_like(by, lr) / by
