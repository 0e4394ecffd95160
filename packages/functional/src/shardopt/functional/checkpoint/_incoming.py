"""Incoming state: every entry a load would write, checked against what the optimizer makes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.core import Plan
from shardopt.functional.checkpoint._checkpoint_keys import FieldKeys
from shardopt.functional.engine._state import FieldGranularity

__all__ = [
    "NONNEGATIVE_KEYS",
    "EntrySpec",
    "Expected",
    "check_entries",
    "hyperparam_problem",
    "nonfinite_hint",
    "torch_form_specs",
]

# [Note: incoming state]
# A state dict or a checkpoint is data from outside: every load checks each entry it would write
# against what the optimizer would make itself, all of it before anything is written, so that a
# refused load leaves the state as it was. What the optimizer makes is data, one EntrySpec per
# parameter: its index and group, shape and dtype, and per state key an Expected (the shape, the
# dtype it makes, whether it is a step count, whether it is a second moment). The specs come from
# shardopt.core's declared state fields (the torch keys of [Note: torch state keys]) or, for
# torch's and third-party classes, from what one probed step of the class creates ([Note: probed
# state records] in shardopt.optim);
# a class that cannot be probed has no keys (``keys=None``) and its tensors are checked for dtype
# and memory only (its shapes are unknown: LBFGS keeps flat directions over all parameters). The
# rules, in order, per entry:
# - keys: every key a step creates is there (core forms: nothing else either);
# - form: a tensor of the expected shape, strided, in real (not meta) and owned memory (no
#   expanded or overlapping view: the step writes it in place), of a real floating dtype for a
#   real parameter (never complex), or of the parameter's kind; a step count or a scalar may be a
#   Python number;
# - domain: a step count >= 0; a second moment (NONNEGATIVE_KEYS) >= 0; everything finite.
# The metadata rules cost nothing; the domain needs one pass over the data, done as one
# ``torch.aminmax`` per tensor (min and max: NaN propagates, inf shows, a negative shows) and one
# host read of all the verdicts per device and dtype (the drop-in reads the values of the entries
# its rank loads only; the form of every entry on every rank). Non-finite values are refused
# unless the load is told ``allow_nonfinite=True`` (the one switch of every load API: a diverged
# run reloaded on purpose); a negative second moment or step is refused regardless.
# Hyperparameters in saved param groups must be of the types the optimizer reads
# (``hyperparam_problem``). A refusal names the API, the parameter (index and group), the key,
# what was expected and what was found; the callers raise it on every rank together through the
# cross-rank agreement ([Note: cross-rank validation]), or, where a load does not communicate
# (load_torch_state_dict, a PostLocalSGDOptimizer over a local class), check the whole dict
# alike on every rank.

NONNEGATIVE_KEYS = frozenset(
    {
        "exp_avg_sq",
        "max_exp_avg_sq",
        "sum",
        "square_avg",
        "acc_delta",
        "exp_inf",
        "row_var",
        "col_var",
        "variance",
        "step_size",
    }
)


@dataclass(frozen=True, slots=True)
class Expected:
    """What the optimizer makes under one key: ``shape`` (None: not known; ``()`` one value),
    ``dtype`` (None: not known), ``count`` (a step count, >= 0), ``nonnegative`` (>= 0)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    count: bool = False
    nonnegative: bool = False


@dataclass(frozen=True, slots=True)
class EntrySpec:
    """What the optimizer makes for one parameter (``keys`` None: not known)."""

    index: Any
    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    keys: Mapping[str, Expected] | None
    exact: bool = False  # no keys but ``keys`` (the core forms)

    @property
    def where(self) -> str:
        return f"parameter {self.index!r} (group {self.group})"


def nonfinite_hint() -> str:
    return "; pass allow_nonfinite=True to load it anyway (a diverged run, reloaded on purpose)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory exactly once: no expanded or overlapping view."""
    if t.numel() == 0:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    step = 1
    for stride, size in dims:
        if stride != step:
            return False
        step *= size
    return True


