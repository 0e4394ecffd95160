"""Compiled updates: a transformation's update and apply, one compiled region per sharded state.

See [Note: compiled updates].
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Transformation
from shardopt.core.blocks import Scope, piece_rule, tree_leaves
from shardopt.functional.engine._collectives import all_reduce_op, comm_device
from shardopt.functional.engine._compiled_scalars import scalar_op, scalar_pass
from shardopt.functional.engine._masters import Masters, RemainderMaster, StoredMaster
from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = [
    "AUTO_NUMEL",
    "CompiledUpdate",
    "compile_blocker",
    "compiled_update",
    "planned_update",
]

# [Note: compiled updates]
# ``shard(..., compile=...)`` runs the rank's update through ``torch.compile`` (inductor: C++ on
# the CPU, Triton on CUDA). One ``CompiledUpdate`` per sharded state holds one compiled function, a
# fresh code object of its own (dynamo keeps its cache per code object: two ParamBuffers never share
# one, nor reach its recompile limit together). The function is ``tx.update`` followed by the
# apply, in place: ``p += u`` and each state tensor overwritten by its new value, over the
# rank's pieces (1-D views of the flat shards, and of the state's flat buffers), so inductor
# fuses every elementwise transformation of a chain into one pass over memory per piece.
#
# Reductions. A per-tensor or whole-tree transformation (LAMB's trust ratio, a global-norm clip)
# calls the reduction blocks, and they are traced too: the blocks read the scope from a global
# while dynamo traces (core's [Note: the scope under torch.compile]), and the shard reducer's
# all-reduce is a functional collective in the graph (``ShardReducer``), so a chain with a
# global-norm clip is one graph, the reduction's small all-reduce inside it. The reducer counts
# its calls in eager steps only (a count a graph would guard on would recompile every step).
#
# Hyperparameters. A float hyperparameter is a constant of the graph; it never changes for a
# given ``tx``. A schedule reads the state's step counts (tensors), and ``inject_hyperparams``
# keeps its values as 0-d tensors: both are graph inputs, so a learning rate that changes every
# step never recompiles (checked: 0 graphs compiled over 100 steps of a warmup-cosine schedule).
# A step where some piece has no gradient runs eagerly (a None would change the graph's inputs).
#
# Float32 masters are updated in place as in the eager path, then rounded into the parameters
# before each gather. Master remainders: [Note: remainders in the graph].
#
# [Note: remainders in the graph]
# On CUDA, master remainders ([Note: master remainders] in _masters.py) are joined, updated and
# split inside the region: the function reads the bfloat16 parameter and the int16 remainder of
# each piece and writes both back, with no float32 temporary in memory. On the CPU they are not:
# inductor's C++ code has no vectors of 16-bit integers (int16 is not among its vectorizable
# dtypes), so a loop that loads or stores the remainders runs one element at a time, and the
# fused step took 2.1x the float32 masters' (eager remainders: 1.5x). There the remainder groups
# are joined into float32 views before the call, as the eager path does (vectorized windows),
# updated by the compiled region, and split before each gather (``joins_in_graph``; measured:
# docs/performance.md).
#
# Equality with the eager path. It is not bitwise in general, and not within 1 ulp: torch's
# eager CPU kernels fuse a multiply and an add (``lerp``, ``addcmul``, ``add`` with ``alpha``)
# where inductor's C++ does not (it compiles with -ffp-contract=off), and inductor multiplies by
# the reciprocal of a constant divisor; each such operation rounds differently, and Adam's chain
# of them compounds. Measured per step from the same state (tests/compiled), in float32 ulps of
# the larger of the old and new eager value: parameters (or float32 masters) within 4, the state
# within 8 (Adam's moments), for AdamW from blocks (global-norm clip, schedule), built-in AdamW
# (against torch's fused kernel) and remainders (within 2); bitwise for Lion, whose sign and
# products round alike. Over many steps the paths drift apart as any two kernels do.
#
# Choice. ``compile="auto"`` (the default) compiles where a compiler is available (dynamo on this
# Python; a C++ compiler for the CPU, Triton for CUDA), the transformation has no registered flat
# rule (built-in adamw, sgd, ... already run torch's fused or foreach kernels, bitwise equal to
# torch.optim's; see docs/compiled.md for the measured ratio) and the plan's largest shard holds
# at least ``AUTO_NUMEL`` elements (every rank decides alike, the compiler's presence agreed by
# one small all-reduce at init: a rank compiling alone would wait alone in the first step's
# agreement): the first step compiles, which takes seconds to tens of seconds (more
# on a loaded CPU), and below that size an eager step costs so little that the compile time
# would not pay back within a short run. ``True`` compiles whatever the size; ``False`` never.
# Compiling is impossible without torch.compile, on a Python that dynamo does not support,
# without a C++ compiler (CPU) or Triton (CUDA), or where the first compile fails (an
# unsupported op): ``True``, and ``"auto"`` on a large shard, then warn once, naming why, and run
# eagerly. A failed first compile restores the parameters and state it may have changed (from
# copies made for that first step) before the eager step, and the ranks agree on the fallback.
#
# Caching. Inductor's FX-graph cache (on by default since torch 2.5; its directory is
# TORCHINDUCTOR_CACHE_DIR) keeps the compiled kernels across processes, so a second run with the
# same sharded state compiles faster; dynamo still traces every run.

AUTO_NUMEL = 1 << 20  # elements of the plan's largest shard from which "auto" compiles
_IDS = itertools.count()
_UPDATES: weakref.WeakKeyDictionary[ParamBuffers, CompiledUpdate] = weakref.WeakKeyDictionary()


def compile_blocker(device: torch.device) -> str | None:
    """Why updates on ``device`` cannot be compiled here, or None."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    from torch import _dynamo

    supported = getattr(_dynamo, "is_dynamo_supported", lambda: True)
    if not supported():
        version = ".".join(map(str, sys.version_info[:2]))
        return f"torch {torch.__version__}'s dynamo does not support Python {version}"
    if device.type == "cpu":
        names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(n and shutil.which(n) for n in names):
            return "no C++ compiler (g++, c++, clang++ or $CXX) on PATH for inductor's CPU code"
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is not installed (inductor's CUDA code needs it)"
    else:
        return f"inductor has no code generation for device {device.type!r} here"
    return None


def _join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 masters of bfloat16 ``hi`` and int16 ``lo`` ([Note: master remainders])."""
    top = hi.view(torch.int16).to(torch.int32)
    return (lo.to(torch.int32) + top * 65536).view(torch.float32)


def _split_into(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``x`` (float32) split into ``hi`` (bfloat16, ties away from zero) and ``lo`` (int16)."""
    bits = x.view(torch.int32)
    lo.copy_(bits.to(torch.int16))
    hi.view(torch.int16).copy_(((bits + 0x8000) >> 16).to(torch.int16))


def _body(tx: Transformation) -> Callable[..., None]:
    def shardopt_update(
        params: list[torch.Tensor],
        rems: list[torch.Tensor | None],
        grads: list[torch.Tensor],
        state: Any,
    ) -> None:
        work = [p if r is None else _join(p, r) for p, r in zip(params, rems)]
        grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
        updates, new_state = tx.update(grads, state, work)
        for p, r, w, u in zip(params, rems, work, updates):
            if r is None:
                p.add_(u.to(p.dtype))
            else:
                _split_into(w + u.to(w.dtype), p, r)
        for old, new in zip(tree_leaves(state), tree_leaves(new_state)):
            if isinstance(old, torch.Tensor) and old is not new:
                old.copy_(new)

    return shardopt_update


def _own_code(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with a code object of its own (dynamo's cache is per code object)."""
    name = f"shardopt_update_{next(_IDS)}"
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compile(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` compiled for fixed shapes (a sharded state's never change), its scalars computed once
    ([Note: scalars computed once] in _compiled_scalars.py). The first torch.compile of a
    process imports torch's compiler stack, whose TorchScript leftovers warn of their own
    deprecation (not the caller's concern)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
        hoist = scalar_pass()
        if hoist is None:
            return torch.compile(fn, dynamic=False)
        scalar_op()
        return torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": hoist})


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledUpdate:
    """The compiled update of one sharded state (see [Note: compiled updates]).

    ``compile_seconds``: the first step's time (compiling included); ``graphs``: graphs compiled
    by the first step (1 where nothing broke the graph); ``recompiles``: graphs compiled by later
    steps (0 unless the inputs changed, e.g. a new pattern of None gradients); ``fallback``: why
    it runs eagerly, or None.
    """

    def __init__(
        self, tx: Transformation, param_buffers: ParamBuffers, scope: Scope | None
    ) -> None:
        self.param_buffers, self.calls = param_buffers, 0
        self.compile_seconds: float | None = None
        self.graphs = self.recompiles = 0
        self.fallback: str | None = None
        self.scope = scope
        device = param_buffers.buffers[0].device if param_buffers.buffers else torch.device("cpu")
        self.joins_in_graph = device.type != "cpu"  # [Note: remainders in the graph]
        self._fn = _compile(_own_code(_body(tx)))

    @property
    def active(self) -> bool:
        return self.fallback is None

    def run(
        self,
        inner: Any,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        master: Masters,
    ) -> bool:
        """Updates the pieces in place; False (nothing changed) where the eager path must run:
        a fallback, or a piece without a gradient this step."""
        if self.fallback is not None or any(g is None for g in grads):
            return False
        targets, rems = self._targets(params, master)
        present = [g for g in grads if g is not None]
        if self.calls > 0:
            before = _graphs()
            with torch.no_grad():
                self._fn(targets, rems, present, inner)
            self.recompiles += _graphs() - before
            self.calls += 1
            return True
        return self._first(inner, targets, rems, present)

    def _targets(
        self, params: Sequence[torch.Tensor], master: Masters
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What each piece's update writes: the parameter (or its float32 master), and the
        remainder of a piece whose master is a remainder."""
        targets = list(params)
        rems: list[torch.Tensor | None] = [None] * len(params)
        if not self.joins_in_graph:  # joined eagerly, split by write_back before each gather
            keys = [
                k
                for k in self.param_buffers.keys
                if isinstance(master.groups[k[0]], RemainderMaster)
            ]
            master.views_for_update(targets, keys)
        for i, p in enumerate(self.param_buffers.pieces):
            group = master.groups[p.group]
            if isinstance(group, StoredMaster):
                targets[i] = group.stored[p.offset : p.offset + p.numel]
            elif isinstance(group, RemainderMaster) and self.joins_in_graph:
                rems[i] = group.stored[p.offset : p.offset + p.numel]
        return targets, rems

    def _first(
        self,
        inner: Any,
        targets: list[torch.Tensor],
        rems: list[torch.Tensor | None],
        grads: list[torch.Tensor],
    ) -> bool:
        """The compiling step: on a failure, the changed tensors are restored, every rank
        agrees, and the update runs eagerly from then on (one warning)."""
        mutable = [*targets, *(r for r in rems if r is not None)]
        mutable += [x for x in tree_leaves(inner) if isinstance(x, torch.Tensor)]
        saved = [t.clone() for t in mutable]
        error: BaseException | None = None
        start, before = time.perf_counter(), _graphs()
        try:
            with torch.no_grad():
                self._fn(targets, rems, grads, inner)
        except Exception as exc:  # any failure to compile: eager, after restoring
            error = exc
        self.compile_seconds = time.perf_counter() - start
        self.graphs = _graphs() - before
        self.calls = 1
        if _agreed(error is not None, self.param_buffers):
            with torch.no_grad():
                for t, s in zip(mutable, saved):
                    t.copy_(s)
            why = "another rank's compile failed" if error is None else _first_line(error)
            self.disable(f"the first compile failed ({why})")
            return False
        return True

    def disable(self, why: str) -> None:
        """Runs eagerly from now on, with one warning naming ``why``."""
        self.fallback = why
        warnings.warn(f"shard: compile: running the update eagerly: {why}", stacklevel=4)


def _agreed(failed: bool, param_buffers: ParamBuffers) -> bool:
    """Whether ``failed`` on any rank of the buffers' process group (one small all-reduce)."""
    group = param_buffers.group
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return failed
    device = comm_device(group, param_buffers.buffers[0].device if param_buffers.buffers else None)
    flag = torch.tensor([float(failed)], device=device)
    all_reduce_op(flag, dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def planned_update(
    tx: Transformation, param_buffers: ParamBuffers, mode: bool | str, whole: bool
) -> CompiledUpdate | None:
    """The compiled update of ``param_buffers`` under ``compile=mode``, or None where eager:
    ``False``; ``"auto"`` on a small shard or without a compiler; a transformation that needs
    whole tensors (its shaped update runs eagerly). ``True`` (and ``"auto"`` on a large shard)
    warns once where compiling is impossible, and returns None."""
    if mode is False:
        return None
    if whole:  # its shaped update runs eagerly ([Note: whole matrices] in _shard.py)
        if mode is True:
            warnings.warn(
                "shard: compile: running the update eagerly: the transformation needs whole "
                "tensors (Kind.SHAPED), whose update is not compiled",
                stacklevel=3,
            )
        return None
    # Every rank decides alike, or a compiled rank would wait alone in its first step's
    # agreement: by the plan's largest shard (not this rank's), and a compiler on every rank.
    owned = max(param_buffers.plan.numel_per_rank(), default=0)
    if mode == "auto" and (owned < AUTO_NUMEL or piece_rule(tx) is not None):
        return None  # small, or torch's fused kernels already (adamw, sgd, ...)
    blocker = compile_blocker(param_buffers.buffers[0].device) if param_buffers.buffers else None
    if _agreed(blocker is not None, param_buffers):
        why = blocker or "another rank cannot compile"
        warnings.warn(f"shard: compile: running the update eagerly: {why}", stacklevel=3)
        return None
    update = CompiledUpdate(tx, param_buffers, param_buffers.scope)
    _UPDATES[param_buffers] = update
    return update


def compiled_update(param_buffers: ParamBuffers) -> CompiledUpdate | None:
    """The compiled update of ``param_buffers`` (None: eager)."""
    return _UPDATES.get(param_buffers)
