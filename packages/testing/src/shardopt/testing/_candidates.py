"""Candidates for equivalence checks: the protocol and adapters for torch's own optimizers."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from shardopt.testing._world import World

__all__ = [
    "Candidate",
    "CandidateFactory",
    "average_gradients",
    "torch_optimizer_candidate",
    "with_gradient_averaging",
    "zero_redundancy_candidate",
]

# [Note: candidates see local gradients]
# The harness runs backward on each rank's shard and calls candidate.step(): the gradients
# in `param.grad` are the rank's LOCAL ones. A candidate that reduces gradients itself (a
# ZeRO-2 optimizer reduce-scatters them) is tested as it is; one that expects averaged
# gradients, as torch.optim and ZeroRedundancyOptimizer do behind DDP, is wrapped by
# `with_gradient_averaging`, which all-reduces them to the mean first.


@runtime_checkable
class Candidate(Protocol):
    """What a candidate factory returns; only ``step`` is required.

    Optional methods, used when present: ``zero_grad()`` (called before each backward) and
    ``consolidated_state_dict() -> dict | None``, a collective called on every rank that returns
    the full optimizer state in ``torch.optim`` ``state_dict()`` format (parameter index =
    position in ``model.parameters()``) on at least one rank, None on the others; without it,
    ``state_dict()`` is used.
    """

    def step(self) -> Any:
        """Updates the model's parameters from the local gradients of this step."""
        ...


CandidateFactory = Callable[[nn.Module, World], Candidate]


def average_gradients(parameters: Iterable[torch.Tensor], world: World) -> None:
    """All-reduces every ``param.grad`` in place to its mean over the ranks.

    A parameter must have a gradient on all ranks or on none (then it is left None); the check
    costs one small all-reduce.

    Raises:
        RuntimeError: a parameter has a gradient on some ranks only.
    """
    params = list(parameters)
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
    counts = has_grad.to(world.device)
    dist.all_reduce(counts, group=world.process_group)
    uneven = [i for i, n in enumerate(counts.tolist()) if 0 < n < world.world_size]
    if uneven:
        raise RuntimeError(
            "average_gradients: expected each parameter to have a gradient on all ranks or on "
            f"none, but parameters at positions {uneven} have one on some ranks only"
        )
    # One all-reduce per dtype over the concatenated gradients rather than one per parameter:
    # the sums are the same (exactly so for 2 ranks), the collectives far fewer.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=world.process_group)
        flat.div_(world.world_size)
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(averaged.view_as(grad))


class _Averaging:
    """Averages the model's gradients over the ranks, then steps the wrapped optimizer."""

    def __init__(self, inner: Any, model: nn.Module, world: World) -> None:
        self.inner = inner
        self._model = model
        self._world = world

    def step(self) -> None:
        average_gradients(self._model.parameters(), self._world)
        self.inner.step()

    def zero_grad(self) -> None:
        zero_grad = getattr(self.inner, "zero_grad", None)
        if zero_grad is not None:
            zero_grad()

    def consolidated_state_dict(self) -> dict[str, Any] | None:
        consolidate = getattr(self.inner, "consolidated_state_dict", None)
        return consolidate() if consolidate is not None else self.inner.state_dict()


def _build_averaging(factory: Callable[..., Any], model: nn.Module, world: World) -> _Averaging:
    return _Averaging(factory(model, world), model, world)


def with_gradient_averaging(factory: Callable[[nn.Module, World], Any]) -> CandidateFactory:
    """Adapts a factory whose optimizer expects averaged gradients (as behind DDP).

    The returned factory is picklable if ``factory`` is; its candidate all-reduces the local
    gradients to their mean before each ``step`` (see [Note: candidates see local gradients]).

    Example:
        >>> import functools
        >>> def build_sgd(model, world, lr):
        ...     return torch.optim.SGD(model.parameters(), lr=lr)
        >>> factory = with_gradient_averaging(functools.partial(build_sgd, lr=0.1))
        >>> callable(factory)
        True
    """
    return functools.partial(_build_averaging, factory)


def _build_torch_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    model: nn.Module,
    world: World,
) -> torch.optim.Optimizer:
    return optimizer_class(model.parameters(), **kwargs)


def torch_optimizer_candidate(
    optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> CandidateFactory:
    """Data-parallel ``optimizer_class(model.parameters(), **kwargs)``: DDP's all-reduce + step.

    The known-correct candidate: every rank averages the gradients and updates all parameters.

    Example:
        >>> factory = torch_optimizer_candidate(torch.optim.Adam, lr=1e-3)
        >>> callable(factory)
        True
    """
    return with_gradient_averaging(
        functools.partial(_build_torch_optimizer, optimizer_class, dict(kwargs))
    )


class _ZeroCandidate:
    """torch's ZeroRedundancyOptimizer with its state consolidated on rank 0."""

    def __init__(self, optimizer: Any, world: World) -> None:
        self.optimizer = optimizer
        self._world = world

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def consolidated_state_dict(self) -> dict[str, Any] | None:
        self.optimizer.consolidate_state_dict(to=0)
        return self.optimizer.state_dict() if self._world.rank == 0 else None


def _build_zero(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    model: nn.Module,
    world: World,
) -> _ZeroCandidate:
    optimizer = zero_redundancy_optimizer_class()(
        list(model.parameters()), optimizer_class, process_group=world.process_group, **kwargs
    )
    return _ZeroCandidate(optimizer, world)


def zero_redundancy_optimizer_class() -> type[Any]:
    """torch's ZeroRedundancyOptimizer, imported on first use.

    Importing torch.distributed.optim warns that torch.jit.script is deprecated (it scripts its
    functional optimizers): silenced here, as it is torch's, so that suites running with
    ``filterwarnings = error`` can use it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*torch\.jit\.", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


def zero_redundancy_candidate(
    optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> CandidateFactory:
    """torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded over the ranks) behind
    gradient averaging: a known-correct sharded candidate.

    Its parameters must all have one dtype (a limit of ZeroRedundancyOptimizer).

    Example:
        >>> factory = zero_redundancy_candidate(torch.optim.Adam, lr=1e-3)
        >>> callable(factory)
        True
    """
    return with_gradient_averaging(functools.partial(_build_zero, optimizer_class, dict(kwargs)))
