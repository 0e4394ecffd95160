"""Schedules: pure functions of the step count, and scalar-or-schedule resolution."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Schedule",
    "ScalarOrSchedule",
    "constant",
    "cosine_decay",
    "join_schedules",
    "linear_warmup",
    "resolve",
    "warmup_cosine_decay",
]

Schedule = Callable[[torch.Tensor], float | torch.Tensor]
ScalarOrSchedule = float | torch.Tensor | Schedule

# [Note: schedule counts]
# A schedule is called with the number of updates already applied to the parameter (0 for the
# first update), a float32 0-d tensor. That is the learning rate a torch.optim.lr_scheduler
# would have set before the same optimizer.step(). Schedules use only tensor arithmetic (no
# .item(), no Python branching on the count) so they trace under torch.func.grad and vmap.


def resolve(value: ScalarOrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    """Returns ``value(count)`` for a schedule and ``value`` for a float or a tensor.

    Example:
        >>> import torch
        >>> resolve(0.1, torch.tensor(3.0)), resolve(lambda c: c * 2, torch.tensor(3.0))
        (0.1, tensor(6.))
    """
    return value(count) if callable(value) else value


def constant(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Example:
        >>> constant(0.5)(torch.tensor(10.0))
        0.5
    """

    def schedule(count: torch.Tensor) -> float:
        del count
        return value

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, *, init_value: float = 0.0) -> Schedule:
    """Goes linearly from ``init_value`` to ``peak_value`` over ``warmup_steps``, then stays.

    Example:
        >>> linear_warmup(1.0, 4)(torch.tensor(1.0))
        tensor(0.2500, dtype=torch.float64)
    """
    if warmup_steps <= 0:
        raise ValueError(f"linear_warmup: expected warmup_steps > 0, got {warmup_steps}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        frac = (count.to(torch.float64) / warmup_steps).clamp(0.0, 1.0)
        return init_value + frac * (peak_value - init_value)

    return schedule


def cosine_decay(init_value: float, decay_steps: int, *, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Example:
        >>> cosine_decay(1.0, 10)(torch.tensor(5.0))
        tensor(0.5000, dtype=torch.float64)
    """
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay: expected decay_steps > 0, got {decay_steps}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        frac = count.to(torch.float64).clamp(0.0, decay_steps) / decay_steps
        cosine = 0.5 * (1.0 + torch.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Runs ``schedules[i]`` from ``boundaries[i-1]`` on, each seeing the count since its start.

    Example:
        >>> s = join_schedules([constant(1.0), cosine_decay(1.0, 10)], [5])
        >>> float(s(torch.tensor(4.0))), float(s(torch.tensor(10.0)))
        (1.0, 0.5)
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            "join_schedules: expected len(schedules) == len(boundaries) + 1, got "
            f"{len(schedules)} schedules and {len(boundaries)} boundaries"
        )
    if any(b <= a for a, b in itertools.pairwise(boundaries)) or any(b < 0 for b in boundaries):
        raise ValueError(
            f"join_schedules: expected increasing non-negative boundaries, got {list(boundaries)}"
        )

    def schedule(count: torch.Tensor) -> torch.Tensor:
        count64 = count.to(torch.float64)
        value = torch.as_tensor(schedules[0](count64), dtype=torch.float64)
        for start, sched in zip(boundaries, schedules[1:]):
            later = torch.as_tensor(sched(count64 - start), dtype=torch.float64)
            value = torch.where(count64 >= start, later, value)
        return value

    return schedule


def warmup_cosine_decay(
    peak_value: float, warmup_steps: int, decay_steps: int, *, alpha: float = 0.0
) -> Schedule:
    """Linear warm-up to ``peak_value`` then cosine decay over the remaining steps.

    Example:
        >>> s = warmup_cosine_decay(1.0, 2, 12)
        >>> float(s(torch.tensor(1.0))), float(s(torch.tensor(2.0)))
        (0.5, 1.0)
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            "warmup_cosine_decay: expected decay_steps > warmup_steps, got "
            f"{decay_steps} and {warmup_steps}"
        )
    warmup = linear_warmup(peak_value, warmup_steps)
    decay = cosine_decay(peak_value, decay_steps - warmup_steps, alpha=alpha)
    return join_schedules([warmup, decay], [warmup_steps])
