"""ZeroRedundancyOptimizer on the engine: its parameter syncs and the forward overlap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardopt.core import Plan
from shardopt.functional import FlatLayout, ParamHooks, register_param_hooks
from shardopt.functional.engine import StagedSync, broadcast_tensors, build_layout
from shardopt.optim._zero_params import API

__all__ = ["EngineSync", "reseat"]


# [Note: greedy parameter sync]
# The greedy partition runs on shardopt.functional's engine ([Note: engine] there): its plan's
# buckets (runs of whole parameters, each laid out owner by owner, exact sizes: no padding to the
# largest rank) are the units of every sync.
# - parameters_as_bucket_view=True: the parameters are views of the engine's flat buffers; a
#   sync is one in-place broadcast per owner and bucket (one all-gather where the shards are
#   equal under NCCL), and ``register_param_hooks`` can leave it in flight until the next
#   forward ([Note: deferred parameter sync]).
# - False: the parameters keep their own storage, as torch's do; each bucket goes through a
#   staging buffer of the bucket's size, and a parameter alone in its bucket is broadcast
#   straight from its storage ([Note: staged parameter sync]).
# - the DDP comm hooks sync the parameters of one DDP bucket at a time: one broadcast per owner
#   and run of adjacent parameters (``broadcast_tensors``).
# Either way a sync costs one collective per owner and bucket, never one per parameter.

#
# [Note: re-seated parameters]
# With bucket views, and always under partition="flat", the parameters are views of the engine's
# flat buffers. ``module.to(device)`` to a device that is the same but compares unequal (HF
# Trainer moves the model to ``cpu:0`` while the parameters are on ``cpu``) copies each parameter
# and rebinds its ``.data``, leaving the buffers behind. Before each step, ``reseat`` copies such
# a parameter (same shape, dtype, device type and index) back into its place in the buffer and
# rebinds it to its view; a parameter moved anywhere else is left for the step to refuse
# (flat) or is not synced (greedy, as torch's).


def reseat(layout: FlatLayout, params: Sequence[torch.Tensor]) -> None:
    """Rebinds each of ``params`` (the layout's tensors, in order) that a same-device move copied
    out of the flat buffers back to its view there, with its current value (see
    [Note: re-seated parameters])."""
    for t, p in enumerate(params):
        g, _, offset = layout.plan.locate(t)
        buf, n = layout.buffers[g], p.numel()
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or n == 0:
            continue  # a DTensor's local tensor cannot be rebound here
        if p.data_ptr() == layout.address_of(t):
            continue
        same_device = (p.device.type, p.device.index or 0) == (
            buf.device.type,
            buf.device.index or 0,
        )
        if (
            not same_device
            or p.dtype != buf.dtype
            or tuple(p.shape) != layout.plan.tensors[t].shape
        ):
            continue
        view = buf[offset : offset + n].view(p.shape)
        with torch.no_grad():
            view.copy_(p.detach())
        p.data = view


class EngineSync:
    """The engine side of ZeroRedundancyOptimizer (mixed into it; see its docstring)."""

    _layout: FlatLayout | None
    _staged: StagedSync | None
    _cache: dict[str, Any]
    _overlap_with_ddp: bool
    _partition: Any
    optim: Any
    rank: int
    process_group: Any
    parameters_as_bucket_view: bool

    @property
    def _flat(self) -> bool:
        raise NotImplementedError

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def _param_to_index(self) -> dict[torch.Tensor, int]:
        raise NotImplementedError

    def _set_plan(self, plan: Plan) -> None:
        """Puts the parameters on the engine for ``plan`` (see [Note: greedy parameter sync])."""
        self._cache["plan"] = plan
        params, pg = self._index_to_param, self.process_group
        if self._layout is not None:
            self._layout.wait_params()
        if self.parameters_as_bucket_view:
            self._layout = build_layout(plan, params, self.rank, group=pg)
        else:
            self._staged = StagedSync(plan, params, self.rank, group=pg)

    def _sync_params(self) -> None:
        """Every parameter from its owner after a local step (left in flight with param hooks)."""
        if self._layout is not None:
            for key in self._layout.keys:
                self._layout.start_param_sync(key)
            if not self._layout.deferred:
                self._layout.wait_params()
        elif self._staged is not None:
            self._staged.sync()

    def _sync_params_of(self, params: Sequence[torch.Tensor], *, async_op: bool) -> list[Any]:
        """Starts the sync of just ``params`` from their owners; returns handles with ``wait()``
        (waited for already unless ``async_op``). Every rank passes the same parameters in the
        same order."""
        if self._flat:
            raise RuntimeError(f"{API}._sync_params_of: expected partition='greedy', got 'flat'")
        index = self._param_to_index
        tensors = []
        for i, p in enumerate(params):
            if p not in index:
                raise ValueError(
                    f"{API}._sync_params_of: expected parameters of this optimizer, got "
                    f"params[{i}] of shape {tuple(p.shape)} that it does not hold"
                )
            tensors.append(index[p])
        buffers = None if self._layout is None else self._layout.buffers
        handles = broadcast_tensors(
            self._cache["plan"],
            self._index_to_param,
            tensors,
            self.rank,
            buffers=buffers,
            group=self.process_group,
        )
        if not async_op:
            for handle in handles:
                handle.wait()
        return handles

    # -- overlap with the next forward ------------------------------------------------------------

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
        if self._overlap_with_ddp or (not self._flat and self._layout is None):
            raise ValueError(
                f"{API}.register_param_hooks: expected parameters_as_bucket_view=True or "
                "partition='flat' (and overlap_with_ddp=False), got "
                f"parameters_as_bucket_view={self.parameters_as_bucket_view}, "
                f"partition={self._partition.value!r}, overlap_with_ddp={self._overlap_with_ddp}"
            )
        if self._flat:
            states = [u.state for u in self.optim.units() if u is not None]
            return [register_param_hooks(module, st) for st in states]
        return [register_param_hooks(module, self)]

    def wait_params(self) -> None:
        """Waits until every parameter holds its value after the last :meth:`step`."""
        for layout in self._layouts():
            layout.wait_params()

    def _layouts(self) -> list[FlatLayout]:
        if self._flat:
            return [u.state.layout for u in self.optim.units() if u is not None]
        return [] if self._layout is None else [self._layout]

    @property
    def layout(self) -> FlatLayout | None:
        """The engine of the greedy partition with bucket views (None otherwise)."""
        return self._layout
