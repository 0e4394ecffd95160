"""partition="flat" for an elementwise class without a shardopt.core form: the class itself,
stepped on this rank's slices of the flat buffers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core import Piece, Plan, plan_partition
from shardopt.functional import ParamBuffers
from shardopt.functional.checkpoint import gather_entries
from shardopt.functional.engine import ProcessGroup, build_param_buffers
from shardopt.optim.zero._backend import reseat
from shardopt.optim.zero._partition import copy_hyperparameters, flat_partition, owners

__all__ = ["TorchSlicesBackend", "optimizer_wide"]

# [Note: slices for the class itself]
# A class that the elementwise probe passes ([Note: optimizer probes]) updates each element from
# that element's gradient, value and state alone, whatever the tensor's shape or cut. So each
# param group gets a flat plan and ParamBuffers of its own (the parameters become views of its
# buffers, as under the core forms), and the local optimizer is the class itself over one
# parameter per piece this rank owns: a 1-D leaf sharing the piece's memory, whose gradient
# is lent, for the step, as the same elements of the parameter's ``.grad``. The update writes
# the buffers in place; then each group's buffers are all-gathered. In torch's form a
# parameter's entry is its pieces' entries joined: the keys the probe found elementwise
# (``keys``) end to end in the parameter's shape, every other value from the first piece (the
# pieces share it). Entries of ``state`` not keyed by a parameter (MADGRAD's ``k``) are
# optimizer-wide ([Note: optimizer-wide state]).
#
# [Note: optimizer-wide state]
# torch.optim keeps whatever a class puts in ``state`` under a key that is not a parameter as
# is, under that key, in ``state_dict()["state"]``, and puts it back on loading. Each rank's
# local optimizer has its own copy, equal on every rank where the class keeps it per step (every
# rank steps once per iteration); consolidation takes the target rank's, loading gives every
# rank the saved one.


def optimizer_wide(optim: Any) -> dict[Any, Any]:
    """The entries of ``optim.state`` not keyed by a tensor (see [Note: optimizer-wide state]),
    deep-copied to the CPU."""
    found = {k: v for k, v in optim.state.items() if not isinstance(k, torch.Tensor)}
    return {k: _to_cpu(copy.deepcopy(v)) for k, v in found.items()}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class _Unit:
    """One param group's plan and ParamBuffers, and the leaves the local optimizer steps."""

    def __init__(self, params: list[torch.Tensor], plan: Plan, param_buffers: ParamBuffers) -> None:
        self.params, self.plan, self.param_buffers = params, plan, param_buffers
        self.pieces: tuple[Piece, ...] = plan.pieces(param_buffers.rank)
        self.leaves = [torch.nn.Parameter(v) for v in param_buffers.param_views()]  # shared memory

    def lend(self) -> None:
        """Each leaf's gradient: its piece's elements of the parameter's ``.grad``."""
        for leaf, piece in zip(self.leaves, self.pieces):
            g = self.params[piece.tensor].grad
            leaf.grad = None if g is None else g.reshape(-1)[piece.start : piece.stop]

    def take_back(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None


class TorchSlicesBackend:
    """The flat partition of a class proved elementwise by probing (see [Note: slices for the
    class itself]); ``optim`` is the class over this rank's slices."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        keys: frozenset[str],
        *,
        group: ProcessGroup,
        rank: int,
        world_size: int,
    ) -> None:
        self.optimizer_class, self.defaults, self.keys = optimizer_class, defaults, keys
        self.group, self.rank, self.world_size = group, rank, world_size
        self.units: list[_Unit | None] = []
        self.optim: Any = None  # built by start, over the first groups' slices

    def prepare(self, group: dict[str, Any]) -> None:
        """Nothing to check before the class's own constructor."""

    def _unit(self, params: list[torch.Tensor]) -> _Unit | None:
        if not params:
            return None
        plan = plan_partition(params, self.world_size, strategy="flat")
        param_buffers = build_param_buffers(
            plan, params, self.rank, group=self.group, storage="views"
        )
        return _Unit(params, plan, param_buffers)

    def _local_group(self, group: dict[str, Any], unit: _Unit | None) -> dict[str, Any]:
        local = copy.copy(group)
        local["params"] = [] if unit is None else list(unit.leaves)
        return local

    def start(self, param_groups: list[dict[str, Any]]) -> None:
        """Lays every group out flat and builds the local optimizer over this rank's slices."""
        self.units = [self._unit(list(g["params"])) for g in param_groups]
        local = [self._local_group(g, u) for g, u in zip(param_groups, self.units)]
        self.optim = self.optimizer_class(local, **self.defaults)
        copy_hyperparameters(self.optim.param_groups, param_groups)

    def add_group(self, param_groups: list[dict[str, Any]]) -> None:
        """Lays the new group out in buffers of its own and gives its slices to the optimizer."""
        unit = self._unit(list(param_groups[-1]["params"]))
        self.units.append(unit)
        self.optim.add_param_group(self._local_group(param_groups[-1], unit))
        copy_hyperparameters(self.optim.param_groups, param_groups)

    def step(
        self,
        param_groups: list[dict[str, Any]],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """Runs ``closure``, steps the class over this rank's slices, all-gathers every group."""
        self.wait_params()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        units = [u for u in self.units if u is not None]
        for u in units:
            reseat(u.param_buffers, u.params)  # see [Note: re-seated parameters]
            u.lend()
        try:
            copy_hyperparameters(param_groups, self.optim.param_groups)
            self.optim.step(**kwargs)
            copy_hyperparameters(self.optim.param_groups, param_groups)
        finally:
            for u in units:
                u.take_back()
        self.sync_all()
        return loss

    def sync_all(self) -> None:
        """Every parameter from the ranks that own its elements (collective)."""
        for u in self.units:
            if u is not None:
                u.param_buffers.sync_params()

    def wait_params(self) -> None:
        for param_buffers in self.view_buffers():
            param_buffers.wait_params()

    def view_buffers(self) -> list[ParamBuffers]:
        return [u.param_buffers for u in self.units if u is not None]

    def hook_targets(self, api: str) -> list[Any]:
        """Each group's unit (its ``param_buffers`` is what the param hooks wait on)."""
        return [u for u in self.units if u is not None]

    def partition(self, param_groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        return flat_partition(param_groups, self.units, self.world_size)

    def owners(self, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, int]:
        return owners(param_groups, [None if u is None else u.plan for u in self.units])

    def consolidate(
        self, param_groups: list[dict[str, Any]], index: dict[torch.Tensor, int], *, to: int
    ) -> dict[Any, dict[str, Any]] | None:
        """Every parameter's entry joined from its pieces' on rank ``to`` (collective)."""
        copy_hyperparameters(param_groups, self.optim.param_groups)
        w = self.world_size
        entries = {}
        where: dict[int, tuple[_Unit, int]] = {}
        for u in self.units:
            if u is None:
                continue
            for t, p in enumerate(u.params):
                where[index[p]] = (u, t)
            for leaf, piece in zip(u.leaves, u.pieces):
                if self.optim.state.get(leaf):
                    entries[index[u.params[piece.tensor]] * w + self.rank] = self.optim.state[leaf]
        gathered = gather_entries(entries, to=to, group=self.group)
        if gathered is None:
            return None
        by_param: dict[int, dict[int, dict[str, Any]]] = {}
        for key, entry in gathered.items():
            i, r = divmod(key, w)
            by_param.setdefault(i, {})[r] = entry
        out: dict[Any, dict[str, Any]] = {}
        for i in sorted(by_param):
            unit, t = where[i]
            ranks = [r for r, _ in unit.plan.tensor_pieces(t)]
            out[i] = self._joined([by_param[i][r] for r in ranks], unit.params[t].shape)
        out.update(optimizer_wide(self.optim))
        return out

    def _joined(self, parts: list[dict[str, Any]], shape: torch.Size) -> dict[str, Any]:
        first = parts[0]
        return {
            key: torch.cat([p[key].reshape(-1) for p in parts]).view(shape)
            if key in self.keys
            else value
            for key, value in first.items()
        }

    def load(
        self,
        saved_groups: Sequence[dict[str, Any]],
        entries: dict[torch.Tensor, Any],
        wide: dict[Any, Any] | None = None,
    ) -> None:
        """Loads each parameter's torch-form entry, cut to this rank's pieces, and the
        optimizer-wide entries, through the class's own ``load_state_dict``."""
        state: dict[Any, Any] = {}
        local_groups = []
        index = 0
        for saved, group, unit in zip(saved_groups, self.optim.param_groups, self.units):
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            local_groups.append(
                {**hyper, "params": list(range(index, index + len(group["params"])))}
            )
            held = [] if unit is None else [(unit.params[c.tensor], c) for c in unit.pieces]
            for param, piece in held:
                entry = entries.get(param)
                if entry is not None:
                    state[index] = self._cut(entry, piece)
                index += 1
        state.update(wide or {})
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})

    def _cut(self, entry: dict[str, Any], piece: Piece) -> dict[str, Any]:
        return {
            key: value.reshape(-1)[piece.start : piece.stop].clone()
            if key in self.keys and isinstance(value, torch.Tensor)
            else value
            for key, value in entry.items()
        }
