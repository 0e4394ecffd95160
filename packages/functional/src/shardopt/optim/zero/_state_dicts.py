"""ZeroRedundancyOptimizer's state dicts: what they keep, and what loading reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch

from shardopt.optim.zero._params import API, check_rank

__all__ = [
    "SavedState",
    "StateElsewhere",
    "checked_rank",
    "saved_entries",
    "starts_stateless",
    "wide_entries",
]


# [Note: state dicts without consolidation]
# torch's ZeroRedundancyOptimizer answers ``state_dict()`` only on the rank it last consolidated
# to, and raises elsewhere. Two cases need no gathering and answer on any rank, alone:
# - the state is known empty: the optimizer was never stepped (nor loaded with a non-empty
#   state), and the class makes its state on the first step (probed once on one tensor; Adagrad,
#   which makes it at construction, still needs consolidating). This is what accelerate's
#   ``AcceleratedOptimizer`` asks for when it wraps the optimizer, on every rank.
# - ``consolidate_for_saving`` ran and this rank does not save: frameworks that save from one rank
#   still call ``state_dict()`` on every rank and drop what the others return (accelerate's
#   ``save_state``). Those ranks get the param groups and a StateElsewhere as "state", which
#   raises, naming the saving ranks, on any use: pickling it, reading it, iterating it.


def saved_entries(
    state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> dict[torch.Tensor, Any]:
    """Parameter -> its entry in ``state_dict["state"]``, matched by position in the param
    groups as torch.optim does; raises ValueError unless the group sizes are ``groups``'."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{API}.load_state_dict: expected {len(groups)} param groups (as this optimizer "
            f"has), got {len(saved_groups)}"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{API}.load_state_dict: expected param group {i} of {len(group['params'])} "
                f"parameters (as this optimizer has), got {len(saved['params'])}"
            )
    saved_ids = [i for g in saved_groups for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    state = state_dict["state"]
    known = set(saved_ids)
    unknown = [k for k in state if k not in known and not _optimizer_wide(k, known)]
    if unknown:  # e.g. ids turned into strings by a round trip through DCP or JSON
        raise ValueError(
            f"{API}.load_state_dict: expected the keys of state to be the ids in param_groups "
            f"({saved_ids[:3]}...), got {unknown[:3]!r}"
        )
    return {p: state[i] for i, p in zip(saved_ids, params) if i in state}


def wide_entries(state_dict: dict[str, Any]) -> dict[Any, Any]:
    """The entries of ``state_dict["state"]`` that are optimizer-wide, not a parameter's (see
    [Note: optimizer-wide state])."""
    known = {i for g in state_dict["param_groups"] for i in g["params"]}
    return {k: v for k, v in state_dict["state"].items() if _optimizer_wide(k, known)}


def _optimizer_wide(key: Any, ids: set[Any]) -> bool:
    """A key of ``state`` that names no parameter: not an id, nor an id turned into a string."""
    if isinstance(key, int) or key in ids:
        return False
    return not (isinstance(key, str) and key.lstrip("-").isdigit())


def _state_order(key: Any) -> tuple[int, str]:
    """Parameter ids first, in order, then the optimizer-wide keys."""
    return (0, f"{key:020d}") if isinstance(key, int) else (1, str(key))


class StateElsewhere(Mapping[int, Any]):
    """The "state" of a state dict on a rank that does not save: raises on any use.

    See [Note: state dicts without consolidation].
    """

    def __init__(self, rank: int, saving: Sequence[int]) -> None:
        self.rank, self.saving = rank, tuple(saving)

    def _refuse(self) -> NoReturn:
        raise RuntimeError(
            f"{API}.state_dict: expected to be used on a rank that saves, got rank {self.rank}: "
            f"consolidate_for_saving gathered the state on group rank(s) {list(self.saving)} "
            "only; call consolidate_state_dict(to=this rank) on all ranks to get it here"
        )

    def __getitem__(self, key: int) -> Any:
        self._refuse()

    def __iter__(self) -> Iterator[int]:
        self._refuse()

    def __len__(self) -> int:
        self._refuse()

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._refuse()

    def __repr__(self) -> str:
        return f"StateElsewhere(rank={self.rank}, saving={list(self.saving)})"


class SavedState:
    """What ``state_dict()`` answers with on this rank, and when it may answer at all (see
    [Note: state dicts without consolidation])."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.consolidated: dict[Any, Any] | None = None  # consolidate_state_dict's
        self.pristine = True  # never stepped, nor loaded with state
        self.saving_on: list[int] | None = None  # consolidate_for_saving's saving ranks

    def changed(self, *, loaded_state: bool = True) -> None:
        """A step or load: the state may no longer be empty, nor gathered for saving."""
        self.pristine = self.pristine and not loaded_state
        self.saving_on = None

    def state(self, empty_here: Callable[[], bool], stateless: Callable[[], bool]) -> Any:
        """The "state" of ``state_dict()``: the consolidated one, a StateElsewhere, or an empty
        one where nothing needs gathering (``empty_here()``: no local state; ``stateless()``: the
        class makes no state at construction; each asked only if needed); raises where none of
        these holds."""
        if self.consolidated is not None:
            return dict(sorted(self.consolidated.items(), key=lambda kv: _state_order(kv[0])))
        if self.saving_on is not None:
            return StateElsewhere(self.rank, self.saving_on)
        if self.pristine and empty_here() and stateless():
            return {}
        raise RuntimeError(
            f"{API}.state_dict: expected the optimizer state consolidated on this rank, got "
            f"none on rank {self.rank}; call consolidate_state_dict(to={self.rank}) on all "
            "ranks first"
        )


def starts_stateless(
    optimizer_class: Callable[..., torch.optim.Optimizer],
    defaults: dict[str, Any],
    device: torch.device,
) -> bool:
    """Whether ``optimizer_class`` makes no state at construction (probed on one tensor)."""
    probe = torch.zeros(2, 2, device=device, requires_grad=True)
    try:
        return not optimizer_class([probe], **defaults).state
    except Exception:  # a class that wants more than a plain tensor: assume state
        return False


def checked_rank(to: Any, world_size: int) -> tuple[None, dict[str, Any]]:
    """consolidate_state_dict's local check, and what must agree: ``to``."""
    check_rank("consolidate_state_dict", "to", to, world_size)
    return None, {"to": to}
