"""What one step of an optimizer class creates, probed: the specs its loads check against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.functional.checkpoint import NONNEGATIVE_KEYS, EntrySpec, Expected
from shardopt.optim.zero._classes import settings
from shardopt.optim.zero._probe import _cached, _Probe

__all__ = ["StateRecord", "state_record", "torch_specs"]

# [Note: probed state records]
# The state a torch or third-party class keeps is whatever its step writes, so the probe of
# [Note: optimizer probes] also records it: the class stepped once, with the hyperparameters it
# will run with, on the probe's matrix and vector, and for each key of each tensor's state what it
# holds (the parameter's shape, one value, or another shape; its dtype where it is not the
# parameter's; a Python number; whether its values were >= 0). A parameter of two or more
# dimensions is checked against the matrix's record, any other against the vector's; a key is a
# second moment where its name says so (NONNEGATIVE_KEYS) and the probe saw no negative value.
# The record is cached per class, hyperparameters, dtype and device, like the verdicts; a class
# the probe cannot step has no record, and its entries are checked for shapes and dtypes only
# ([Note: incoming state]).


@dataclass(frozen=True, slots=True)
class _Made:
    shape: str  # "param", "scalar" or "other"
    dtype: torch.dtype | None  # None: the parameter's
    nonnegative: bool


@dataclass(frozen=True, slots=True)
class StateRecord:
    """What one step makes for the probe's matrix and vector (see [Note: probed state
    records])."""

    matrix: Mapping[str, _Made]
    vector: Mapping[str, _Made]

    def expected(self, param: torch.Tensor) -> dict[str, Expected]:
        """The Expected of each key for ``param``."""
        made = self.matrix if param.dim() >= 2 else self.vector
        out = {}
        for key, m in made.items():
            shape = {"param": tuple(param.shape), "scalar": ()}.get(m.shape)
            dtype = param.dtype if m.dtype is None else m.dtype
            out[key] = Expected(shape, dtype, count=key == "step", nonnegative=m.nonnegative)
        return out


def _made(value: Any, param: torch.Tensor) -> _Made:
    if not isinstance(value, torch.Tensor):
        return _Made("scalar", None, False)
    shape = "param" if value.shape == param.shape else "scalar" if value.dim() == 0 else "other"
    dtype = None if value.dtype == param.dtype else value.dtype
    low = value.detach().min().item() if value.numel() and not value.is_complex() else 0
    return _Made(shape, dtype, bool(low >= 0))


def _record(probe: _Probe) -> StateRecord:
    start, grads = probe.tensors()
    params, states = probe.run(start, grads[:1])
    made = [
        {
            key: _Made(m.shape, m.dtype, m.nonnegative and key in NONNEGATIVE_KEYS)
            for key, value in state.items()
            for m in [_made(value, p)]
        }
        for p, state in zip(params, states)
    ]
    return StateRecord(made[0], made[1])


def state_record(
    optimizer_class: Any, defaults: dict[str, Any], like: torch.Tensor
) -> StateRecord | None:
    """What one step of ``optimizer_class`` with ``defaults`` makes (None: it cannot be probed);
    see [Note: probed state records].

    Example:
        >>> record = state_record(torch.optim.Adam, {"lr": 0.1}, torch.zeros(1))
        >>> sorted(record.expected(torch.zeros(2, 2)))
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> record.expected(torch.zeros(2, 2))["exp_avg_sq"].nonnegative
        True
    """

    def compute() -> StateRecord | None:
        try:
            return _record(probe)
        except Exception:  # a class the probe cannot step: checked for shapes and dtypes only
            return None

    dtype = like.dtype if like.is_floating_point() else torch.float32
    probe = _Probe(optimizer_class, dict(defaults), dtype, like.device)
    return _cached("state", probe, compute)


def torch_specs(
    optimizer_class: Any,
    defaults: dict[str, Any],
    param_groups: Sequence[Mapping[str, Any]],
    saved_groups: Sequence[Mapping[str, Any]],
) -> dict[torch.Tensor, EntrySpec]:
    """Parameter -> what ``optimizer_class`` makes for it, once the saved hyperparameters
    (``saved_groups``, checked already) are loaded into ``param_groups``; indexed as the global
    state dict (param-group order)."""
    out: dict[torch.Tensor, EntrySpec] = {}
    for g, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if not group["params"]:
            continue
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        kwargs = settings(optimizer_class, defaults, [{**group, **hyper}])[0]
        record = state_record(optimizer_class, kwargs, group["params"][0])
        for p in group["params"]:
            keys = None if record is None else record.expected(p)
            index = len(out)
            out[p] = EntrySpec(index, g, tuple(p.shape), p.dtype, keys)
    return out
