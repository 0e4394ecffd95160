"""State dicts of a greedy partition: consolidating the local optimizers' states, and loading."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from shardopt.functional.engine import ProcessGroup, comm_device, irecv_from, isend_to
from shardopt.optim._zero_params import API, agreed, check_rank
from shardopt.optim._zero_transport import (
    gather_objects,
    on_device,
    pack_tensors,
    snapshot,
    unpack_tensor,
    wait_all,
)

__all__ = [
    "StateDictMethods",
    "StateElsewhere",
    "consolidate_greedy",
    "load_greedy",
    "local_states",
    "saved_entries",
    "saving_ranks",
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


def local_states(
    optim: torch.optim.Optimizer, global_index: Callable[[torch.Tensor], int]
) -> dict[int, dict[str, Any]]:
    """The local optimizer's ``state_dict()["state"]`` keyed by global parameter index."""
    local = optim.state_dict()
    order = [p for group in optim.param_groups for p in group["params"]]
    return {
        global_index(order[i]): entry
        for i, entry in local["state"].items()
        if isinstance(i, int) and entry is not None
    }


def _packable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested


def consolidate_greedy(
    states: dict[int, dict[str, Any]],
    *,
    to: int,
    group: ProcessGroup,
    device: torch.device,
) -> dict[int, dict[str, Any]] | None:
    """Every rank's ``states`` (global index -> entry) merged on group rank ``to``; collective.

    See [Note: consolidation without pickled tensors]. The target's own entries are copied (on
    the CPU); the others' are views of one received buffer per rank. Returns None on the other
    ranks.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    buf = None
    meta: Any = None
    if rank != to:
        tensors: list[torch.Tensor] = []
        layout = []
        for index, entry in states.items():
            items: list[tuple[str, int | None, Any]] = []
            for key, value in entry.items():
                if _packable(value):
                    items.append((key, len(tensors), None))
                    tensors.append(value)
                else:
                    items.append((key, None, value))
            layout.append((index, items))
        buf, specs = pack_tensors(tensors, device)
        meta = (layout, specs, buf.numel())
    metas = gather_objects(meta, to=to, group=group, device=device)
    if metas is None:
        assert buf is not None
        work = isend_to(buf, to, group=group) if buf.numel() else None
        if work is not None:
            work.wait()
        return None
    received: list[torch.Tensor | None] = [None] * world
    works = []
    for r in range(world):
        if r != rank and metas[r][2]:
            into = torch.empty(metas[r][2], dtype=torch.uint8, device=device)
            received[r] = into
            works.append(irecv_from(into, r, group=group))
    wait_all(works)
    out = {index: snapshot(entry) for index, entry in states.items()}
    for r in range(world):
        if r != rank:
            out.update(_unpack_states(metas[r], received[r]))
    return out


def _unpack_states(meta: Any, buf: torch.Tensor | None) -> dict[int, dict[str, Any]]:
    layout, specs, _ = meta
    cpu = None if buf is None else buf.cpu()
    out = {}
    for index, items in layout:
        entry = {}
        for key, position, value in items:
            if position is None:
                entry[key] = value
            else:
                assert cpu is not None
                entry[key] = unpack_tensor(cpu, *specs[position])
        out[index] = entry
    return out


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
    unknown = [k for k in state if k not in set(saved_ids)]
    if unknown:  # e.g. ids turned into strings by a round trip through DCP or JSON
        raise ValueError(
            f"{API}.load_state_dict: expected the keys of state to be the ids in param_groups "
            f"({saved_ids[:3]}...), got {unknown[:3]!r}"
        )
    return {p: state[i] for i, p in zip(saved_ids, params) if i in state}


def load_greedy(
    optim: torch.optim.Optimizer,
    saved_groups: Sequence[dict[str, Any]],
    entry_of: Callable[[torch.Tensor], dict[str, Any] | None],
) -> None:
    """Loads the saved hyperparameters and the entries of this rank's parameters into the local
    optimizer through its own ``load_state_dict`` (its casts and checks apply)."""
    local_groups = []
    state: dict[int, Any] = {}
    index = 0
    for saved, group in zip(saved_groups, optim.param_groups):
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        local_groups.append({**hyper, "params": list(range(index, index + len(group["params"])))})
        for p in group["params"]:
            entry = entry_of(p)
            if entry is not None:
                state[index] = entry
            index += 1
    optim.load_state_dict({"state": state, "param_groups": local_groups})


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


def saving_ranks(saving: bool, *, group: ProcessGroup, device: torch.device) -> list[int]:
    """The group ranks whose ``saving`` is true (every rank's flag); collective."""
    flag = torch.tensor([int(bool(saving))], dtype=torch.int32, device=device)
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    return [r for r, f in enumerate(flags) if int(f.item())]


class StateDictMethods:
    """The state-dict methods of ZeroRedundancyOptimizer (mixed into it; see its docstring)."""

    _consolidated: dict[int, dict[str, Any]] | None
    _pristine: bool
    _saving_on: list[int] | None
    _cache: dict[str, Any]
    _optim_constructor: type[torch.optim.Optimizer]
    _optim_defaults: dict[str, Any]
    _default_device: torch.device
    optim: Any
    rank: int
    world_size: int
    process_group: Any
    param_groups: list[dict[str, Any]]

    wait_params: Callable[[], None]
    _sync_param_groups: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None]

    @property
    def _flat(self) -> bool:
        raise NotImplementedError

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        raise NotImplementedError

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on group rank ``to``; must be called on every rank.

        See [Note: consolidation without pickled tensors]. Afterwards :meth:`state_dict` works on
        rank ``to`` (and raises on the others).
        """
        agreed(
            f"{API}.consolidate_state_dict",
            lambda: _checked_rank(to, self.world_size),
            self.process_group,
            lambda: self._default_device,
        )
        self.wait_params()
        self._saving_on = None
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        with on_device(self._default_device):
            if self._flat:
                state = self.optim.consolidate(self._param_to_index, to=to)
            else:
                states = local_states(self.optim, self._param_to_index.__getitem__)
                device = comm_device(self.process_group, self._default_device)
                state = consolidate_greedy(states, to=to, group=self.process_group, device=device)
        self._consolidated = state

    def consolidate_for_saving(self, saving: bool) -> None:
        """Gathers the whole state on every rank that passes ``saving=True``; must be called on
        every rank of the group, before a framework saves from some of them.

        Afterwards :meth:`state_dict` on a saving rank is the global state; on the others it is
        the param groups and a placeholder "state" that raises when used (frameworks that save
        from one rank call ``state_dict()`` on every rank and drop the others' result). See
        [Note: state dicts without consolidation]. Costs one :meth:`consolidate_state_dict` per
        saving rank (none when no rank saves).
        """
        device = comm_device(self.process_group, self._default_device)
        with on_device(self._default_device):
            targets = saving_ranks(saving, group=self.process_group, device=device)
        mine = None
        for to in targets:
            self.consolidate_state_dict(to=to)
            mine = self._consolidated if to == self.rank else mine
        self._consolidated = mine
        self._saving_on = None if saving else targets

    def state_dict(self) -> dict[str, Any]:
        """The global state in torch.optim's format, as of the last :meth:`consolidate_state_dict`
        (the param groups as they are now). Where nothing needs gathering it answers on any rank
        (see [Note: state dicts without consolidation]).

        Raises:
            RuntimeError: the state was not consolidated on this rank.
        """
        state: Any = self._consolidated
        if state is not None:
            state = dict(sorted(state.items()))
        elif self._saving_on is not None:
            state = StateElsewhere(self.rank, self._saving_on)
        elif self._pristine and not self.optim.state and self._starts_stateless():
            state = {}
        else:
            raise RuntimeError(
                f"{API}.state_dict: expected the optimizer state consolidated on this rank, got "
                f"none on rank {self.rank}; call consolidate_state_dict(to={self.rank}) on all "
                "ranks first"
            )
        self.wait_params()
        out = torch.optim.Optimizer.state_dict(self)  # type: ignore[arg-type]
        out["state"] = state
        return out

    def _starts_stateless(self) -> bool:
        """Whether the optimizer class makes no state at construction (probed on one tensor)."""
        if "starts_stateless" not in self._cache:
            probe = torch.zeros(2, 2, device=self._default_device, requires_grad=True)
            try:
                stateless = not self._optim_constructor([probe], **self._optim_defaults).state
            except Exception:  # a class that wants more than a plain tensor: assume state
                stateless = False
            self._cache["starts_stateless"] = stateless
        return bool(self._cache["starts_stateless"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a global state dict (ours, torch's ZeroRedundancyOptimizer's or a plain
        torch.optim one over the same parameters): each rank keeps what it owns.

        Raises:
            ValueError: the param groups do not have this optimizer's sizes.
        """
        entries = saved_entries(state_dict, self.param_groups)
        self._pristine = self._pristine and not state_dict["state"]
        self._saving_on = None
        self._sync_param_groups(state_dict["param_groups"], self.param_groups)
        if self._flat:
            self.optim.load(entries)
        else:
            load_greedy(self.optim, state_dict["param_groups"], entries.get)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)


def _checked_rank(to: Any, world_size: int) -> tuple[None, Any]:
    """consolidate_state_dict's local check, and what must agree: ``to``."""
    check_rank("consolidate_state_dict", "to", to, world_size)
    return None, to
