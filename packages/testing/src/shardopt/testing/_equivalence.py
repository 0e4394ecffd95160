"""assert_matches_torch: a candidate optimizer on W ranks against torch.optim in one process."""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardopt.testing._candidates import CandidateFactory
from shardopt.testing._compare import Mismatch, Tolerance, compare_state_dicts, compare_tensors
from shardopt.testing._problems import Batch, Problem
from shardopt.testing._spawn import spawn
from shardopt.testing._world import current_world

__all__ = ["EquivalenceReport", "ReferenceGrads", "assert_matches_torch"]

# Mismatching tensors listed per rank in a failure message (the count of the rest is given).
_LISTED_PER_RANK = 3


class ReferenceGrads(str, enum.Enum):
    """The gradient the single-process reference steps with.

    SHARD_MEAN: the mean of the W shards' gradients, summed in rank order (what data-parallel
    training computes). FULL_BATCH: the gradient of the loss on the full batch; equal in exact
    arithmetic (the shards are equal and the loss is a mean), a few ulps off in floating point.
    """

    SHARD_MEAN = "shard_mean"
    FULL_BATCH = "full_batch"


@dataclass(frozen=True, slots=True)
class EquivalenceReport:
    """A passed check: how close the candidate stayed to torch.optim over all ranks and steps."""

    world_size: int
    steps: int
    backend: str
    max_abs_error: float
    max_rel_error: float


@dataclass(frozen=True, slots=True)
class _Spec:
    candidate: CandidateFactory
    reference: type[torch.optim.Optimizer]
    reference_kwargs: dict[str, Any]
    problem: Problem
    steps: int
    compare_state: bool
    tolerance: Tolerance
    reference_grads: ReferenceGrads


@dataclass
class _RankResult:
    rank: int
    backend: str = ""
    first_step: int | None = None  # the step of the first mismatch, if any
    mismatches: list[Mismatch] = field(default_factory=list)  # all of them, at first_step
    max_abs: float = 0.0
    max_rel: float = 0.0


def assert_matches_torch(
    candidate: CandidateFactory,
    reference: type[torch.optim.Optimizer],
    reference_kwargs: Mapping[str, Any] | None = None,
    *,
    problem: Problem,
    world_size: int,
    steps: int = 3,
    compare_state: bool = False,
    exact: bool = False,
    rtol: float | Mapping[torch.dtype, float] | None = None,
    reference_grads: str | ReferenceGrads = ReferenceGrads.SHARD_MEAN,
    backend: str = "auto",
    timeout: float = 120.0,
) -> EquivalenceReport:
    """Checks that ``candidate`` on ``world_size`` ranks trains like ``reference`` in one process.

    Every rank builds the model twice from ``problem.model`` (the same initial weights): the
    candidate's copy, stepped by ``candidate(model, world)`` after backward on the rank's shard
    of ``problem.data(step)`` (LOCAL gradients, see [Note: candidates see local gradients]); and
    a reference copy stepped by plain ``reference(params, **reference_kwargs)`` with the
    gradient of the whole batch (``reference_grads``), computed in that process alone. After
    every step each rank compares every parameter (and with ``compare_state`` the
    consolidated optimizer state) of its candidate copy with the reference.

    Adam-like optimizers hardly see a gradient's scale: check gradient averaging with SGD.
    ``exact=True`` holds for the same operations in the same order, e.g. any W=1 candidate,
    or an all-reduce candidate at W=2 with ``reference_grads="shard_mean"`` (a sum of two is
    exact in either order); for W>2 the all-reduce order differs from the rank-order sum, and
    low-precision parameters (the ``mixed_dtypes`` problem) then differ by their own ulps,
    which spread to every parameter: compare those at W <= 2 or with a bfloat16 ``rtol``
    (see [Note: float64 problems]).

    Args:
        candidate: picklable ``(model, world) -> Candidate`` (see ``Candidate``), e.g.
            ``zero_redundancy_candidate(torch.optim.Adam, lr=1e-2)``.
        reference: a ``torch.optim.Optimizer`` subclass.
        reference_kwargs: its hyperparameters.
        problem: model, data and loss, e.g. ``reference_problem("mlp")``.
        world_size: ranks of the candidate; must divide the batch size.
        steps: optimizer steps.
        compare_state: also compare ``consolidated_state_dict()`` after every step.
        exact: bitwise equality instead of tolerances.
        rtol: a relative error bound for all dtypes, or per dtype (defaults: ``DEFAULT_RTOL``).
        reference_grads: ``"shard_mean"`` or ``"full_batch"`` (see ``ReferenceGrads``).
        backend, timeout: as for ``spawn``.

    Returns:
        An EquivalenceReport with the largest errors seen.

    Raises:
        AssertionError: the first step where the candidate differs, with the parameter (or
            state entry), the ranks, the max absolute and relative errors and the worst element.
        RankError: a rank raised (in the candidate, say).

    Example:
        >>> from shardopt.testing import reference_problem, zero_redundancy_candidate
        >>> report = assert_matches_torch(
        ...     zero_redundancy_candidate(torch.optim.Adam, lr=1e-2),
        ...     torch.optim.Adam,
        ...     {"lr": 1e-2},
        ...     problem=reference_problem("mlp"),
        ...     world_size=2,
        ... )
        >>> report.max_rel_error < 1e-6
        True
    """
    spec = _make_spec(
        candidate, reference, reference_kwargs, problem, steps, compare_state, exact, rtol,
        reference_grads,
    )  # fmt: skip
    _check_world_size(problem, world_size)
    results: list[_RankResult] = spawn(
        _train_and_compare, world_size, spec, backend=backend, timeout=timeout
    )
    failed = [r for r in results if r.first_step is not None]
    if failed:
        raise AssertionError(_failure_message(spec, results, world_size))
    return EquivalenceReport(
        world_size=world_size,
        steps=steps,
        backend=results[0].backend,
        max_abs_error=max(r.max_abs for r in results),
        max_rel_error=max(r.max_rel for r in results),
    )


