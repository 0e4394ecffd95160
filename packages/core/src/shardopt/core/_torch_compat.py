"""One record per core optimizer of what ties it to its torch.optim class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.core._adadelta import ScaleByAdadeltaState, adadelta
from shardopt.core._adafactor import ScaleByAdafactorState, adafactor
from shardopt.core._adagrad import ScaleByAdagradState, adagrad
from shardopt.core._adam import ScaleByAdamState, adam, adamw
from shardopt.core._adamax import ScaleByAdamaxState, adamax
from shardopt.core._asgd import ScaleByAsgdState, asgd
from shardopt.core._base import Transformation
from shardopt.core._muon import ScaleByMuonState, muon
from shardopt.core._nadam import ScaleByNadamState, nadam
from shardopt.core._radam import ScaleByRadamState, radam
from shardopt.core._rmsprop import ScaleByRmsState, rmsprop
from shardopt.core._rprop import ScaleByRpropState, rprop
from shardopt.core._sgd import TraceState, sgd

__all__ = ["TORCH_COMPAT", "TorchCompat", "torch_compat"]

# [Note: torch compatibility records]
# Everything shardopt knows about a torch.optim class lives in its record, and every table
# elsewhere is derived from these: shardopt.optim's class-to-factory mapping (which classes
# ``partition="flat"`` and the RPC optimizer run on core) and shardopt.functional's torch state
# keys (checkpoints in torch's format). The hyperparameters keep torch's names: a factory takes
# every argument of the class by the same name except ``implementation`` flags, which pick a
# kernel, not a rule (a test checks the signatures against torch's). The state keys are in
# torch's order, as ``torch.optim.<Class>.state_dict()`` lists them: (state field, torch key,
# whether torch keeps it). torch.optim.SGD keeps no step count, so TraceState's ``count`` is
# saved under "step" in shardopt's own forms but left out of torch's. ``eager``: torch creates
# the state of every parameter at construction (Adagrad), not at its first gradient. Every
# elementwise factory has a piece rule (the fast path over flat buffers); Muon and Adafactor need
# whole tensors ([Note: whole tensors]) and run on tensors of their own shapes. Which of a record's
# keys torch keeps for a parameter can depend on its shape (Adafactor: ``row_var`` and ``col_var``
# for 2 or more dims, ``variance`` below): a key torch keeps is there when the factory's state
# leaf is not None.

_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable"})
_STEP = ("count", "step", True)
_ADAM = (
    _STEP,
    ("mu", "exp_avg", True),
    ("nu", "exp_avg_sq", True),
    ("nu_max", "max_exp_avg_sq", True),
)


@dataclass(frozen=True, slots=True)
class TorchCompat:
    """One core optimizer against its torch.optim class (see [Note: torch compatibility
    records])."""

    torch_class: type[torch.optim.Optimizer]
    factory: Callable[..., Transformation]
    state_type: type
    state_keys: tuple[tuple[str, str, bool], ...]
    eager: bool = False
    implementation: frozenset[str] = _IMPLEMENTATION

    def __post_init__(self) -> None:
        fields = getattr(self.state_type, "_fields", ())
        unknown = [f for f, _, _ in self.state_keys if f not in fields]
        if unknown:
            raise ValueError(
                f"TorchCompat: expected state keys of {self.state_type.__name__}'s fields "
                f"{fields}, got {unknown}"
            )


_RECORDS: tuple[TorchCompat, ...] = (
    TorchCompat(
        torch.optim.SGD,
        sgd,
        TraceState,
        (("count", "step", False), ("momentum", "momentum_buffer", True)),
    ),
    TorchCompat(
        torch.optim.Adam,
        adam,
        ScaleByAdamState,
        (
            _STEP,
            ("mu", "exp_avg", True),
            ("nu", "exp_avg_sq", True),
            ("nu_max", "max_exp_avg_sq", True),
        ),
    ),
    TorchCompat(
        torch.optim.AdamW,
        adamw,
        ScaleByAdamState,
        (
            _STEP,
            ("mu", "exp_avg", True),
            ("nu", "exp_avg_sq", True),
            ("nu_max", "max_exp_avg_sq", True),
        ),
    ),
    TorchCompat(
        torch.optim.Adagrad, adagrad, ScaleByAdagradState, (_STEP, ("sum", "sum", True)), eager=True
    ),
    TorchCompat(
        torch.optim.RMSprop,
        rmsprop,
        ScaleByRmsState,
        (
            _STEP,
            ("square_avg", "square_avg", True),
            ("momentum", "momentum_buffer", True),
            ("grad_avg", "grad_avg", True),
        ),
    ),
    TorchCompat(
        torch.optim.Adamax,
        adamax,
        ScaleByAdamaxState,
        (_STEP, ("exp_avg", "exp_avg", True), ("exp_inf", "exp_inf", True)),
    ),
    TorchCompat(
        torch.optim.NAdam,
        nadam,
        ScaleByNadamState,
        (
            _STEP,
            ("mu_product", "mu_product", True),
            ("exp_avg", "exp_avg", True),
            ("exp_avg_sq", "exp_avg_sq", True),
        ),
    ),
    TorchCompat(
        torch.optim.RAdam,
        radam,
        ScaleByRadamState,
        (_STEP, ("exp_avg", "exp_avg", True), ("exp_avg_sq", "exp_avg_sq", True)),
    ),
    TorchCompat(
        torch.optim.Adadelta,
        adadelta,
        ScaleByAdadeltaState,
        (_STEP, ("square_avg", "square_avg", True), ("acc_delta", "acc_delta", True)),
    ),
    TorchCompat(
        torch.optim.Rprop,
        rprop,
        ScaleByRpropState,
        (_STEP, ("prev", "prev", True), ("step_size", "step_size", True)),
    ),
    TorchCompat(
        getattr(torch.optim, "Muon", None),  # type: ignore[arg-type]  # torch >= 2.9
        muon,
        ScaleByMuonState,
        (("count", "step", False), ("momentum", "momentum_buffer", True)),
    ),
    TorchCompat(
        getattr(torch.optim, "Adafactor", None),  # type: ignore[arg-type]  # torch >= 2.5
        adafactor,
        ScaleByAdafactorState,
        (
            _STEP,
            ("row_var", "row_var", True),
            ("col_var", "col_var", True),
            ("variance", "variance", True),
        ),
    ),
    TorchCompat(
        torch.optim.ASGD,
        asgd,
        ScaleByAsgdState,
        (_STEP, ("eta", "eta", True), ("mu", "mu", True), ("ax", "ax", True)),
    ),
)

# The records of the classes this torch has (Muon and Adafactor are newer than shardopt's floor).
TORCH_COMPAT: tuple[TorchCompat, ...] = tuple(r for r in _RECORDS if r.torch_class is not None)


def torch_compat(optimizer_class: Any) -> TorchCompat | None:
    """The record of exactly ``optimizer_class`` (a subclass may override ``step``: None).

    Example:
        >>> torch_compat(torch.optim.AdamW).factory.__name__, torch_compat(torch.optim.LBFGS)
        ('adamw', None)
    """
    return next((r for r in TORCH_COMPAT if r.torch_class is optimizer_class), None)
