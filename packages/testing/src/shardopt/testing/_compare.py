"""Comparing a candidate's parameters and optimizer state with torch.optim's, per dtype."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DEFAULT_RTOL", "Mismatch", "Tolerance", "compare_state_dicts", "compare_tensors"]

# [Note: tolerances] Errors are measured on the scale of the reference tensor:
# max|candidate - reference| / max|reference|, so that elements near zero are judged against
# the tensor's magnitude rather than their own. The defaults allow a few ulps of float
# rounding from a different summation order (an all-reduce against a local sum) compounded
# over a few steps, and doubled in squared gradients (Adam's exp_avg_sq): float32 ~8 ulps,
# float64 ~4500 ulps (still 1e-12), float16 and bfloat16 4 ulps (2**-10 and 2**-7 apart).
# `exact=True` asks for bitwise equality, which holds when the candidate computes the same
# operations in the same order (see assert_matches_torch).
DEFAULT_RTOL: Mapping[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 4 * 2**-10,
    torch.bfloat16: 4 * 2**-7,
}


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Bitwise (``exact``), or a relative error bound per dtype (``rtol`` overrides defaults)."""

    exact: bool = False
    rtol: Mapping[torch.dtype, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for dtype, value in self.rtol.items():
            if not isinstance(dtype, torch.dtype) or not value >= 0:
                raise ValueError(
                    f"Tolerance: expected rtol to map torch.dtype to a value >= 0, "
                    f"got {dtype!r}: {value!r}"
                )

    def for_dtype(self, dtype: torch.dtype) -> float:
        """The bound for ``dtype``: 0 when exact or for non-float dtypes."""
        if self.exact:
            return 0.0
        return self.rtol.get(dtype, DEFAULT_RTOL.get(dtype, 0.0))

    def describe(self) -> str:
        if self.exact:
            return "bitwise"
        return "per-dtype rtol" + (f" with overrides {dict(self.rtol)}" if self.rtol else "")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One tensor (or value) of the candidate that differs from the reference."""

    step: int
    rank: int
    what: str  # "parameter 'layers.0.weight'", "state 'exp_avg' of parameter ...", ...
    detail: str
    max_abs: float = float("nan")
    max_rel: float = float("nan")

    def describe(self) -> str:
        return f"{self.what}: {self.detail}"


@dataclass(frozen=True, slots=True)
class TensorError:
    """How far a candidate tensor is from the reference; ``ok`` if within the tolerance."""

    ok: bool
    max_abs: float
    max_rel: float
    detail: str


def compare_tensors(candidate: torch.Tensor, reference: torch.Tensor, rtol: float) -> TensorError:
    """Compares on the reference's scale (see [Note: tolerances]); ``rtol=0`` is bitwise.

    Example:
        >>> compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), 0.0).ok
        True
        >>> compare_tensors(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), 1e-6).max_rel
        0.25
    """
    cand, ref = candidate.detach(), reference.detach()
    if cand.shape != ref.shape or cand.dtype != ref.dtype:
        return TensorError(
            False, float("inf"), float("inf"),
            f"{_kind(cand)} differs from the reference's {_kind(ref)}",
        )  # fmt: skip
    if cand.numel() == 0:
        return TensorError(True, 0.0, 0.0, "")
    cand64, ref64 = cand.cpu().double(), ref.cpu().double()
    diff = (cand64 - ref64).abs()
    max_abs = diff.max().item()
    scale = ref64.abs().max().item()
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    ok = torch.equal(cand.cpu(), ref.cpu()) if rtol == 0 else max_rel <= rtol
    if max_abs != max_abs:  # NaN somewhere: never within tolerance
        ok = False
    worst = tuple(torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    index = tuple(int(i) for i in worst)
    bound = "bitwise" if rtol == 0 else f"rtol {rtol:.1e}"
    detail = (
        f"{_kind(ref)}: max abs error {max_abs:.3e}, max rel error {max_rel:.3e} "
        f"({'within' if ok else 'beyond'} {bound}); worst at {index}: "
        f"candidate {cand64[index].item()!r}, reference {ref64[index].item()!r}"
    )
    return TensorError(ok, max_abs, max_rel, detail)


def _kind(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}, shape {tuple(tensor.shape)}"


def compare_state_dicts(
    candidate: Mapping[str, Any],
    reference: Mapping[str, Any],
    names: Sequence[str],
    tolerance: Tolerance,
    *,
    step: int,
    rank: int,
) -> list[Mismatch]:
    """Compares two optimizer ``state_dict()``s in torch.optim format; [] when they match.

    ``names[i]`` is the name of the parameter with index ``i``.
    """
    found = _compare_param_groups(candidate, reference, step, rank)
    cand_state, ref_state = candidate.get("state", {}), reference.get("state", {})
    for index in sorted(set(cand_state) | set(ref_state)):
        owner = f"parameter {_name(names, index)!r} (index {index})"
        if index not in cand_state or index not in ref_state:
            side = "the candidate" if index not in cand_state else "torch.optim"
            found.append(Mismatch(step, rank, f"state of {owner}", f"{side} has none"))
            continue
        found.extend(
            _compare_entries(cand_state[index], ref_state[index], owner, tolerance, step, rank)
        )
    return found


def _compare_param_groups(
    candidate: Mapping[str, Any], reference: Mapping[str, Any], step: int, rank: int
) -> list[Mismatch]:
    cand_groups = candidate.get("param_groups", [])
    ref_groups = reference.get("param_groups", [])
    if len(cand_groups) != len(ref_groups):
        detail = f"{len(cand_groups)} groups, torch.optim has {len(ref_groups)}"
        return [Mismatch(step, rank, "param_groups", detail)]
    found = []
    for i, (cand, ref) in enumerate(zip(cand_groups, ref_groups)):
        for key in sorted(ref):
            if key not in cand or not _same_value(cand[key], ref[key]):
                got = cand.get(key, "<missing>")
                detail = f"candidate {got!r}, torch.optim {ref[key]!r}"
                found.append(Mismatch(step, rank, f"param_groups[{i}][{key!r}]", detail))
    return found


def _compare_entries(
    cand: Mapping[str, Any],
    ref: Mapping[str, Any],
    owner: str,
    tolerance: Tolerance,
    step: int,
    rank: int,
) -> list[Mismatch]:
    found = []
    for key in sorted(set(cand) | set(ref)):
        what = f"state {key!r} of {owner}"
        if key not in cand or key not in ref:
            side = "the candidate" if key not in cand else "torch.optim"
            found.append(Mismatch(step, rank, what, f"missing in {side}"))
        elif isinstance(ref[key], torch.Tensor) and isinstance(cand[key], torch.Tensor):
            error = compare_tensors(cand[key], ref[key], tolerance.for_dtype(ref[key].dtype))
            if not error.ok:
                found.append(Mismatch(step, rank, what, error.detail, error.max_abs, error.max_rel))
        elif not _same_value(cand[key], ref[key]):
            found.append(
                Mismatch(step, rank, what, f"candidate {cand[key]!r}, torch.optim {ref[key]!r}")
            )
    return found


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    return bool(a == b)


def _name(names: Sequence[str], index: Any) -> str:
    return names[index] if isinstance(index, int) and 0 <= index < len(names) else f"#{index}"