def _make_spec(
    candidate: Any,
    reference: Any,
    reference_kwargs: Mapping[str, Any] | None,
    problem: Any,
    steps: Any,
    compare_state: bool,
    exact: bool,
    rtol: Any,
    reference_grads: Any,
) -> _Spec:
    api = "assert_matches_torch"
    if not callable(candidate):
        raise TypeError(f"{api}: expected candidate to be a callable factory, got {candidate!r}")
    if not (inspect.isclass(reference) and issubclass(reference, torch.optim.Optimizer)):
        raise TypeError(f"{api}: expected reference to be a torch.optim class, got {reference!r}")
    if not isinstance(problem, Problem):
        raise TypeError(f"{api}: expected problem to be a Problem, got {problem!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{api}: expected an int steps >= 1, got {steps!r}")
    try:
        grads = ReferenceGrads(reference_grads)
    except ValueError:
        raise ValueError(
            f"{api}: expected reference_grads in ('shard_mean', 'full_batch'), "
            f"got {reference_grads!r}"
        ) from None
    if isinstance(rtol, (int, float)) and not isinstance(rtol, bool):
        if not (rtol >= 0 and math.isfinite(rtol)):
            raise ValueError(f"{api}: expected rtol >= 0, got {rtol!r}")
        floats = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        rtol = dict.fromkeys(floats, float(rtol))
    elif rtol is not None and not isinstance(rtol, Mapping):
        raise TypeError(f"{api}: expected rtol to be a float or a dtype mapping, got {rtol!r}")
    tolerance = Tolerance(exact=bool(exact), rtol=dict(rtol or {}))
    return _Spec(
        candidate, reference, dict(reference_kwargs or {}), problem, steps, compare_state,
        tolerance, grads,
    )  # fmt: skip


def _check_world_size(problem: Problem, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"assert_matches_torch: expected an int world_size >= 1, got {world_size!r}"
        )
    batch = problem.data(0)
    if not isinstance(batch, tuple) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(
            f"assert_matches_torch: expected problem {problem.name!r} data to be a tuple of "
            f"tensors, got {type(batch).__name__}"
        )
    rows = {t.shape[0] if t.dim() else -1 for t in batch}
    if len(rows) != 1 or min(rows) < 1 or min(rows) % world_size:
        raise ValueError(
            f"assert_matches_torch: expected every tensor in the batch of problem "
            f"{problem.name!r} to have a leading dim divisible by world_size={world_size}, got "
            f"leading dims "
            f"{[tuple(t.shape[:1]) for t in batch]}"
        )


