"""Training problems for equivalence checks: a model factory, a data factory and a loss."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardopt.testing import _models

__all__ = [
    "PROBLEM_NAMES",
    "Batch",
    "Problem",
    "cross_entropy",
    "gated_batch",
    "image_batch",
    "mean_squared_error",
    "reference_problem",
    "regression_batch",
    "token_batch",
]

Batch = tuple[torch.Tensor, ...]  # inputs..., target; every tensor is split along dim 0
PROBLEM_NAMES = ("mlp", "conv", "gpt", "frozen", "mixed_dtypes", "sometimes_unused")


@dataclass(frozen=True, slots=True)
class Problem:
    """A deterministic training problem; its callables must be picklable (ranks rebuild it).

    Attributes:
        name: shown in failure messages.
        model: ``model() -> nn.Module``, the same weights on every call (seed it).
        data: ``data(step) -> Batch``, the full batch of a step (0-based), the same on every call.
            Each rank of a world of ``W`` ranks sees rows ``[r*B/W, (r+1)*B/W)`` of every tensor.
        loss: ``loss(model, batch) -> scalar``, a mean over the batch rows.
    """

    name: str
    model: Callable[[], nn.Module]
    data: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]

    def __post_init__(self) -> None:
        for field in ("model", "data", "loss"):
            if not callable(getattr(self, field)):
                raise TypeError(
                    f"Problem: expected {field} to be callable, got {getattr(self, field)!r}"
                )


def mean_squared_error(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``mse_loss(model(*inputs), target)`` for ``batch = (*inputs, target)``."""
    *inputs, target = batch
    return F.mse_loss(model(*inputs), target)


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy of ``model(*inputs)`` logits (last dim = classes) against ``target``."""
    *inputs, target = batch
    logits = model(*inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def regression_batch(
    step: int,
    *,
    seed: int = 0,
    batch_size: int = 12,
    features: tuple[int, int] = (8, 4),
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """``(x, y)`` of shapes ``(batch_size, features[0])`` and ``(batch_size, features[1])``.

    Example:
        >>> [t.shape for t in regression_batch(0)]
        [torch.Size([12, 8]), torch.Size([12, 4])]
    """
    gen = _generator(seed, step)
    x = torch.randn(batch_size, features[0], generator=gen, dtype=torch.float64)
    y = torch.randn(batch_size, features[1], generator=gen, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def image_batch(
    step: int,
    *,
    seed: int = 0,
    batch_size: int = 12,
    shape: tuple[int, int, int] = (3, 8, 8),
    classes: int = 10,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """``(images, labels)``: ``(batch_size, *shape)`` images and int64 labels."""
    gen = _generator(seed, step)
    images = torch.randn(batch_size, *shape, generator=gen, dtype=torch.float64).to(dtype)
    return images, torch.randint(classes, (batch_size,), generator=gen)


def token_batch(
    step: int, *, seed: int = 0, batch_size: int = 12, length: int = 8, vocab: int = 1024
) -> Batch:
    """``(tokens, next_tokens)``: int64 ``(batch_size, length)`` sequences, shifted by one."""
    gen = _generator(seed, step)
    sequence = torch.randint(vocab, (batch_size, length + 1), generator=gen)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def gated_batch(
    step: int, *, seed: int = 0, batch_size: int = 12, dtype: torch.dtype = torch.float32
) -> Batch:
    """``(x, gate, y)`` for ``build_gated_mlp``: the gate is on in odd steps only.

    Example:
        >>> [gated_batch(step)[1][0].item() for step in range(3)]
        [0.0, 1.0, 0.0]
    """
    x, y = regression_batch(step, seed=seed, batch_size=batch_size, dtype=dtype)
    gate = torch.full((batch_size,), float(step % 2), dtype=dtype)
    return x, gate, y


def reference_problem(
    name: str, *, seed: int = 0, batch_size: int = 12, dtype: torch.dtype = torch.float64
) -> Problem:
    """One of the reference problems in ``PROBLEM_NAMES``.

    ``"mlp"`` (regression), ``"conv"`` (images), ``"gpt"`` (next token, large tied embedding),
    ``"frozen"`` (first layer frozen), ``"mixed_dtypes"`` (a bfloat16 layer among float32 ones,
    ``dtype`` ignored), ``"sometimes_unused"`` (a layer without gradient in even steps).
    The default batch of 12 rows splits evenly over 1, 2, 3, 4 and 6 ranks. The default dtype is
    float64: see [Note: float64 problems].

    Raises:
        ValueError: an unknown name.

    Example:
        >>> problem = reference_problem("mlp")
        >>> problem.loss(problem.model(), problem.data(0)).shape
        torch.Size([])
    """
    # [Note: float64 problems] Adam-like updates g/(|g|+eps) are ill-conditioned where a gradient
    # is near zero (sensitivity ~lr/eps), and a gradient that is a sum of nearly cancelling
    # per-rank parts is only known to a few ulps of those parts. A candidate that averages over
    # W > 2 ranks in another order than the reference can so differ by ~1e-5 relative in
    # float32, which is a float32 fact, not a bug. In float64 the same effect is ~1e-13, under the
    # 1e-12 default, while a wrong optimizer is off by far more: so problems default to float64,
    # and float32 (or bfloat16) checks are for what is specific to those dtypes.
    data = functools.partial(regression_batch, seed=seed, batch_size=batch_size, dtype=dtype)
    if name == "mlp":
        model = functools.partial(_models.build_mlp, seed, dtype=dtype)
        return Problem(name, model, data, mean_squared_error)
    if name == "frozen":
        model = functools.partial(_models.build_frozen_mlp, seed, dtype=dtype)
        return Problem(name, model, data, mean_squared_error)
    if name == "mixed_dtypes":
        model = functools.partial(_models.build_mixed_dtype_mlp, seed)
        data = functools.partial(regression_batch, seed=seed, batch_size=batch_size)
        return Problem(name, model, data, mean_squared_error)
    if name == "sometimes_unused":
        model = functools.partial(_models.build_gated_mlp, seed, dtype=dtype)
        data = functools.partial(gated_batch, seed=seed, batch_size=batch_size, dtype=dtype)
        return Problem(name, model, data, mean_squared_error)
    if name == "conv":
        model = functools.partial(_models.build_conv_net, seed, dtype=dtype)
        data = functools.partial(image_batch, seed=seed, batch_size=batch_size, dtype=dtype)
        return Problem(name, model, data, cross_entropy)
    if name == "gpt":
        model = functools.partial(_models.build_gpt, seed, dtype=dtype)
        data = functools.partial(token_batch, seed=seed, batch_size=batch_size)
        return Problem(name, model, data, cross_entropy)
    raise ValueError(f"reference_problem: expected a name in {PROBLEM_NAMES}, got {name!r}")
