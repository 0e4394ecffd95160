"""Which optimizer classes ZeroRedundancyOptimizer runs, and how: known, probed, or refused."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from shardopt.optim._core_mapping import CORE_FACTORIES
from shardopt.optim.zero._backend import ZeroBackend
from shardopt.optim.zero._core_backend import CoreBackend
from shardopt.optim.zero._core_optimizer import Wire
from shardopt.optim.zero._params import API
from shardopt.optim.zero._probe import coupling, elementwise, known_base
from shardopt.optim.zero._torch_slices_backend import TorchSlicesBackend

__all__ = ["check_coupling", "flat_backend", "settings", "steps_per_bucket"]

# [Note: coupled optimizers]
# Under the greedy partition each rank's local optimizer steps only the parameters the rank
# owns. A class whose update of one parameter reads the others (a global statistic: Prodigy's and
# D-Adaptation's step-size estimates, AdamS's and Ranger21's weight decay scaled by the mean
# second moment over all parameters) or that draws random numbers (Kron: each rank draws its
# own) computes something else than it would in one process, silently, in torch's
# ZeroRedundancyOptimizer too. The constructor probes the class ([Note: optimizer probes]) with
# the hyperparameters of each param group (``settings``), and every rank raises a ValueError
# naming it and the reason; ``allow_coupled=True`` accepts it knowingly, with one UserWarning
# naming what was found. With one rank nothing is sharded and
# nothing is probed. The probe's verdicts on popular classes (pytorch-optimizer 4.1.0,
# lion-pytorch 0.2.5, schedulefree 1.4.1, default hyperparameters but lr):
# - coupled: Prodigy, DAdaptAdam, DAdaptSGD, DAdaptLion, DAdaptAdan, DAdaptAdaGrad, AdamS,
#   Ranger21, Adai; random draws: Kron.
# - per parameter, not elementwise (greedy only): Lamb, LARS, NovoGrad, AdamP, Ranger, SOAP,
#   CAME, StableAdamW, SM3, AggMo.
# - elementwise (greedy and flat): Lion (both), Adan, ADOPT, MADGRAD, AdaBelief, Yogi, AdaBound,
#   DiffGrad, Tiger, LaProp, AdEMAMix, APOLLO, QHAdam, schedulefree's AdamWScheduleFree and
#   SGDScheduleFree, pytorch-optimizer's ScheduleFreeAdamW.
# - not probeable without a closure or a Hessian (refused): SophiaH, and torch's LBFGS.
#
# [Note: stepping per bucket]
# With ``overlap_with_ddp=True`` the DDP hooks may step each DDP bucket's parameters as soon as
# the bucket is reduced, one local ``step()`` per bucket. That is one process's step only for a
# class whose update is per parameter and counts per parameter: torch.optim's SGD, Adam, AdamW,
# Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, Rprop, ASGD, SparseAdam, Muon and Adafactor
# (the classes of the shardopt.core forms among them) and their subclasses that override
# nothing (``steps_per_bucket``). Any other class counts per call somewhere (a group's
# ``step``, schedule-free's ``k`` and weight sums, lookahead's counter, MADGRAD's ``k``), so the
# hooks give it exactly one local ``step()`` per iteration, once every bucket is reduced, over
# all of this rank's parameters: the step :meth:`ZeroRedundancyOptimizer.step` takes.


def steps_per_bucket(optimizer_class: Any) -> bool:
    """Whether the DDP hooks may step ``optimizer_class`` once per bucket (see
    [Note: stepping per bucket]).

    Example:
        >>> steps_per_bucket(torch.optim.AdamW), steps_per_bucket(torch.optim.LBFGS)
        (True, False)
    """
    return known_base(optimizer_class) is not None


def _name(optimizer_class: Any) -> str:
    return getattr(optimizer_class, "__qualname__", None) or repr(optimizer_class)


def settings(
    optimizer_class: Any, defaults: dict[str, Any], param_groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The distinct hyperparameters the class is constructed with: ``defaults`` updated by each
    param group's keys that its constructor takes (what the probes run with).

    Example:
        >>> groups = [{"params": [], "lr": 0.1}, {"params": [], "lr": 0.1, "initial_lr": 1}]
        >>> settings(torch.optim.SGD, {"lr": 0.1}, groups)
        [{'lr': 0.1}]
    """
    try:
        taken = set(inspect.signature(optimizer_class.__init__).parameters) - {"self", "params"}
    except (TypeError, ValueError):
        taken = set()
    out: dict[str, dict[str, Any]] = {}
    for group in param_groups:
        kwargs = {**defaults, **{k: v for k, v in group.items() if k in taken}}
        out.setdefault(repr(sorted(kwargs.items())), kwargs)
    return list(out.values()) or [dict(defaults)]


def check_coupling(
    optimizer_class: Any,
    hyperparameters: list[dict[str, Any]],
    like: torch.Tensor,
    *,
    world_size: int,
    allow_coupled: bool,
) -> None:
    """Raises ValueError if the probe finds ``optimizer_class`` coupled under any of
    ``hyperparameters`` (warns instead with ``allow_coupled=True``); see [Note: coupled
    optimizers]."""
    if world_size == 1:
        return
    reasons = (coupling(optimizer_class, kwargs, like) for kwargs in hyperparameters)
    reason = next((r for r in reasons if r is not None), None)
    if reason is None:
        return
    name = _name(optimizer_class)
    if allow_coupled:
        warnings.warn(
            f"{API}: allow_coupled=True: {name} is sharded over {world_size} ranks although "
            f"{reason}; its result is not one process's",
            UserWarning,
            stacklevel=4,
        )
        return
    raise ValueError(
        f"{API}: cannot shard {name} over {world_size} ranks: {reason}; pass "
        "allow_coupled=True to accept a result that differs from one process's"
    )


def flat_backend(
    param_groups: list[dict[str, Any]],
    optimizer_class: Any,
    defaults: dict[str, Any],
    wire: Wire,
    *,
    group: Any,
    rank: int,
    world_size: int,
) -> ZeroBackend:
    """The flat partition's backend: shardopt.core's form of the class (or of the torch class
    it subclasses without overriding anything), else the class itself on slices where the
    elementwise probe passes; raises ValueError naming the class and the reason otherwise."""
    base = known_base(optimizer_class)
    if base in CORE_FACTORIES:
        return CoreBackend(param_groups, base, defaults, wire, group=group, world_size=world_size)
    name = _name(optimizer_class)
    known = ", ".join(c.__name__ for c in CORE_FACTORIES)
    if wire.comm_dtype is not None:
        raise ValueError(
            f"{API}: comm_dtype={wire.comm_dtype} needs an optimizer with a shardopt.core form "
            f"({known}), got {name}"
        )
    like = next(p for g in param_groups for p in g["params"])
    keys: frozenset[str] = frozenset()
    for kwargs in settings(optimizer_class, defaults, param_groups):
        verdict = elementwise(optimizer_class, kwargs, like)
        if verdict.reason is not None:
            raise ValueError(
                f"{API}: partition='flat' cannot step {name} on slices of flat buffers: "
                f"{verdict.reason}; use partition='greedy' (the flat partition runs the classes "
                f"with a shardopt.core form, {known}, and classes its probe finds elementwise)"
            )
        keys |= verdict.keys
    return TorchSlicesBackend(
        optimizer_class, defaults, keys, group=group, rank=rank, world_size=world_size
    )