def _form(spec: EntrySpec, key: str, value: Any, want: Expected | None) -> str | None:
    """What is wrong with the form of ``value`` (metadata only), as "expected ..., got ...", or
    None. ``want`` None: a key the spec does not know (its memory and dtype checked, not its
    shape: a class the probe cannot step may keep anything, as LBFGS its flat directions)."""
    scalar = want is not None and want.shape == ()
    if _number(value) and (want is None or scalar):
        return None
    if not isinstance(value, torch.Tensor):
        if want is None:
            return None  # a plain value the optimizer keeps for itself
        return f"a tensor, got {type(value).__name__}"
    if value.layout != torch.strided or value.device.type == "meta":
        return f"a dense tensor in memory, got layout {value.layout} on {value.device}"
    if want is not None and want.shape is not None and tuple(value.shape) != want.shape:
        whose = "" if scalar else " (the parameter's)"
        return f"shape {want.shape}{whose}, got {tuple(value.shape)}"
    if not _dense(value):
        return (
            f"a tensor of its own memory, got an expanded or overlapping view (strides "
            f"{value.stride()})"
        )
    if value.is_complex() and not spec.dtype.is_complex:
        made = _name(want.dtype) if want is not None and want.dtype is not None else "real"
        return f"a real dtype ({made}, for a real parameter), got {_name(value.dtype)}"
    if want is None:
        return None
    floating = value.is_floating_point() or value.is_complex()
    if value.dtype == torch.bool or not (floating or want.count or scalar):
        return f"a floating dtype ({_name(want.dtype or spec.dtype)}), got {_name(value.dtype)}"
    return None


def _entry_problem(spec: EntrySpec, entry: Any) -> str | None:
    """The first metadata problem of ``entry``, as "<key>: expected ..., got ...", or None."""
    if not isinstance(entry, Mapping):
        return f"an entry: expected a dict of state, got {type(entry).__name__}"
    if spec.keys is not None:
        missing = [k for k in spec.keys if k not in entry]
        extra = [k for k in entry if k not in spec.keys] if spec.exact else []
        if missing or extra:
            return (
                f"keys: expected {sorted(spec.keys)} (what a step makes), got {sorted(entry)}"
                + (f", without {missing}" if missing else f", with {extra}")
            )
    keys = spec.keys or {}
    for key, value in entry.items():
        problem = _form(spec, key, value, keys.get(key))
        if problem is not None:
            return f"entry {key!r}: expected {problem}"
    return None


@dataclass(frozen=True, slots=True)
class _Datum:
    spec: EntrySpec
    key: str
    value: torch.Tensor
    nonnegative: bool


def _data(spec: EntrySpec, entry: Mapping[str, Any]) -> Iterable[_Datum]:
    keys = spec.keys or {}
    for key, value in entry.items():
        want = keys.get(key)
        if isinstance(value, torch.Tensor) and value.numel() and value.dtype != torch.bool:
            bound = want is not None and (want.count or want.nonnegative)
            yield _Datum(spec, key, value, bound)


def _number_problem(spec: EntrySpec, entry: Mapping[str, Any]) -> tuple[str, bool] | None:
    """The first domain problem of a Python number in ``entry``: (message, whether finiteness)."""
    keys = spec.keys or {}
    for key, value in entry.items():
        want = keys.get(key)
        if not _number(value) or want is None:
            continue
        if not math.isfinite(value):
            return f"entry {key!r}: expected a finite value, got {value!r}", True
        if (want.count or want.nonnegative) and value < 0:
            return f"entry {key!r}: expected a value >= 0, got {value!r}", False
    return None


