"""partition='flat': ZeroRedundancyOptimizer's local optimizer as shardopt.functional shards."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from shardopt.core import (
    InjectHyperparamsState,
    Plan,
    Transformation,
    inject_hyperparams,
    muon,
    newton_schulz_flops,
    plan_partition,
    set_hyperparams,
)
from shardopt.core.blocks import needs_whole_tensors
from shardopt.functional import ShardedState, ShardedTransformation, shard
from shardopt.functional.engine import ProcessGroup, init_values, probe_fields, shaped
from shardopt.optim._core_mapping import plan_local_optimizer
from shardopt.optim.zero._backend import rebind_moved
from shardopt.optim.zero._core_state import (
    consolidate_flat,
    load_flat,
    piece_entries,
)
from shardopt.optim.zero._params import API

__all__ = ["DDP_AVERAGED", "CoreShardOptimizer", "Wire", "torch_defaults"]


Factory = Callable[..., Transformation]

# [Note: the flat local optimizer]
# With partition="flat", ``zero.optim`` is a CoreShardOptimizer. Each param group is one
# ``shardopt.functional.shard(tx, plan_partition(group's params, W, strategy="flat"), stage=1)``,
# ``tx`` being ``inject_hyperparams(factory, **hyperparameters)`` of the shardopt.core factory of
# the torch.optim class (``plan_local_optimizer``) and the group's hyperparameters, which so live
# in the state ([Note: hyperparameters in the state] in shardopt.core): equal slices of one flat
# buffer per dtype, parameters cut between ranks where the slices fall, one parameter all-gather
# per group and dtype. It reads like a torch.optim.Optimizer over this rank's slice:
# - ``param_groups[i]``: the group's hyperparameters, with every key torch's class fills in, and
#   ``"params"``: 1-D views of the pieces of parameters this rank updates (plan order).
# - ``state``: piece view -> {torch's state name: view of the piece's state}, for the pieces
#   torch would have state for (stepped at least once; Adagrad: always). A snapshot of views,
#   rebuilt on each access: writing into its tensors writes the optimizer's state.
# - ``step()``: each group's hyperparameters are compared with those of the last step; on a
#   change (an LR scheduler, an edit of ``param_groups``, ``load_state_dict``) the new values go
#   into the state by ``set_hyperparams``: nothing is re-sharded or probed, the next update builds
#   the core transformation from them (closures), so a float lr stays a float and the update
#   stays torch's (a 0-d tensor lr would take torch's tensor-lr arithmetic). The state's tensors
#   are kept: same fields, same buffers. A change that would alter its fields (``momentum`` or
#   ``weight_decay`` from 0, ``amsgrad``, ``centered``) raises instead; one that changes only
#   the chain around them (AdamW's ``weight_decay`` to or from 0) re-seats the same fields in
#   the new chain's state (``_Unit.reseated``).
# Gradients: DDP's averaged ones (``grads_averaged=True``), read from ``p.grad``; nothing is
# reduced. With ``comm_dtype`` (a ``Wire``) each rank's ``p.grad`` is its local gradient instead
# (no DDP, or DDP with ``local_gradients_hook``, which sends nothing), and the shard reduces it
# as ``shard(..., comm_dtype=)`` does: each element rounded once into ``comm_dtype`` on the wire,
# summed in float32 by its owner ([Note: wire dtype] in shardopt.functional), over the mesh's
# replicas too.
# Muon and Adafactor need whole matrices (core's [Note: whole tensors]): their groups get a greedy
# plan instead, each rank owning whole parameters balanced by the update's cost (Newton–Schulz
# flops for Muon, elements for Adafactor), on the same engine (shardopt.functional's [Note: whole
# matrices]); ``params`` and ``state`` then hold views in the parameters' shapes, and the state
# includes Adafactor's ``row_var``/``col_var``/``variance`` ([Note: shaped state]).


def torch_defaults(
    optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any], like: torch.Tensor
) -> dict[str, Any]:
    """The defaults torch's class fills into every param group, validated by torch itself.

    Example:
        >>> sorted(torch_defaults(torch.optim.SGD, {"lr": 0.1}, torch.zeros(1)))[:3]
        ['dampening', 'differentiable', 'foreach']
    """
    # a matrix (torch.optim.Muon takes no other), without elements
    probe = torch.zeros(0, 0, dtype=like.dtype, device=like.device, requires_grad=True)
    return dict(optimizer_class([probe], **defaults).defaults)


class Wire(NamedTuple):
    """How a flat unit gets its gradients: ``comm_dtype`` None takes DDP's averaged ones; a
    dtype reduces the local ones over ``reduce_over`` (the constructor's ``process_group``: a
    group, a mesh or None) on a wire of that dtype."""

    comm_dtype: torch.dtype | None = None
    reduce_over: Any = None


DDP_AVERAGED = Wire()  # the gradients DDP averaged: nothing reduced here


class _Unit:
    """One param group's shard: plan, sharded transformation and state, and what built them."""

    __slots__ = (
        "_initial",
        "factory",
        "fields",
        "hyper",
        "params",
        "pieces",
        "plan",
        "sharded",
        "state",
    )

    def __init__(
        self,
        params: list[torch.Tensor],
        plan: Plan,
        core: tuple[Factory, dict[str, Any]],
        hyper: dict[str, Any],
        group: ProcessGroup,
        wire: Wire,
    ) -> None:
        self.params, self.plan, self.hyper = params, plan, hyper
        self.factory, kwargs = core
        tx = inject_hyperparams(self.factory, **kwargs)
        local = wire.comm_dtype is not None  # local gradients, reduced here
        self.sharded: ShardedTransformation = shard(
            tx,
            plan,
            process_group=wire.reduce_over if local and wire.reduce_over is not None else group,
            stage=1,
            grads_averaged=not local,  # else DDP averaged them
            comm_dtype=wire.comm_dtype,
        )
        self.fields = self.structure(self.factory(**kwargs))
        self.state: ShardedState = self.sharded.init(params)
        buffers = self.state.param_buffers  # the step's views check re-seats moved parameters
        buffers.rebind = functools.partial(rebind_moved, buffers)  # [Note: re-seated parameters]
        self.pieces = self.state.param_buffers.param_views()
        self.pieces = shaped(self.state.param_buffers, self.pieces)  # whole tensors in their shapes
        self._initial: tuple[Any, dict[str, list[float]]] = (None, {})

    def structure(self, tx: Transformation) -> dict[str, Any]:
        """The fields of ``tx``'s state over this plan: path -> (kind, dtypes)."""
        shape = (2, 3) if self.plan.owners is not None else (2,)
        probes = [torch.zeros(shape, dtype=getattr(torch, g.dtype)) for g in self.plan.groups]
        found = probe_fields(tx, probes)
        return {path: (kind.value, dtypes) for path, (kind, dtypes) in found.items()}

    @property
    def initial(self) -> dict[str, list[float]]:
        """Each field's initial value per plan group under the current hyperparameters (computed
        on the first use after a change)."""
        hyper = self.state.inner.hyperparams
        if self._initial[0] is not hyper:
            tx = inject_hyperparams(self.factory, **hyper)
            dtypes = [getattr(torch, g.dtype) for g in self.plan.groups]
            shape = (2, 3) if self.plan.owners is not None else (2,)
            self._initial = (hyper, init_values(tx, dtypes, shape))
        return self._initial[1]

    def reseated(self, kwargs: dict[str, Any]) -> InjectHyperparamsState | None:
        """The state of ``inject_hyperparams(factory, **kwargs)`` over this rank's pieces with
        the current field tensors at the same paths; None if a field has no place in it, or the
        state has tensors outside fields (whole-tensor optimizers: Adafactor's row_var)."""
        n = len(self.pieces)
        if needs_whole_tensors(self.factory(**kwargs)):
            return None

        def is_field(x: Any) -> bool:
            return type(x) is list and len(x) == n

        empty = [torch.empty(0, dtype=v.dtype, device=v.device) for v in self.pieces]
        fresh = inject_hyperparams(self.factory, **kwargs).init(empty)
        old = pytree.tree_flatten_with_path(self.state.inner, is_leaf=is_field)[0]
        fields = {f.path for f in self.state.fields}
        current = {k: x for p, x in old if (k := pytree.keystr(p)) in fields}
        leaves, spec = pytree.tree_flatten_with_path(fresh, is_leaf=is_field)
        new = [current.pop(pytree.keystr(p), x) for p, x in leaves]
        return None if current else pytree.tree_unflatten(new, spec)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif x != y:
            return False
    return True


