"""ZeroRedundancyOptimizer: torch's sharded optimizer, rebuilt on shardopt.core and functional."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from shardopt.core import Plan, Strategy
from shardopt.functional.engine import describe, mesh_groups
from shardopt.optim._zero_engine import EngineSync, reseat
from shardopt.optim._zero_flat import FlatShardOptimizer, torch_defaults
from shardopt.optim._zero_join import ZeroJoinHook
from shardopt.optim._zero_params import (
    API,
    agreed,
    check_grads,
    check_options,
    check_param_types,
    describe_group,
    group_params,
    read_params,
)
from shardopt.optim._zero_partition import (
    PartitionViews,
    greedy_plan,
    partition_parameters,
    step_only,
)
from shardopt.optim._zero_state_dict import StateDictMethods
from shardopt.optim._zero_transport import on_device

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(PartitionViews, EngineSync, StateDictMethods, Optimizer, Joinable):
    """Shards an optimizer's state over the ranks of a process group (ZeRO stage 1).

    The API and behaviour of ``torch.distributed.optim.ZeroRedundancyOptimizer``: change the
    import and nothing else. Each rank steps a local optimizer over its share of the
    parameters, then every rank receives the others' updated parameters. Used behind DDP (or
    with gradients averaged otherwise); every method that communicates must be called on all
    ranks of ``process_group``.

    - ``partition="greedy"`` (default): torch's assignment of whole parameters (see
      [Note: the greedy partition]); ``optim`` is ``optimizer_class(this rank's param groups,
      **defaults)``, any ``torch.optim.Optimizer`` subclass. The parameter sync goes through
      flat buffers: one broadcast per rank and bucket under gloo, one all-gather per bucket
      under NCCL, not one call per parameter (see [Note: greedy parameter sync]). With
      ``parameters_as_bucket_view=True`` the parameters become views of those buffers; without,
      they keep their storage and small staging buffers carry them.
    - ``partition="flat"``: for the torch.optim classes with a shardopt.core form (SGD, Adam,
      AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, Rprop, ASGD, Muon, Adafactor):
      shardopt's engine steps them through ``shardopt.functional.shard``; ``optim`` is a
      :class:`~shardopt.optim._zero_flat.FlatShardOptimizer` (see [Note: the flat local
      optimizer]). For the elementwise classes every rank owns an equal slice of one flat buffer
      per dtype (exactly 1/W of the state; parameters may straddle ranks); Muon and Adafactor
      need whole matrices, so each rank owns whole parameters balanced by the update's cost
      (Newton–Schulz flops for Muon). Parameters are always views of the flat buffers.
    - ``allow_mixed_dtypes=True``: parameters of several dtypes, one flat group per dtype.

    ``consolidate_state_dict`` gathers flat tensors to one rank (see [Note: consolidation without
    pickled tensors]); ``state_dict()`` there is the global state in torch.optim's format as it
    was then (a copy), loadable by torch's ZeroRedundancyOptimizer and by plain torch.optim.

    Args:
        params: tensors or param-group dicts, as for any torch optimizer.
        optimizer_class: the local optimizer's class.
        process_group: the group sharing the state (None: the default group), or a DeviceMesh:
            1-D, or 2-D with dims ("replicate", "shard"), which shards the state over "shard"
            (each replica holds all of it; DDP averages the gradients over every rank).
        parameters_as_bucket_view: make the parameters views of the flat buffers.
        overlap_with_ddp: step from a DDP communication hook (``hook_with_zero_step``), which
            calls ``_step_params`` and ``_sync_params_of``; :meth:`step` then does nothing.
        partition: ``"greedy"`` or ``"flat"`` (keyword only).
        allow_mixed_dtypes: accept parameters of several dtypes (keyword only).
        **defaults: hyperparameters of ``optimizer_class``.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
        >>> model(torch.ones(4, 2)).sum().backward()
        >>> opt.step()
        >>> opt.consolidate_state_dict(to=0)
        >>> sorted(opt.state_dict()["state"][0])
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> dist.destroy_process_group()

    Raises:
        TypeError: ``params`` is not an iterable of tensors or of param-group dicts.
        ValueError: no parameters, a sparse parameter, mixed dtypes (unless allowed), an unknown
            ``partition``, or ``partition="flat"`` with an optimizer without a shardopt.core form.
    """

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        partition: str = "greedy",
        allow_mixed_dtypes: bool = False,
        **defaults: Any,
    ) -> None:
        self.initialized = False  # add_param_group acts as the base class's until the end
        groups = mesh_groups(API, process_group)  # see [Note: hybrid sharding]
        group: Any = dist.group.WORLD if groups.shard is None else groups.shard
        self.process_group = group
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        self.global_rank: int = dist.get_global_rank(self.process_group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._overlap_with_ddp = overlap_with_ddp
        self._allow_mixed_dtypes = allow_mixed_dtypes
        self._optim_defaults = defaults
        self._optim_constructor = optimizer_class
        self._consolidated: dict[int, dict[str, Any]] | None = None
        self._pristine = True  # never stepped, nor loaded with state
        self._saving_on: list[int] | None = None  # see consolidate_for_saving
        self._warned_overlap_step = False
        self._cache: dict[str, Any] = {}
        self._layout = None  # greedy with bucket views: the engine (see EngineSync)
        self._staged = None  # greedy without: the same buckets, staged
        self.optim: Any
        options = (partition, parameters_as_bucket_view, overlap_with_ddp, allow_mixed_dtypes)

        def build() -> tuple[Plan | None, Any]:
            plan, summary = self._build(params, options)
            return plan, (summary, groups.description)

        plan = agreed(
            API,
            build,
            group if groups.agree is None else groups.agree,
            lambda: getattr(self, "_default_device", None),
        )
        with on_device(self._default_device):
            if self._flat:
                for param_group in self.param_groups:
                    self.optim.add_param_group(param_group)
            else:
                assert plan is not None  # greedy: _build made one
                self._set_plan(plan)
        self.initialized = True

    # -- construction -------------------------------------------------------------------------

    def _build(self, params: Any, options: tuple[Any, ...]) -> tuple[Plan | None, str]:
        """Everything local of the constructor: checks, param groups, the local optimizer.
        Returns the greedy plan (None for flat) and what must agree across ranks."""
        partition, bucket_view, overlap, mixed = options
        groups, all_params = read_params(params)
        check_param_types(all_params, allow_mixed_dtypes=mixed)
        self._partition = check_options(
            self._optim_constructor,
            partition,
            overlap_with_ddp=overlap,
            parameters_as_bucket_view=bucket_view,
            allow_mixed_dtypes=mixed,
        )
        Optimizer.__init__(self, groups, self._optim_defaults)
        Joinable.__init__(self)
        self._all_params: list[torch.Tensor] = list(all_params)
        self._default_device = self._all_params[0].device
        plan = None
        if self._flat:
            self.optim = FlatShardOptimizer(
                self._optim_constructor,
                torch_defaults(self._optim_constructor, self._optim_defaults, all_params[0]),
                self.process_group,
                self.world_size,
            )
            for param_group in self.param_groups:
                self.optim.prepare(param_group)
        else:
            plan = greedy_plan(self.param_groups, self.world_size)
            local = partition_parameters(self.param_groups, plan)[self.rank]
            self.optim = self._optim_constructor(local, **self._optim_defaults)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)
        summary = (describe(self._optim_constructor), self._partition.value, *options[1:])
        return plan, describe([summary, *map(describe_group, self.param_groups)])

    @property
    def _flat(self) -> bool:
        return self._partition is Strategy.FLAT

    # -- stepping ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Steps this rank's share, then syncs every parameter from its owner.

        ``closure`` and ``kwargs`` go to the local optimizer's ``step`` as in torch (the flat
        partition takes no ``kwargs``). Returns the local optimizer's result (the loss).
        """
        if self._overlap_with_ddp:
            if not self._warned_overlap_step:
                logger.warning(
                    "%s.step: with overlap_with_ddp=True the DDP communication hook steps the "
                    "optimizer; step() does nothing and can leave the training loop",
                    API,
                )
                self._warned_overlap_step = True
            return None
        Join.notify_join_context(self)
        return self._step_and_sync(closure, kwargs)

    def _shadow_step(self) -> None:
        """The step of a rank that has joined (see [Note: joining with uneven inputs])."""
        if not self._overlap_with_ddp:
            self._step_and_sync(None, {})

    def _step_and_sync(self, closure: Callable[[], Any] | None, kwargs: dict[str, Any]) -> Any:
        self._pristine, self._saving_on = False, None
        self.wait_params()  # the update writes what the last gathers send
        if self._layout is not None:
            reseat(self._layout, self._index_to_param)  # see [Note: re-seated parameters]
        if not self._flat and closure is None:  # (flat: shard's step checks every gradient)
            check_grads(self._all_params, self._optim_constructor)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        if self._flat:
            loss = self.optim.step(closure, **kwargs)  # updates and syncs
        elif closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _step_params(self, params: Sequence[torch.Tensor]) -> None:
        """Runs the local optimizer's update for those of ``params`` this rank owns, from their
        ``.grad`` (no parameter sync). For the DDP communication hooks."""
        if self._flat:
            raise RuntimeError(f"{API}._step_params: expected partition='greedy', got 'flat'")
        self._pristine, self._saving_on = False, None
        to_rank = self._param_to_rank
        mine = {id(p) for p in params if to_rank.get(p) == self.rank and p.grad is not None}
        if mine:
            self._sync_param_groups(self.param_groups, self.optim.param_groups)
            step_only(self.optim, mine)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group and re-partitions; must be called on every rank.

        The parameters of earlier groups keep their owners; the new group's are spread over the
        ranks (flat partition: it gets its own flat buffers).

        Raises:
            RuntimeError: with ``overlap_with_ddp=True`` (as torch).
            ValueError: a sparse parameter, or a new dtype without ``allow_mixed_dtypes``.
        """
        if not self.initialized:
            super().add_param_group(param_group)
            return
        if self._overlap_with_ddp:
            raise RuntimeError(
                f"{API}.add_param_group: expected a single parameter group with "
                "overlap_with_ddp=True, got a request to add one"
            )
        count = len(self.param_groups)
        try:
            agreed(
                f"{API}.add_param_group",
                lambda: self._add_locally(param_group),
                self.process_group,
                lambda: self._default_device,
            )
        except BaseException:
            del self.param_groups[count:]  # every rank raises: none keeps the group
            raise
        group = self.param_groups[-1]
        self._all_params.extend(group["params"])
        self._cache.clear()
        with on_device(self._default_device):
            if self._flat:
                self.optim.add_param_group(group)
                return
            plan = greedy_plan(self.param_groups, self.world_size)
            local = partition_parameters(self.param_groups, plan)[self.rank][-1]
            self.optim.add_param_group(local)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)
            self._set_plan(plan)

    def _add_locally(self, param_group: dict[str, Any]) -> tuple[None, str]:
        """add_param_group's local part: checks, then torch's (which fills the defaults)."""
        new = group_params(param_group, len(self.param_groups))
        check_param_types(self._all_params + new, allow_mixed_dtypes=self._allow_mixed_dtypes)
        super().add_param_group(param_group)
        if self._flat:
            self.optim.prepare(self.param_groups[-1])
        return None, describe([len(self.param_groups), describe_group(self.param_groups[-1])])

    # -- Joinable ------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows :meth:`step` on ranks out of inputs (no keyword arguments used)."""
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's collectives: the first parameter's."""
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context."""
        return self.process_group
