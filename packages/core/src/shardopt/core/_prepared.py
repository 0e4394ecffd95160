"""The lists a piece rule works on: the chain state split, and their preparation once for fixed
tensors (see [Note: prepared pieces] in _pieces.py)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core._base import EmptyState
from shardopt.core._transforms import ScaleByScheduleState
from shardopt.core._tree import tree_leaves

__all__ = [
    "FLOAT_DTYPES",
    "Prepared",
    "advance",
    "leaves_of",
    "prepare",
    "prepared_update",
    "split_state",
]

Tensors = list[torch.Tensor]
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def split_state(state: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The algorithm's own state in a factory's chain state, and the count trees of its
    schedule pieces (``ScaleByScheduleState``)."""
    main, counts = None, []
    for part in state:
        if isinstance(part, ScaleByScheduleState):
            counts.append(part.count)
        elif not isinstance(part, EmptyState):
            main = part
    return main, counts


def leaves_of(tree: Any) -> list[Any]:
    """``tree_leaves``, without the pytree walk for the usual case of a list of tensors."""
    return tree if type(tree) is list else tree_leaves(tree)


class Prepared:
    """The per-tensor part of a rule for fixed tensors (see [Note: prepared pieces]): the
    parameters, the main state's field lists, the schedule counts, and the counts' slice."""

    __slots__ = ("bump", "fusable", "lists", "others", "params")

    def __init__(self, params: Tensors, state: Sequence[Any]) -> None:
        main, schedule_counts = split_state(state)
        self.params = list(params)
        self.lists: dict[str, Tensors] = {}
        if main is not None:
            self.lists = {
                f: list(leaves_of(v)) for f, v in zip(main._fields, main) if v is not None
            }
        self.others = [list(leaves_of(c)) for c in schedule_counts]
        counts = self.lists.get("count", self.others[0] if self.others else None)
        self.bump = None if counts is None or self.others else _consecutive(counts)
        # the fused kernels walk memory in order: every tensor laid out alike (select_kernel)
        self.fusable = all(p.is_contiguous() for p in params)


def _consecutive(counts: Tensors) -> torch.Tensor | None:
    """One tensor whose elements are ``counts`` in order (0-d views of consecutive elements of
    one 1-D tensor), else None."""
    base = counts[0]._base if counts[0].dim() == 0 else None
    if base is None or base.dim() != 1 or base.stride(0) != 1:
        return None
    start = counts[0].storage_offset() - base.storage_offset()
    for i, c in enumerate(counts):
        if (
            c._base is not base
            or c.dim() != 0
            or c.storage_offset() != base.storage_offset() + start + i
        ):
            return None
    return base[start : start + len(counts)]


def _same_tensors(a: Tensors, b: Tensors) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def advance(counts: Tensors, whole: Prepared | None) -> None:
    """Every count plus one: one add on the prepared slice where there is one."""
    if whole is not None and whole.bump is not None:
        whole.bump.add_(1)
    else:
        torch._foreach_add_(counts, 1)


def prepare(params: Tensors, state: Sequence[Any], base: Any) -> Prepared | None:
    """The preparation of ``params`` and ``state`` (the one in ``base`` where it is for them)."""
    if isinstance(base, Prepared) and _same_tensors(base.params, params):
        return base
    p0 = params[0]  # tensors of one float dtype and one device, or none prepared
    if p0.dtype not in FLOAT_DTYPES or any(
        p.dtype != p0.dtype or p.device != p0.device for p in params
    ):
        return None
    return Prepared(params, state)


def prepared_update(
    hp: Any,
    params: Tensors,
    state: Any,
    base: Any,
    kernels: tuple[Callable[..., None], Callable[..., None]],
    *,
    fused_on: frozenset[str],
    supported: bool,
) -> Callable[[Tensors, Any], bool] | None:
    """A rule's preparer (see [Note: prepared pieces]): ``update(grads, state)`` over
    ``params`` and ``state`` (the preparation in ``base`` where it is theirs), by the first of
    ``kernels`` (the fused one) where the tensors are contiguous on a device of ``fused_on``,
    else by the second (foreach); None where the tensors do not suit it. ``supported``: the
    hyperparameters let the kernels run (else every update returns False)."""
    prepared = prepare(params, state, base)
    if prepared is None:
        return None
    fused = prepared.fusable and prepared.params[0].device.type in fused_on
    kernel = kernels[0] if fused else kernels[1]
    n = len(prepared.params)

    def update(grads: Tensors, state: Any) -> bool:
        del state  # the prepared tensors are the state's
        if not supported or callable(hp.lr):
            return False  # a schedule: a learning rate per count (the rule's path)
        kernel(hp, prepared.params, grads, prepared.lists, [hp.lr] * n, whole=prepared)
        if prepared.others:
            torch._foreach_add_([c for cs in prepared.others for c in cs], 1)
        return True

    update.base = prepared  # type: ignore[attr-defined]
    return update
