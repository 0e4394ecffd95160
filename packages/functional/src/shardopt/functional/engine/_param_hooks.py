"""The forward overlap: forward pre-hooks that wait for the parameter all-gathers ``step`` left
in flight, bucket by bucket (the backward overlap is in _hooks.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._compiled_wait import compiled_wait, hook_ancestors
from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["ParamHooks", "register_param_hooks", "wait_params"]

# [Note: compiled forward]
# Dynamo traces the forward pre-hooks of register_param_hooks with the forward. A wait that breaks
# the graph costs more than one break: dynamo cannot resume inside a nested call, so the break
# splits every frame on the stack, and one inside a loop (over a model's blocks) makes it run the
# loop's whole frame eagerly, compiling each module called from it as a graph of its own. So a
# hook's traced path must hold no break. The ParamBuffers keeps a frontier ``synced``: no bucket
# before it has a gather in flight. Gathers launch in bucket order, so a module whose parameters lie
# in the first ``end`` buckets waits, in order, for those still in flight among them (they land
# first anyway); its hook tests ``synced < end``, which dynamo traces as a guard on one int and
# nothing else once synced. Under dynamo a hook that must wait puts the wait in the graph: one op
# ``shardopt::param_wait`` per parameter of those buckets, under no_grad, declared as mutating
# the parameter. The first waits; the mutation orders every later read of the parameter after
# it, in the graph as traced and through functionalizing backends (aot_eager, inductor), which
# may pass the op a copy: it then fills the copy. A compiled forward is one graph per frontier
# at entry (two in a training loop: the first forward, and the others with gathers in flight),
# whatever the buckets, modules and forward order (tied weights, a module called twice). Where
# the op cannot serve (DTensor parameters; torch 2.4, unless its dynamo config
# ``inline_inbuilt_nn_modules`` is set, puts torch's own modules in the graph whole and traces
# only some hooks), the wait is a ``torch.compiler.disable`` call instead: one graph break per
# bucket at most, with the splitting above. On torch 2.4 a no-op hook on every module containing
# hooked ones makes dynamo trace them, or their hooks would run at compile time only. Register
# the hooks before the first compiled forward: dynamo does not guard on a module's hooks.


class ParamHooks:
    """The handle of :func:`register_param_hooks`; :meth:`remove` takes the hooks off."""

    def __init__(self, param_buffers: ParamBuffers, handles: list[Any]) -> None:
        self._param_buffers = param_buffers
        self._handles = handles

    def remove(self) -> None:
        """Waits for the parameters, removes the hooks; ``step`` then waits for its gathers."""
        self._param_buffers.wait_params()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._param_buffers.defer_param_syncs(False)


def _param_buffers_of(api: str, state: Any) -> ParamBuffers:
    param_buffers = getattr(state, "param_buffers", None)
    # duck-typed: doctests reload modules
    if not callable(getattr(param_buffers, "wait_params", None)):
        raise ValueError(f"{api}: expected the state of a shard(...), got a {type(state).__name__}")
    return param_buffers  # type: ignore[return-value]


def register_param_hooks(module: torch.nn.Module, state: Any) -> ParamHooks:
    """Overlaps the parameter all-gather of ``step`` with the next forward.

    While registered, ``step`` launches each bucket's all-gather as soon as its shard is updated
    and returns without waiting; a forward pre-hook on each submodule of ``module`` that holds
    parameters of ``state`` waits for the buckets of those parameters (and the buckets before
    them). Parameters read outside a forward must be waited for with :func:`wait_params` (see
    [Note: deferred parameter sync]). Under ``torch.compile`` the waits are in the graph where
    torch allows it, else each is one graph break: register before the first compiled forward
    (see [Note: compiled forward]).

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import plan_partition, sgd
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.ones_(model.weight)
        >>> params = list(model.parameters())
        >>> sharded = shard(sgd(0.5), plan_partition(params, 1))
        >>> state = sharded.init(params)
        >>> hooks = register_param_hooks(model, state)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> state = sharded.step(params, None, state)  # returns with the gathers in flight
        >>> wait_params(state)  # before reading the parameters outside a forward
        >>> params[0].detach()
        tensor([[0.5000, 0.5000]])
        >>> hooks.remove()
        >>> dist.destroy_process_group()

    Raises:
        ValueError: if ``state`` is not the state of a sharded transformation, or ``module``
            holds none of its parameters.
    """
    param_buffers = _param_buffers_of("register_param_hooks", state)
    places = _places(param_buffers)
    compiled = compiled_wait(param_buffers, list(module.parameters()), places)
    handles, hooked = [], []
    for sub in module.modules():
        found = [places[a] for a in map(_address, sub.parameters(recurse=False)) if a in places]
        if found:
            end = 1 + max(b for _, b in found)  # wait through the last bucket it reads
            handles.append(sub.register_forward_pre_hook(_waiter(param_buffers, end, compiled)))
            hooked.append(sub)
    if not handles:
        raise ValueError(
            "register_param_hooks: expected a module holding parameters of the state, got a "
            f"{type(module).__name__} holding none"
        )
    handles += hook_ancestors(module, hooked)  # torch 2.4: see [Note: compiled forward]
    param_buffers.defer_param_syncs(True)
    return ParamHooks(param_buffers, handles)


def _places(param_buffers: ParamBuffers) -> dict[int, tuple[int, int]]:
    """(plan tensor, index of its bucket in ``param_buffers.keys``) by its elements' address."""
    out = {}
    for t, spec in enumerate(param_buffers.plan.tensors):
        g, b, _ = param_buffers.plan.locate(t)
        if spec.numel:
            out[param_buffers.address_of(t)] = (t, param_buffers.keys.index((g, b)))
    return out


def _address(p: torch.Tensor) -> int:
    """Where ``p``'s elements are (a DTensor parameter's: its local tensor's)."""
    return local_tensor(p).data_ptr()


def _waiter(
    param_buffers: ParamBuffers, end: int, compiled: Callable[[int], None]
) -> Callable[..., None]:
    """The forward pre-hook of a module whose parameters lie in the first ``end`` buckets."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        del module, args
        if param_buffers.synced < end:  # traced: a guard on an int, nothing else when synced
            if torch.compiler.is_compiling():
                compiled(end)
            else:
                param_buffers.wait_params_through(end)

    return hook


def wait_params(state: Any) -> None:
    """Waits until every parameter of ``state`` holds its value after the last ``step``.

    Needed only with :func:`register_param_hooks`, before reading parameters outside a forward
    (evaluation, logging, saving by hand); a no-op when nothing is in flight. See
    [Note: deferred parameter sync].
    """
    _param_buffers_of("wait_params", state).wait_params()