class CoreShardOptimizer:
    """``ZeroRedundancyOptimizer.optim`` under ``partition="flat"`` (see [Note: the flat local
    optimizer]): one shardopt.functional shard per param group, torch.optim-like attributes."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        group: ProcessGroup,
        world_size: int,
        wire: Wire = DDP_AVERAGED,
    ) -> None:
        self.optimizer_class = optimizer_class
        self.wire = wire
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self._units: list[_Unit | None] = []
        self._group = group
        self._world_size = world_size
        accepted = inspect.signature(optimizer_class.__init__).parameters
        self._arguments = frozenset(accepted) - {"self", "params"}

    def hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """The keys of ``group`` that the class's constructor takes (not ``initial_lr``, nor
        AdamW's ``decoupled_weight_decay``, which it sets itself)."""
        return {k: v for k, v in group.items() if k in self._arguments}

    def core(self, hyper: dict[str, Any]) -> tuple[Factory, dict[str, Any]]:
        """The core factory of the class and its arguments for ``hyper``; raises ValueError if
        none."""
        spec = plan_local_optimizer(self.optimizer_class, (), hyper)
        if spec.factory is None:
            unmapped = [
                f"{k}={v!r}"
                for k, v in hyper.items()
                if plan_local_optimizer(self.optimizer_class, (), {k: v}).factory is None
            ]
            raise ValueError(
                f"{API}: partition='flat' has no shardopt.core form of "
                f"{self.optimizer_class.__name__} with {', '.join(unmapped) or hyper}; use "
                "partition='greedy'"
            )
        return spec.factory, spec.factory_kwargs

    def build(self, hyper: dict[str, Any]) -> Transformation:
        """The core transformation of the class with ``hyper``; raises ValueError if none."""
        factory, kwargs = self.core(hyper)
        return factory(**kwargs)

    def prepare(self, group: dict[str, Any]) -> None:
        """Fills ``group`` (a ZeroRedundancyOptimizer group) with the class's defaults and checks
        that shardopt.core can run it, on its parameters' shapes for a whole-tensor optimizer
        (Muon: matrices only); local, so it raises before any collective."""
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        tx = self.build(self.hyperparameters(group))
        if needs_whole_tensors(tx):
            try:
                tx.init([torch.empty(p.shape, device="meta") for p in group["params"]])
            except ValueError as exc:
                raise ValueError(f"{API}: {exc}") from exc

    def plan(self, params: list[torch.Tensor], hyper: dict[str, Any]) -> Plan:
        """The group's plan: flat slices, or whole tensors balanced by the update's cost for an
        optimizer that needs them (see [Note: the flat local optimizer])."""
        factory, kwargs = self.core(hyper)
        if not needs_whole_tensors(factory(**kwargs)):
            return plan_partition(params, self._world_size, strategy="flat")
        cost = (lambda t: newton_schulz_flops(t.shape)) if factory is muon else None
        return plan_partition(params, self._world_size, strategy="greedy", cost=cost)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Shards ``group`` (a ZeroRedundancyOptimizer group, all keys filled); collective."""
        hyper = self.hyperparameters(group)
        params = list(group["params"])
        unit = None
        if params:
            plan = self.plan(params, hyper)
            unit = _Unit(params, plan, self.core(hyper), hyper, self._group, self.wire)
        self._units.append(unit)
        self.param_groups.append({**hyper, "params": [] if unit is None else unit.pieces})

    def _refresh(self, unit: _Unit, group: dict[str, Any]) -> None:
        """Puts changed hyperparameters of ``group`` into the unit's state (see [Note: the flat
        local optimizer])."""
        hyper = self.hyperparameters(group)
        if _same(hyper, unit.hyper):
            return
        current = unit.state.inner.hyperparams
        changed = [k for k in hyper if not _same({k: hyper[k]}, {k: unit.hyper.get(k)})]
        if hyper.keys() == unit.hyper.keys() and all(k in current for k in changed):
            changes = {k: hyper[k] for k in changed}
        else:  # a key the factory does not take (a kernel flag, one without a core form)
            changes = self.core(hyper)[1]
        try:
            inner = set_hyperparams(unit.state.inner, **changes)
        except ValueError:
            inner = self._restructured(unit, hyper)
        unit.state = unit.state._replace(inner=inner)
        unit.hyper = hyper

    def _restructured(self, unit: _Unit, hyper: dict[str, Any]) -> InjectHyperparamsState:
        """The unit's inner state for ``hyper``, which ``set_hyperparams`` refused: the factory's
        own error, the fields' change, or the same fields in another chain (re-seated)."""
        factory, kwargs = self.core(hyper)
        structure = unit.structure(factory(**kwargs))  # raises what the factory rejects
        reseated = unit.reseated(kwargs) if structure == unit.fields else None
        if reseated is None:
            changed = sorted(k for k in hyper if not _same({k: hyper[k]}, {k: unit.hyper.get(k)}))
            raise ValueError(
                f"{API}: partition='flat' cannot change {', '.join(changed)} of "
                f"{self.optimizer_class.__name__} in a way that changes its state (fields "
                f"{sorted(unit.fields)} would become {sorted(structure)}); set them at "
                "construction"
            )
        return reseated

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Runs ``closure`` (under grad mode), then updates and all-gathers every group."""
        if kwargs:
            raise TypeError(
                f"{API}.step: partition='flat' takes no extra step arguments, got {sorted(kwargs)}"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for unit, group in zip(self._units, self.param_groups):
            if unit is not None:
                self._refresh(unit, group)
                try:
                    unit.state = unit.sharded.step(unit.params, None, unit.state)
                except ValueError as exc:  # name the API the user called, not ours
                    message = str(exc).removeprefix("shard: ")
                    raise ValueError(f"{API}.step: {message}") from exc
        return loss

    def consolidate(
        self, index: dict[torch.Tensor, int], *, to: int
    ) -> dict[int, dict[str, Any]] | None:
        """The state of every group in torch's form, keyed by ``index[param]``, on rank ``to``
        (None elsewhere); collective."""
        ids = [[index[p] for p in ([] if u is None else u.params)] for u in self._units]
        return consolidate_flat(self._units, ids, to=to, group=self._group)

    def load(self, entries: dict[torch.Tensor, Any]) -> None:
        """Loads torch-form entries (param -> entry; a missing param starts afresh)."""
        for unit in self._units:
            if unit is not None:
                load_flat(unit, [entries.get(p) for p in unit.params])

    def units(self) -> list[_Unit | None]:
        """The shard of each param group (None for a group without parameters)."""
        return list(self._units)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Piece view -> its state under torch's names (see [Note: the flat local optimizer])."""
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for unit in self._units:
            if unit is None:
                continue
            for k, entry in piece_entries(unit.state).items():
                out[unit.pieces[k]] = entry
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients of the whole parameters of every group."""
        for unit in self._units:
            for p in [] if unit is None else unit.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def __repr__(self) -> str:
        sizes = [0 if u is None else sum(p.numel() for p in u.pieces) for u in self._units]
        return (
            f"CoreShardOptimizer({self.optimizer_class.__name__}, elements of this rank per "
            f"group: {sizes})"
        )
