"""ZeroRedundancyOptimizer: torch's sharded optimizer, rebuilt on shardopt.core and functional."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from shardopt.core import Strategy
from shardopt.functional import ParamBuffers, ParamHooks, register_param_hooks
from shardopt.functional.engine import fails_together, mesh_groups, ranks_with, warn_renamed
from shardopt.optim.zero._backend import OverlapBackend, ZeroBackend
from shardopt.optim.zero._classes import (
    check_coupling,
    flat_backend,
    settings,
    steps_per_bucket,
)
from shardopt.optim.zero._core_optimizer import Wire
from shardopt.optim.zero._incoming import checked_load
from shardopt.optim.zero._join import ZeroJoinHook
from shardopt.optim.zero._modes import mode_switch
from shardopt.optim.zero._params import (
    API,
    agreed,
    check_options,
    check_param_types,
    group_fields,
    group_params,
    on_device,
    read_params,
)
from shardopt.optim.zero._partition import copy_hyperparameters
from shardopt.optim.zero._state_dicts import (
    SavedState,
    checked_rank,
    starts_stateless,
    wide_entries,
)
from shardopt.optim.zero._torch_backend import TorchBackend

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shards an optimizer's state over the ranks of a process group (ZeRO stage 1).

    The API and behaviour of ``torch.distributed.optim.ZeroRedundancyOptimizer``: change the
    import and nothing else. Each rank steps a local optimizer over its share of the
    parameters, then every rank receives the others' updated parameters. Used behind DDP (or
    with gradients averaged otherwise); every method that communicates must be called on all
    ranks of ``process_group``.

    - ``partition="greedy"`` (default): torch's assignment of whole parameters, each rank
      stepping ``optimizer_class`` over its own (``optim``); any ``torch.optim.Optimizer``
      subclass but those a probe finds coupled, refused unless ``allow_coupled=True``
      ([Note: coupled optimizers]). ``parameters_as_bucket_view=True`` makes the parameters
      views of the flat buffers they sync through.
    - ``partition="flat"``: each rank owns an equal slice of one flat buffer per dtype, updated
      by shardopt.core's form of the class through ``shardopt.functional.shard`` (Muon and
      Adafactor: whole matrices, balanced by cost), or by the class itself where a probe finds
      it elementwise; other classes are refused, naming the reason.
    - ``overlap_with_ddp=True``: the DDP hooks step torch.optim's per-parameter classes bucket by
      bucket and any other class once per iteration ([Note: stepping per bucket]).
    - ``train()`` / ``eval()`` exist when the local optimizer has them (schedule-free): every rank
      switches every parameter ([Note: optimizer modes]).
    - ``allow_mixed_dtypes=True``: parameters of several dtypes, one flat group per dtype.
    - ``comm_dtype=torch.bfloat16`` (flat partition): ``step`` reduces local gradients itself,
      in half the bytes of float32 (give it local gradients: no DDP, or DDP with
      :func:`~shardopt.optim.local_gradients_hook`).

    The drop-in guide (docs/guides/drop-in.md) has the details. Each partition is a backend of
    this one class, chosen at construction ([Note: one backend]). ``consolidate_state_dict``
    gathers the state to one rank ([Note: entries by gathers]); ``state_dict()`` there is the
    global state in torch.optim's format, loadable by torch's class and by plain torch.optim.

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
        comm_dtype: None (DDP averaged the gradients), or the float dtype that the local
            gradients travel in to the ranks that own them (keyword only; flat partition).
        allow_coupled: accept a class whose probe finds it coupled, with a warning (keyword
            only; see [Note: coupled optimizers]).
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
            ``partition``, ``partition="flat"`` with a class neither with a shardopt.core form
            nor elementwise, or a coupled class without ``allow_coupled=True``.
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
        comm_dtype: torch.dtype | None = None,
        allow_coupled: bool = False,
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
        self._saved = SavedState(self.rank)
        self._warned_overlap_step = False
        self._cache: dict[str, Any] = {}
        self._backend: ZeroBackend
        self._wire = Wire(comm_dtype, process_group)  # the mesh too: reduced over its replicas
        self._steps_per_bucket = steps_per_bucket(optimizer_class)  # [Note: stepping per bucket]
        options = (partition, parameters_as_bucket_view, overlap_with_ddp, allow_mixed_dtypes)
        self._allow_coupled = allow_coupled

        def build() -> tuple[None, Any]:
            return None, {**self._build(params, options), "mesh": groups.description}

        agreed(
            API,
            build,
            group if groups.agree is None else groups.agree,
            lambda: getattr(self, "_default_device", None),
        )
        with on_device(self._default_device):
            self._backend.start(self.param_groups)
        self.initialized = True

    # -- construction -------------------------------------------------------------------------

    def _build(self, params: Any, options: tuple[Any, ...]) -> dict[str, Any]:
        """Everything local of the constructor: checks, param groups, the backend (the one
        choice of the partition: [Note: one backend]). Returns what must agree across ranks."""
        partition, bucket_view, overlap, mixed = options
        groups, all_params = read_params(params)
        check_param_types(all_params, allow_mixed_dtypes=mixed)
        self._partition = check_options(
            self._optim_constructor,
            partition,
            overlap_with_ddp=overlap,
            parameters_as_bucket_view=bucket_view,
            allow_mixed_dtypes=mixed,
            comm_dtype=self._wire.comm_dtype,
            allow_coupled=self._allow_coupled,
        )
        Optimizer.__init__(self, groups, self._optim_defaults)
        Joinable.__init__(self)
        self._all_params: list[torch.Tensor] = list(all_params)
        self._default_device = self._all_params[0].device
        self._backend = self._new_backend(bucket_view)
        backend = self._backend  # the DDP hooks' capability, checked once (not per bucket)
        self._overlap_backend = backend if isinstance(backend, OverlapBackend) else None
        return {
            "optimizer_class": self._optim_constructor,
            "partition": self._partition.value,
            "parameters_as_bucket_view": bucket_view,
            "overlap_with_ddp": overlap,
            "allow_mixed_dtypes": mixed,
            "comm_dtype": str(self._wire.comm_dtype),
            "allow_coupled": self._allow_coupled,
            "param_groups": [group_fields(g) for g in self.param_groups],
        }

    def _new_backend(self, bucket_view: bool) -> ZeroBackend:
        """The partition's backend; raises for a class it cannot run exactly (local)."""
        cls, defaults = self._optim_constructor, self._optim_defaults
        where = {"group": self.process_group, "rank": self.rank, "world_size": self.world_size}
        if self._partition is Strategy.FLAT:
            return flat_backend(self.param_groups, cls, defaults, self._wire, **where)
        backend = TorchBackend(self.param_groups, cls, defaults, bucket_view=bucket_view, **where)
        check_coupling(  # after torch's own checks, in the local optimizer's constructor
            cls,
            settings(cls, defaults, self.param_groups),
            self._all_params[0],  # the probe's dtype and device
            world_size=self.world_size,
            allow_coupled=self._allow_coupled,
        )
        return backend

    @property
    def optim(self) -> Any:
        """The local optimizer: ``optimizer_class`` over this rank's share (greedy, or flat for
        a probed class), or a
        :class:`~shardopt.optim.zero._core_optimizer.CoreShardOptimizer` (flat)."""
        return self._backend.optim

    # -- stepping ------------------------------------------------------------------------------

    @fails_together(f"{API}.step")
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
        """The step of a rank that has joined (see [Note: joining with uneven inputs]). With
        ``comm_dtype`` the step reduces this rank's gradients: a joined rank's are zeros."""
        if self._wire.comm_dtype is not None:
            for p in self._all_params:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        if not self._overlap_with_ddp:
            self._step_and_sync(None, {})

    def _step_and_sync(self, closure: Callable[[], Any] | None, kwargs: dict[str, Any]) -> Any:
        self._saved.changed()
        return self._backend.step(self.param_groups, closure, kwargs)

    def _step_params(self, params: Sequence[torch.Tensor]) -> None:
        """Runs the local optimizer's update for those of ``params`` this rank owns, from their
        ``.grad`` (no parameter sync). For the DDP communication hooks (greedy only)."""
        self._overlap("_step_params").step_params(self.param_groups, params)
        self._saved.changed()

    def _sync_params_of(self, params: Sequence[torch.Tensor], *, async_op: bool) -> list[Any]:
        """Starts the sync of just ``params`` from their owners; returns handles with ``wait()``
        (waited for already unless ``async_op``). Every rank passes the same parameters in the
        same order. For the DDP communication hooks (greedy only)."""
        return self._overlap("_sync_params_of").sync_params_of(params, async_op=async_op)

    def _overlap(self, name: str) -> OverlapBackend:
        if self._overlap_backend is None:
            raise RuntimeError(f"{API}.{name}: expected partition='greedy', got 'flat'")
        return self._overlap_backend

    @fails_together(f"{API}.add_param_group")
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
        self._all_params.extend(self.param_groups[-1]["params"])
        self._cache.clear()
        with on_device(self._default_device):
            self._backend.add_group(self.param_groups)

    def _add_locally(self, param_group: dict[str, Any]) -> tuple[None, dict[str, Any]]:
        """add_param_group's local part: checks, then torch's (which fills the defaults)."""
        new = group_params(param_group, len(self.param_groups))
        check_param_types(self._all_params + new, allow_mixed_dtypes=self._allow_mixed_dtypes)
        super().add_param_group(param_group)
        self._backend.prepare(self.param_groups[-1])
        added = group_fields(self.param_groups[-1])
        return None, {"param_groups": len(self.param_groups), "added param group": added}

    # -- torch's partition attributes ----------------------------------------------------------

    def _cached(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank, its param groups: each outer group with the parameters the rank updates
        (flat partition: the parameters with elements on the rank)."""
        return self._cached("partition", lambda: self._backend.partition(self.param_groups))

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        """Parameter -> the rank that updates it (flat: the rank with its first element)."""
        return self._cached("owners", lambda: self._backend.owners(self.param_groups))

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        """Parameter -> its index in the global state dict (param-group order)."""
        return self._cached("index", lambda: {p: i for i, p in enumerate(self._index_to_param)})

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        """The parameters in the global state dict's order."""
        return self._cached("params", lambda: [p for g in self.param_groups for p in g["params"]])

    # -- parameter syncs left in flight --------------------------------------------------------

    def register_param_hooks(self, module: torch.nn.Module) -> list[ParamHooks]:
        """Overlaps the parameter sync of :meth:`step` with the next forward of ``module``.

        :meth:`step` then returns with each bucket's gather in flight, and the forward pre-hooks
        of ``module``'s submodules wait for the buckets of their parameters
        (see [Note: deferred parameter sync] in shardopt.functional). Read the parameters
        outside a forward only after :meth:`wait_params`; :meth:`state_dict`,
        :meth:`consolidate_state_dict` and the next :meth:`step` wait by themselves. Needs
        ``parameters_as_bucket_view=True`` or ``partition="flat"`` (the parameters must live in
        the flat buffers). Returns the handles (``remove()`` each to stop).

        Raises:
            ValueError: greedy partition without bucket views, or ``overlap_with_ddp=True``.
        """
        api = f"{API}.register_param_hooks"
        if self._overlap_with_ddp:
            raise ValueError(
                f"{api}: expected parameters_as_bucket_view=True or partition='flat' (and "
                "overlap_with_ddp=False), got overlap_with_ddp=True"
            )
        return [register_param_hooks(module, t) for t in self._backend.hook_targets(api)]

    def wait_params(self) -> None:
        """Waits until every parameter holds its value after the last :meth:`step`."""
        self._backend.wait_params()

    def _view_buffers(self) -> list[ParamBuffers]:
        return self._backend.view_buffers()

    @property
    def bucket_views(self) -> ParamBuffers | None:
        """The parameter buffers of the greedy partition with bucket views (None otherwise)."""
        return None if self._overlap_backend is None else self._overlap_backend.bucket_views

    @property
    def layout(self) -> ParamBuffers | None:
        """Renamed :attr:`bucket_views` (issue 39); warns, and goes in a later release."""
        warn_renamed(f"{API}.layout", f"{API}.bucket_views")
        return self.bucket_views

    # -- state dicts ([Note: state dicts without consolidation]) -------------------------------

    @fails_together(f"{API}.consolidate_state_dict")
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on group rank ``to`` ([Note: entries by gathers]);
        must be called on every rank. Afterwards :meth:`state_dict` works on rank ``to``."""
        agreed(
            f"{API}.consolidate_state_dict",
            lambda: checked_rank(to, self.world_size),
            self.process_group,
            lambda: self._default_device,
        )
        self.wait_params()
        self._saved.saving_on = None
        with on_device(self._default_device):
            state = self._backend.consolidate(self.param_groups, self._param_to_index, to=to)
        self._saved.consolidated = state

    @fails_together(f"{API}.consolidate_for_saving")
    def consolidate_for_saving(self, saving: bool) -> None:
        """Gathers the whole state on every rank that passes ``saving=True`` (one
        :meth:`consolidate_state_dict` per saving rank); must be called on every rank before a
        framework saves from some of them. There :meth:`state_dict` is the global state; on the
        others, the param groups and a "state" that raises when used."""
        with on_device(self._default_device):
            targets = ranks_with(saving, group=self.process_group)
        mine = None
        for to in targets:
            self.consolidate_state_dict(to=to)
            mine = self._saved.consolidated if to == self.rank else mine
        self._saved.consolidated = mine
        self._saved.saving_on = None if saving else targets

    def state_dict(self) -> dict[str, Any]:
        """The global state in torch.optim's format as of the last :meth:`consolidate_state_dict`
        (the param groups as they are now); where nothing needs gathering, on any rank.

        Raises:
            RuntimeError: the state was not consolidated on this rank.
        """
        state = self._saved.state(lambda: not self.optim.state, self._starts_stateless)
        self.wait_params()
        out = Optimizer.state_dict(self)
        out["state"] = state
        return out

    def _starts_stateless(self) -> bool:
        cls, defaults, device = self._optim_constructor, self._optim_defaults, self._default_device
        return bool(self._cached("stateless", lambda: starts_stateless(cls, defaults, device)))

    @fails_together(f"{API}.load_state_dict")
    def load_state_dict(self, state_dict: dict[str, Any], *, allow_nonfinite: bool = False) -> None:
        """Loads a global state dict (ours, torch's ZeroRedundancyOptimizer's or a plain
        torch.optim one over the same parameters): each rank keeps what it owns. Must be
        called on every rank, with the same dict.

        Every entry is checked first against what this optimizer makes ([Note: incoming
        state]): the keys a step creates, each tensor's shape, dtype and memory, the
        hyperparameters' types, step counts and second moments >= 0, every value finite. A
        refusal is raised on every rank together, and nothing is loaded.
        ``allow_nonfinite=True`` loads NaN and inf values (a diverged run, reloaded on purpose).

        Raises:
            ValueError: the param groups do not have this optimizer's sizes, or an entry or a
                hyperparameter is refused, on every rank.
        """
        api = f"{API}.load_state_dict"
        entries = agreed(
            api,
            lambda: (checked_load(api, self, state_dict, allow_nonfinite=allow_nonfinite), {}),
            self.process_group,
            lambda: self._default_device,
        )
        self._saved.changed(loaded_state=bool(state_dict["state"]))
        copy_hyperparameters(state_dict["param_groups"], self.param_groups)
        self._backend.load(state_dict["param_groups"], entries, wide_entries(state_dict))
        copy_hyperparameters(self.param_groups, self.optim.param_groups)

    @property
    def train(self) -> Callable[[], None]:
        """Switches every parameter on every rank to the local optimizer's train mode."""
        return self._mode_switch("train")

    @property
    def eval(self) -> Callable[[], None]:
        """Switches every parameter on every rank to the local optimizer's eval mode."""
        return self._mode_switch("eval")

    def _mode_switch(self, name: str) -> Callable[[], None]:
        backend, device = self._backend, self._default_device
        return mode_switch(name, self.optim, self.param_groups, backend, device)

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