def _train_and_compare(rank: int, world_size: int, spec: _Spec) -> _RankResult:
    """One rank: trains the candidate and the reference side by side, comparing every step."""
    world = current_world()
    _configure_numerics(world.device)
    model = spec.problem.model().to(world.device)
    reference_model = spec.problem.model().to(world.device)
    names = [name for name, _ in model.named_parameters()]
    _check_deterministic(spec.problem, model, reference_model)
    candidate = spec.candidate(model, world)
    reference = spec.reference(reference_model.parameters(), **spec.reference_kwargs)
    result = _RankResult(rank=rank, backend=world.backend.value)
    for step in range(1, spec.steps + 1):
        batch = tuple(t.to(world.device) for t in spec.problem.data(step - 1))
        shards = list(zip(*(t.tensor_split(world_size) for t in batch)))
        _candidate_step(candidate, model, spec.problem, shards[rank])
        _reference_step(reference, reference_model, spec, batch, shards)
        found = _compare_parameters(model, reference_model, spec.tolerance, step, rank, result)
        if spec.compare_state:
            state = _consolidated_state(candidate)  # a collective: every rank calls it
            if state is not None:
                found += compare_state_dicts(
                    state, reference.state_dict(), names, spec.tolerance, step=step, rank=rank
                )
        if found and result.first_step is None:
            result.first_step, result.mismatches = step, found
    return result


def _configure_numerics(device: torch.device) -> None:
    if device.type == "cuda":  # no TF32 shortcuts, deterministic kernels where torch has them
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _check_deterministic(problem: Problem, model: nn.Module, other: nn.Module) -> None:
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        if not torch.equal(a, b):
            raise ValueError(
                f"assert_matches_torch: problem {problem.name!r} builds different weights on "
                f"each call (parameter {name!r}); seed the model factory"
            )


def _candidate_step(candidate: Any, model: nn.Module, problem: Problem, shard: Batch) -> None:
    zero_grad = getattr(candidate, "zero_grad", None)
    if zero_grad is not None:
        zero_grad()
    for param in model.parameters():
        param.grad = None
    problem.loss(model, shard).backward()
    candidate.step()


def _reference_step(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    spec: _Spec,
    batch: Batch,
    shards: list[Batch],
) -> None:
    optimizer.zero_grad(set_to_none=True)
    if spec.reference_grads is ReferenceGrads.FULL_BATCH:
        spec.problem.loss(model, batch).backward()
    else:
        for shard in shards:  # autograd accumulates: ((g0 + g1) + g2) + ...
            spec.problem.loss(model, shard).backward()
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(len(shards))
    optimizer.step()


def _compare_parameters(
    model: nn.Module,
    reference: nn.Module,
    tolerance: Tolerance,
    step: int,
    rank: int,
    result: _RankResult,
) -> list[Mismatch]:
    found = []
    for (name, cand), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        error = compare_tensors(cand, ref, tolerance.for_dtype(ref.dtype))
        result.max_abs = max(result.max_abs, error.max_abs)
        result.max_rel = max(result.max_rel, error.max_rel)
        if not error.ok:
            what = f"parameter {name!r}"
            found.append(Mismatch(step, rank, what, error.detail, error.max_abs, error.max_rel))
    return found


def _consolidated_state(candidate: Any) -> Any:
    for method in ("consolidated_state_dict", "state_dict"):
        get_state = getattr(candidate, method, None)
        if get_state is not None:
            return get_state()
    raise TypeError(
        "assert_matches_torch: compare_state=True needs the candidate to have "
        f"consolidated_state_dict() or state_dict(); {type(candidate).__name__} has neither"
    )


def _failure_message(spec: _Spec, results: list[_RankResult], world_size: int) -> str:
    first = min(r.first_step for r in results if r.first_step is not None)
    reference = _describe_reference(spec)
    lines = [
        f"assert_matches_torch: the candidate differs from {reference} after step {first} of "
        f"{spec.steps} (problem {spec.problem.name!r}, world_size={world_size}, backend "
        f"{results[0].backend}, reference grads {spec.reference_grads.value}, "
        f"tolerance {spec.tolerance.describe()})."
    ]
    by_description: dict[str, list[int]] = {}
    for r in results:
        if r.first_step != first:
            continue
        for mismatch in r.mismatches[:_LISTED_PER_RANK]:
            by_description.setdefault(mismatch.describe(), []).append(r.rank)
        more = len(r.mismatches) - _LISTED_PER_RANK
        if more > 0:
            by_description.setdefault(f"and {more} more mismatching entries", []).append(r.rank)
    for description, ranks in by_description.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"  {label} {', '.join(map(str, ranks))}: {description}")
    clean = [r.rank for r in results if r.first_step is None or r.first_step > first]
    if clean:
        lines.append(f"  ranks matching at this step: {clean}")
    return "\n".join(lines)


def _describe_reference(spec: _Spec) -> str:
    cls = spec.reference
    module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    kwargs = ", ".join(f"{k}={v!r}" for k, v in spec.reference_kwargs.items())
    return f"{module}.{cls.__qualname__}({kwargs})"
