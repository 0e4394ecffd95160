"""What the parameter hooks do under ``torch.compile``: wait inside the graph, or break it once.

See [Note: compiled forward] in _param_hooks.py.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["compiled_wait", "hook_ancestors", "inlines_module_hooks"]

# (tensor, bucket index) of each parameter's address: what register_param_hooks maps
Places = dict[int, tuple[int, int]]
Entries = tuple[tuple[tuple[int, torch.Tensor], ...], ...]  # per bucket: (tensor, parameter)

_OP = "param_wait"
_SCHEMA = "(Tensor(a!) param, int layout, int tensor, int end) -> ()"
_LAYOUTS: weakref.WeakValueDictionary[int, ParamBuffers] = weakref.WeakValueDictionary()
_IDS = itertools.count()


def _registry() -> tuple[weakref.WeakValueDictionary[int, ParamBuffers], itertools.count[int]]:
    """The process's ParamBuffers by id, whichever copy of this file asks (doctest collection
    imports it a second time, under another name): the op and the hooks must share them."""
    from shardopt.functional.engine import _compiled_wait

    return _compiled_wait._LAYOUTS, _compiled_wait._IDS


def inlines_module_hooks() -> bool:
    """Whether dynamo traces the hooks of torch's own modules (torch >= 2.5, where the flag is
    always on and deprecated; torch 2.4 puts such a module in the graph whole, unless it has
    hooks itself, and its submodules' hooks then never run in a compiled graph)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated: always True
        config = torch._dynamo.config
        return bool(getattr(config, "inline_inbuilt_nn_modules", True))


def hook_ancestors(module: torch.nn.Module, hooked: Sequence[torch.nn.Module]) -> list[Any]:
    """Where dynamo would put torch's own modules in the graph whole (torch 2.4), a no-op forward
    pre-hook on every submodule of ``module`` that contains one of ``hooked`` and is not one of
    them makes it trace them instead, and so the hooks inside; returns the handles."""
    if inlines_module_hooks():
        return []
    mine = {id(m) for m in hooked}
    return [
        m.register_forward_pre_hook(_no_op)
        for m in module.modules()
        if id(m) not in mine and any(id(d) in mine for d in m.modules())
    ]


def _no_op(module: torch.nn.Module, args: Any) -> None:
    del module, args


def compiled_wait(
    param_buffers: ParamBuffers, params: Sequence[torch.Tensor], places: Places
) -> Any:
    """What a forward pre-hook calls, while dynamo traces it, to wait through bucket ``end``:
    ``wait(end)`` puts the wait in the graph where it can, else breaks the graph once."""
    found = [(places[a], p) for p in params if (a := local_tensor(p).data_ptr()) in places]
    if not inlines_module_hooks() or any(local_tensor(p) is not p for _, p in found):
        return _breaking_wait(param_buffers)
    all_param_buffers, ids = _registry()
    lid = next(ids)
    all_param_buffers[lid] = param_buffers
    per_bucket: list[list[tuple[int, torch.Tensor]]] = [[] for _ in param_buffers.keys]
    for (t, b), p in found:
        per_bucket[b].append((t, p))
    entries: Entries = tuple(tuple(e) for e in per_bucket)
    op = _param_wait_op()

    def wait(end: int) -> None:  # traced: one op per parameter of the buckets, no break
        with torch.no_grad():
            for b in range(param_buffers.synced, end):
                for t, p in entries[b]:
                    op(p, lid, t, end)
        param_buffers.synced = end  # what the ops do at run time, for the hooks traced after

    return wait


def _breaking_wait(param_buffers: ParamBuffers) -> Callable[[int], None]:
    def wait(end: int) -> None:
        _wait_through(param_buffers, end)

    return wait


@torch.compiler.disable
def _wait_through(param_buffers: ParamBuffers, end: int) -> None:
    """Not traced: the graph breaks here, and only here."""
    param_buffers.wait_params_through(end)


def _param_wait_op() -> Any:
    """``torch.ops.shardopt.param_wait``, defined once per process (doctest collection imports
    this file a second time under another name)."""
    namespace = torch.ops.shardopt
    if not hasattr(namespace, _OP):
        op = torch.library.custom_op(
            f"shardopt::{_OP}", _param_wait, mutates_args=("param",), schema=_SCHEMA
        )
        op.register_fake(_param_wait_fake)
    return getattr(namespace, _OP).default


def _param_wait(param: torch.Tensor, param_buffers: int, tensor: int, end: int) -> None:
    """Waits for the first ``end`` buckets, then makes ``param`` hold plan tensor ``tensor``:
    it is the parameter itself, or a copy that a functionalizing backend made before the call."""
    found = _registry()[0].get(param_buffers)
    if found is None:  # the hooks are gone with their ParamBuffers: nothing is in flight
        return
    if found.synced < end:
        found.wait_params_through(end)
    g, _, offset = found.plan.locate(tensor)
    value = found.buffers[g][offset : offset + param.numel()]
    if param.data_ptr() != value.data_ptr():
        param.copy_(value.view_as(param))


def _param_wait_fake(param: torch.Tensor, param_buffers: int, tensor: int, end: int) -> None:
    del param, param_buffers, tensor, end