def _verdicts(data: Sequence[_Datum]) -> list[tuple[bool, bool]]:
    """(finite, >= 0) per datum: one aminmax each, then per device and dtype a few operators
    over all the minima and maxima and one host read."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, d in enumerate(data):
        groups.setdefault((d.value.device, d.value.dtype), []).append(i)
    out: list[tuple[bool, bool]] = [(True, True)] * len(data)
    with torch.no_grad():
        for indices in groups.values():
            lows, highs = [], []
            for i in indices:
                value = data[i].value.detach()
                low, high = torch.aminmax(
                    torch.view_as_real(value) if value.is_complex() else value
                )
                lows.append(low.reshape(()))
                highs.append(high.reshape(()))
            low, high = torch.stack(lows), torch.stack(highs)
            flags = torch.stack([torch.isfinite(low) & torch.isfinite(high), ~(low < 0)])
            for i, finite, nonnegative in zip(indices, *flags.tolist()):
                out[i] = (bool(finite), bool(nonnegative))
    return out


def check_entries(
    api: str,
    items: Sequence[tuple[EntrySpec, Any]],
    *,
    allow_nonfinite: bool = False,
    rank: int | None = None,
    domain: bool = True,
) -> str | None:
    """The refusal of the first bad entry among ``items`` ((spec, entry) pairs), a message naming
    ``api``, the parameter, the key, what was expected and what was found; None if all pass (see
    [Note: incoming state]).

    Example:
        >>> made = {"exp_avg": Expected((2,), torch.float32)}
        >>> spec = EntrySpec(0, 0, (2,), torch.float32, made)
        >>> print(check_entries("load", [(spec, {"exp_avg": torch.ones(1)})]))  # doctest: +ELLIPSIS
        load: parameter 0 (group 0), entry 'exp_avg': expected shape (2,) ..., got (1,); ...
        >>> print(check_entries("load", [(spec, {"exp_avg": torch.ones(2)})]))
        None
    """
    on = "" if rank is None else f" on rank {rank}"

    def refused(spec: EntrySpec, what: str, nonfinite: bool = False) -> str:
        hint = nonfinite_hint() if nonfinite else ""
        return f"{api}: {spec.where}, {what}{on}; nothing was loaded{hint}"

    for spec, entry in items:
        problem = _entry_problem(spec, entry)
        if problem is not None:
            return refused(spec, problem)
    if not domain:  # checked already by the caller (the drop-in's load)
        return None
    for spec, entry in items:
        found = _number_problem(spec, entry)
        if found is not None and not (found[1] and allow_nonfinite):
            return refused(spec, found[0], found[1])
    data = [d for spec, entry in items for d in _data(spec, entry)]
    for d, (finite, nonnegative) in zip(data, _verdicts(data)):
        if d.nonnegative and not nonnegative:
            return refused(d.spec, f"entry {d.key!r}: expected values >= 0, got a negative one")
        if not finite and not allow_nonfinite:
            return refused(d.spec, f"entry {d.key!r}: expected finite values, got NaN or inf", True)
    return None


def _type_problem(made: Any, value: Any) -> str | None:
    """Why ``value`` cannot stand where the optimizer has ``made``, or None."""
    if isinstance(made, bool) or made is None:  # (None: torch's "not set", as foreach)
        ok = made is None or value is None or isinstance(value, bool)
        return None if ok else f"a bool, got {type(value).__name__}"
    if _number(made) or isinstance(made, torch.Tensor):
        real = isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()
        ok = (_number(value) and math.isfinite(value)) or real
        return None if ok else f"a real number, got {value!r}"[:200]
    if isinstance(made, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(made):
            return f"a sequence of {len(made)}, got {value!r}"[:200]
        return next((p for m, v in zip(made, value) if (p := _type_problem(m, v))), None)
    if isinstance(made, str) and not isinstance(value, str):
        return f"a str, got {type(value).__name__}"
    return None


def hyperparam_problem(
    api: str, saved: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> str | None:
    """The first hyperparameter of ``saved`` (param groups) of another type than the one the
    optimizer keeps in the same group of ``groups``, as a refusal naming ``api``; or None."""
    for g, (old, new) in enumerate(zip(saved, groups)):
        if not isinstance(old, Mapping):
            return f"{api}: expected param group {g} to be a dict, got {type(old).__name__}"
        for key, made in new.items():
            if key in ("params", "param_names") or key not in old:
                continue
            problem = _type_problem(made, old[key])
            if problem is not None:
                return (
                    f"{api}: param group {g}, hyperparameter {key!r}: expected {problem}; "
                    "nothing was loaded"
                )
    return None


def torch_form_specs(plan: Plan, keys: FieldKeys, key_of: Sequence[Any]) -> list[EntrySpec | None]:
    """What a core optimizer's state makes for each plan tensor in torch's form, from its
    declared fields ([Note: torch state keys]); None for tensors ``keys`` does not cover."""
    out: list[EntrySpec | None] = []
    for t, spec in enumerate(plan.tensors):
        if not keys.covers(t):
            out.append(None)
            continue
        dtype = spec.torch_dtype
        made = {
            key: Expected(
                () if f.granularity is FieldGranularity.PER_PIECE else tuple(spec.shape),
                dtype,
                count=f is keys.count or key == "step",
                nonnegative=key in NONNEGATIVE_KEYS,
            )
            for f, key, in_torch in keys.entries
            if in_torch
        }
        for key, shape in keys.shapes(spec.shape, torch.float32).items():
            made[key] = Expected(tuple(shape), dtype, nonnegative=key in NONNEGATIVE_KEYS)
        group = plan.tensors[t].param_group
        out.append(EntrySpec(key_of[t], group, tuple(spec.shape), dtype, made, exact=True))
    return out
