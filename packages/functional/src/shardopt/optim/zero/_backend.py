"""What ZeroRedundancyOptimizer asks of its partition: the backend Protocol, and re-seating."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from shardopt.functional import ParamBuffers

__all__ = ["OverlapBackend", "ZeroBackend", "reseat"]

# [Note: one backend]
# ZeroRedundancyOptimizer is one class over three backends, named by who computes the update.
# Its constructor picks one, once, from ``partition`` and the class:
# - TorchBackend (``_torch_backend.py``): the class itself, torch's local optimizer, over whole
#   parameters (partition="greedy");
# - CoreBackend (``_core_backend.py``): shardopt.core's form of the class, through ``shard``
#   (partition="flat"; on a greedy plan for Muon and Adafactor);
# - TorchSlicesBackend (``_torch_slices_backend.py``): the class itself over this rank's flat
#   slices, for a class without a core form that the probe finds elementwise (partition="flat").
# Nothing else branches on the partition. The class keeps what torch's has whatever the backend:
# the param groups, the cross-rank checks of its input, Join, the answers of ``state_dict``
# ([Note: state dicts without consolidation]) and the caches of torch's partition attributes.
# Every collective on parameters or optimizer state is the backend's, and each runs them on
# shardopt.functional's engine: TorchBackend syncs through a ParamBuffers (bucket views) or its
# staged storage and consolidates by the windowed gathers of [Note: entries by gathers];
# CoreBackend is ``shard`` itself; TorchSlicesBackend syncs through one ParamBuffers per param group
# and consolidates by the same gathers. What every backend does is ZeroBackend; stepping and
# syncing some parameters from the DDP hooks needs whole parameters per rank, an optional
# capability (OverlapBackend) that only TorchBackend has.


class ZeroBackend(Protocol):
    """A partition of ZeroRedundancyOptimizer's parameters (see [Note: one backend]).

    ``param_groups`` arguments are the optimizer's own groups (torch's format); the backend
    copies their hyperparameters to and from its local optimizer (``optim``).
    """

    optim: Any

    def prepare(self, group: dict[str, Any]) -> None:
        """Local checks of a new param group (raising before any collective)."""

    def start(self, param_groups: list[dict[str, Any]]) -> None:
        """Puts the constructor's groups on the engine (after the ranks agreed on them)."""

    def add_group(self, param_groups: list[dict[str, Any]]) -> None:
        """Shards the last of ``param_groups``, just added on every rank."""

    def step(
        self,
        param_groups: list[dict[str, Any]],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """Updates this rank's share and syncs every parameter; returns the loss."""

    def wait_params(self) -> None:
        """Waits until every parameter holds its value after the last step."""

    def sync_all(self) -> None:
        """Syncs every parameter from the ranks that own it (collective)."""

    def view_buffers(self) -> list[ParamBuffers]:
        """The engine's ParamBuffers whose parameters are views of flat buffers."""

    def hook_targets(self, api: str) -> list[Any]:
        """What ``register_param_hooks`` hooks (raises ValueError, naming ``api``, if none)."""

    def partition(self, param_groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Per rank, each group with the parameters the rank updates."""

    def owners(self, param_groups: list[dict[str, Any]]) -> dict[torch.Tensor, int]:
        """Parameter -> the rank that updates it."""

    def consolidate(
        self, param_groups: list[dict[str, Any]], index: dict[torch.Tensor, int], *, to: int
    ) -> dict[Any, Any] | None:
        """The whole state in torch's form, keyed by ``index`` (and the optimizer-wide entries
        by their own keys), on rank ``to``; collective."""

    def load(
        self,
        saved_groups: Sequence[dict[str, Any]],
        entries: dict[torch.Tensor, Any],
        wide: dict[Any, Any] | None = None,
    ) -> None:
        """Loads torch-form ``entries`` (param -> entry) of this rank's parameters and the
        optimizer-wide entries ``wide`` (see [Note: optimizer-wide state])."""


@runtime_checkable
class OverlapBackend(Protocol):
    """The optional capability of a backend that owns whole parameters: the DDP hooks step and
    sync some of them ([Note: one backend])."""

    @property
    def bucket_views(self) -> ParamBuffers | None:
        """The parameter buffers the parameters are views of (None without
        ``parameters_as_bucket_view``)."""

    def step_params(self, param_groups: list[dict[str, Any]], params: Sequence[Any]) -> None:
        """Updates those of ``params`` this rank owns, without a sync (the DDP hooks)."""

    def sync_params_of(self, params: Sequence[torch.Tensor], *, async_op: bool) -> list[Any]:
        """Starts the sync of just ``params`` from their owners (the DDP hooks)."""


# [Note: re-seated parameters]
# With bucket views, and always under partition="flat", the parameters are views of the engine's
# flat buffers. ``module.to(device)`` to a device that is the same but compares unequal (HF
# Trainer moves the model to ``cpu:0`` while the parameters are on ``cpu``) copies each parameter
# and rebinds its ``.data``, leaving the buffers behind. Before each step, ``reseat`` copies such
# a parameter (same shape, dtype, device type and index) back into its place in the buffer and
# rebinds it to its view (under partition="flat" the step's own views check runs it, as the
# ParamBuffers' ``rebind``, only when some parameter is out of place: one check per step, not
# two); a parameter moved anywhere else is left for the step to refuse
# (flat) or is not synced (greedy, as torch's).


def reseat(param_buffers: ParamBuffers, params: Sequence[torch.Tensor]) -> None:
    """Rebinds each of ``params`` (the plan's tensors, in order) that a same-device move copied out
    of the parameter buffers back to its view there, with its current value (see
    [Note: re-seated parameters])."""
    if param_buffers.check_views(params) is None:
        return  # the usual case: every parameter still a view of its buffer
    rebind_moved(param_buffers, params)


def rebind_moved(param_buffers: ParamBuffers, params: Sequence[torch.Tensor]) -> None:
    """``reseat`` without its first check: a ParamBuffers' ``rebind``, run by its views check
    only when some parameter is out of place (no second check per step)."""
    for t, p in enumerate(params):
        g, _, offset = param_buffers.plan.locate(t)
        buf, n = param_buffers.buffers[g], p.numel()
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or n == 0:
            continue  # a DTensor's local tensor cannot be rebound here
        if p.data_ptr() == param_buffers.address_of(t):
            continue
        same_device = (p.device.type, p.device.index or 0) == (
            buf.device.type,
            buf.device.index or 0,
        )
        if (
            not same_device
            or p.dtype != buf.dtype
            or tuple(p.shape) != param_buffers.plan.tensors[t].shape
        ):
            continue
        view = buf[offset : offset + n].view(p.shape)
        with torch.no_grad():
            view.copy_(p.detach())
        p.data = view
