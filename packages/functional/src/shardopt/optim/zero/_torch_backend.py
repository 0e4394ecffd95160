"""partition="greedy": torch's local optimizer over whole parameters, synced by the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.functional import ParamBuffers, Pending
from shardopt.functional.checkpoint import gather_entries
from shardopt.functional.engine import ProcessGroup, build_param_buffers
from shardopt.optim.zero._backend import reseat
from shardopt.optim.zero._params import API, check_grads
from shardopt.optim.zero._partition import (
    copy_hyperparameters,
    greedy_plan,
    owners,
    partition_parameters,
    step_only,
)
from shardopt.optim.zero._torch_slices_backend import optimizer_wide

__all__ = ["TorchBackend"]


# [Note: greedy parameter sync]
# The greedy partition runs on shardopt.functional's engine ([Note: engine] there): its plan's
# buckets (runs of whole parameters, each laid out owner by owner, exact sizes: no padding to the
# largest rank) are the units of every sync, on one ParamBuffers in one of the engine's two
# storages ([Note: parameter storage]), chosen once:
# - parameters_as_bucket_view=True: "flat"; the parameters are views of its flat buffers, a sync
#   is one in-place broadcast per owner and bucket (one all-gather where the shards are equal
#   under NCCL), and ``register_param_hooks`` can leave it in flight until the next forward
#   ([Note: deferred parameter sync]).
# - False: "staged"; the parameters keep their own storage, as torch's do, and each bucket goes
#   through a staging row of the bucket's size ([Note: staged parameter sync]).
# The calls on the ParamBuffers are the same either way: ``sync_params`` (every bucket, in bucket
# order), ``wait_params``, and ``start_tensor_sync``, with which the DDP comm hooks sync the
# parameters of one DDP bucket at a time: one broadcast per owner and run of adjacent parameters. A
# sync costs one collective per owner and bucket, never one per parameter.


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


class TorchBackend:
    """torch's partition behind ZeroRedundancyOptimizer (see [Note: the greedy partition] and
    [Note: greedy parameter sync]): ``optim`` is ``optimizer_class`` over this rank's share."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        *,
        group: ProcessGroup,
        rank: int,
        world_size: int,
        bucket_view: bool,
    ) -> None:
        self.optimizer_class = optimizer_class
        self.group, self.rank, self.world_size = group, rank, world_size
        self.bucket_view = bucket_view
        self.plan = greedy_plan(param_groups, world_size)
        local = partition_parameters(param_groups, self.plan)[rank]
        self.optim: Any = optimizer_class(local, **defaults)  # torch's checks raise here
        copy_hyperparameters(self.optim.param_groups, param_groups)
        self.params: list[torch.Tensor] = []
        self.param_buffers: ParamBuffers | None = None  # the engine's ParamBuffers, set by start
        self._index: dict[torch.Tensor, int] = {}  # parameter -> plan tensor (set by start)
        self._owners: dict[torch.Tensor, int] = {}  # parameter -> its owner (set by start)

    def prepare(self, group: dict[str, Any]) -> None:
        """Nothing to check beyond torch's own (the local optimizer's constructor)."""

    def start(self, param_groups: list[dict[str, Any]]) -> None:
        """Puts the parameters on the engine in the chosen storage."""
        if self.param_buffers is not None:
            self.param_buffers.wait_params()
        self.params = [p for g in param_groups for p in g["params"]]
        self._index = {p: t for t, p in enumerate(self.params)}
        self._owners = owners(param_groups, [self.plan])
        storage = "views" if self.bucket_view else "staged"  # [Note: parameter storage]
        self.param_buffers = build_param_buffers(
            self.plan, self.params, self.rank, group=self.group, storage=storage
        )

    def add_group(self, param_groups: list[dict[str, Any]]) -> None:
        """Re-plans (earlier groups keep their owners) and gives the new group's share to the
        local optimizer."""
        self.plan = greedy_plan(param_groups, self.world_size)
        local = partition_parameters(param_groups, self.plan)[self.rank][-1]
        self.optim.add_param_group(local)
        copy_hyperparameters(self.optim.param_groups, param_groups)
        self.start(param_groups)

    def step(
        self,
        param_groups: list[dict[str, Any]],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """The local optimizer's step over this rank's share, then every parameter's sync."""
        assert self.param_buffers is not None
        self.param_buffers.wait_params()  # the update writes what the last gathers send
        for param_buffers in self.view_buffers():
            reseat(param_buffers, self.params)  # see [Note: re-seated parameters]
        if closure is None:
            check_grads(self.params, self.optimizer_class)
        copy_hyperparameters(param_groups, self.optim.param_groups)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        copy_hyperparameters(self.optim.param_groups, param_groups)
        self.param_buffers.sync_params()
        return loss

    def step_params(self, param_groups: list[dict[str, Any]], params: Sequence[Any]) -> None:
        """``optim.step`` over those of ``params`` this rank owns that have a gradient: the
        plain ``optim.step()`` where ``params`` hold every trainable parameter of the local
        optimizer (one step per iteration, as :meth:`step` takes it), else over just those."""
        given = {id(p) for p in params}
        local = [p for g in self.optim.param_groups for p in g["params"]]
        everything = all(id(p) in given for p in local if p.requires_grad)
        mine = {id(p) for p in params if self._owners.get(p) == self.rank and p.grad is not None}
        if not (everything or mine):
            return
        copy_hyperparameters(param_groups, self.optim.param_groups)
        if everything:
            self.optim.step()
        else:
            step_only(self.optim, mine)
        copy_hyperparameters(self.optim.param_groups, param_groups)

    def sync_all(self) -> None:
        """Every parameter from its owner (collective)."""
        assert self.param_buffers is not None
        self.param_buffers.sync_params()

    def sync_params_of(self, params: Sequence[torch.Tensor], *, async_op: bool) -> list[Pending]:
        """Starts (and unless ``async_op`` waits for) the sync of ``params`` from their owners."""
        assert self.param_buffers is not None
        index = self._index
        tensors = []
        for i, p in enumerate(params):
            if p not in index:
                raise ValueError(
                    f"{API}._sync_params_of: expected parameters of this optimizer, got "
                    f"params[{i}] of shape {tuple(p.shape)} that it does not hold"
                )
            tensors.append(index[p])
        handles = self.param_buffers.start_tensor_sync(tensors)
        if not async_op:
            for handle in handles:
                handle.wait()
        return handles

    def wait_params(self) -> None:
        """Waits for the parameter syncs left in flight (param hooks)."""
        if self.param_buffers is not None:
            self.param_buffers.wait_params()

    @property
    def bucket_views(self) -> ParamBuffers | None:
        """The parameter buffers the parameters are views of (None: staged storage)."""
        return self.param_buffers if self.bucket_view else None

    def view_buffers(self) -> list[ParamBuffers]:
        """The ParamBuffers of bucket views, if any."""
        return [] if self.bucket_views is None else [self.bucket_views]

    def hook_targets(self, api: str) -> list[Any]:
        """This backend, whose ``param_buffers``' buckets the param hooks wait for (bucket views
        only)."""
        if not self.bucket_view:
            raise ValueError(
                f"{api}: expected parameters_as_bucket_view=True or partition='flat' (and "
                "overlap_with_ddp=False), got parameters_as_bucket_view=False, "
                "partition='greedy'"
            )
        return [self]

    def partition(self, param_groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """torch's ``_partition_parameters()``."""
        return partition_parameters(param_groups, self.plan)

    def owners(self, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, int]:
        """Parameter -> its owner in the plan."""
        return dict(self._owners)

    def consolidate(
        self, param_groups: list[dict[str, Any]], index: dict[torch.Tensor, int], *, to: int
    ) -> dict[int, dict[str, Any]] | None:
        """Every rank's local state on rank ``to`` (see [Note: entries by gathers])."""
        copy_hyperparameters(param_groups, self.optim.param_groups)
        states = local_states(self.optim, index.__getitem__)
        gathered: dict[Any, Any] | None = gather_entries(states, to=to, group=self.group)
        if gathered is not None:
            gathered.update(optimizer_wide(self.optim))  # [Note: optimizer-wide state]
        return gathered

    def load(
        self,
        saved_groups: Sequence[dict[str, Any]],
        entries: dict[torch.Tensor, Any],
        wide: dict[Any, Any] | None = None,
    ) -> None:
        """Loads the saved hyperparameters, the entries of this rank's parameters and the
        optimizer-wide ones into the local optimizer through its own ``load_state_dict`` (its
        casts and checks apply)."""
        local_groups = []
        state: dict[int, Any] = {}
        index = 0
        for saved, group in zip(saved_groups, self.optim.param_groups):
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            ids = list(range(index, index + len(group["params"])))
            local_groups.append({**hyper, "params": ids})
            for p in group["params"]:
                if entries.get(p) is not None:
                    state[index] = entries[p]
                index += 1
        state.update(wide or {})
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})
