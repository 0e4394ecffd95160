"""The compiled updates' post-grad pass that computes each per-step scalar once (see
[Note: scalars computed once]); used by _compiled.py."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["scalar_op", "scalar_pass"]

# [Note: scalars computed once]
# An update's per-piece scalars (Adam's bias corrections: float64 powers of the step count, a
# schedule's learning rate) are 0-d tensors, which inductor inlines into the elementwise loop
# that reads them: three float64 pow calls per vector of 8 floats made a compiled AdamW several
# times slower than torch's fused kernel on the CPU (measured: docs/performance.md). A post-grad
# pass puts each 0-d value read by a larger tensor behind ``shardopt::compiled_scalar`` (a copy,
# opaque to inductor), so it is computed once per step in its own small kernel and the loop
# reads it from memory (the same operations in the same dtypes).

_SCALAR = "compiled_scalar"


def scalar_op() -> Any:
    """``torch.ops.shardopt.compiled_scalar``, defined once per process."""
    namespace = torch.ops.shardopt
    if not hasattr(namespace, _SCALAR):
        op = torch.library.custom_op(
            f"shardopt::{_SCALAR}", _copy, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        op.register_fake(_copy_fake)
    return getattr(namespace, _SCALAR).default


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _hoist_scalars(graph: Any) -> None:
    """The pass of [Note: scalars computed once], on a post-grad FX graph."""
    op = scalar_op()
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() != 0:
            continue
        wide = [u for u in node.users if _numel(u) > 1]
        if not wide:
            continue
        with graph.inserting_after(node):
            kept = graph.call_function(op, (node,))
        kept.meta["val"] = val
        for user in wide:
            user.replace_input_with(node, kept)


def _numel(node: Any) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def scalar_pass() -> Any:
    """The pass as inductor's options take it: a CustomGraphPass, with a cache key (the FX-graph
    cache then keeps its graphs); None where torch has no such class (torch 2.4's options refuse
    a plain function there, and the scalars stay inlined: slower, the same values)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class HoistScalars(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            _hoist_scalars(graph)

        def uuid(self) -> str:
            return "shardopt-hoist-scalars-1"

    return HoistScalars()
