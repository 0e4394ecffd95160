"""Stage 2 gradient reduction: packing, bucketed reduce-scatters, and post-accumulate-grad hooks."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from shardopt.core import Plan
from shardopt.functional._collectives import (
    Algorithm,
    PendingQueue,
    ProcessGroup,
    reduce_scatter_grads,
)
from shardopt.functional._layout import Chunk, FlatLayout

__all__ = ["GradHooks", "GradReducer", "register_grad_hooks"]

# [Note: stage 2 reduction]
# A chunk (elements [start, stop) of every rank's slice of a group) is reduced by one
# reduce-scatter: its W blocks are packed from the gradients into a staging buffer (zeros where
# a gradient is missing or the layout has padding), summed over ranks in place, divided by W and
# copied into the persistent gradient shard of the rank. A group of several chunks has two
# staging buffers, used in turn, so that the packing of a chunk overlaps the reduction of the
# previous one (a chunk never needs more); a group of one chunk has one, and its reduction
# overlaps the packing of the next group's. Either way a staging buffer is bounded by
# ``bucket_numel``, not by the world size (see [Note: bucket size]).
#
# Collectives must be entered in the same order on every rank, whatever order gradients arrive
# in. So chunks are launched in one fixed order (the last chunk first: backward produces the last
# layers' gradients first), each as soon as it and every chunk before it in that order has all
# of its gradients. At the end of each backward pass (an autograd engine callback) the chunks
# still waiting, those of parameters that got no gradient in that pass, are launched in the same
# order with zeros. Every backward pass therefore launches every chunk exactly once, on every
# rank. With the flat layout a chunk holds elements from W places of the model (one per rank's
# slice), so chunks become ready during the last 1/W of backward: that is how much of backward
# the reduction overlaps.
#
# [Note: stage 2 presence]
# Each rank knows only which of its own gradients are None. A rank without a gradient that others
# have packs zeros, so the shard holds the rank average with the missing ones counted as zero
# (what DDP with find_unused_parameters computes). Whether a parameter is stepped at all (None:
# skipped like torch.optim) must be decided alike by the owners of all its pieces. When the step
# has its small all-reduce (``max_norm`` or ``skip_nonfinite``), per-tensor presence flags ride
# along and a parameter is stepped if any rank had its gradient. Without it each rank goes by its
# own flags, which is right when every rank has gradients for the same parameters (DDP's default
# requirement, met when every rank runs the same model on its batch).
#
# [Note: gradient accumulation]
# Stage 1 leaves gradients to the caller: accumulate full local gradients over micro-steps
# (DDP's ``no_sync``) and pass the averaged sum to ``step`` at the boundary. Stage 2 with hooks
# reduce-scatters at every micro-step and accumulates into the gradient shard (the first pass
# after a step copies, later passes add), so gradient memory between micro-steps stays 1/W; the
# cost is one reduction per micro-step instead of one per step. That is the point of stage 2
# (ZeRO-2 does the same). The shard then equals the sum over micro-steps of the rank-averaged
# gradients, which is what ``p.grad`` holds after the same ``backward`` calls on one process. The
# plain form (full local gradients passed to ``step``) reduces once per ``step``: callers who
# accumulate locally pass the accumulated sum.


class _ChunkCopies(NamedTuple):
    chunk: Chunk
    copies: tuple[tuple[int, int, int, int], ...]  # (tensor, src start, src stop, dst start)
    dense: bool  # the copies cover the whole staging block: no zeroing needed
    tensors: tuple[int, ...]


def _chunk_copies(plan: Plan, chunk: Chunk) -> _ChunkCopies:
    group = plan.groups[chunk.group]
    shard, n = group.shard_numel, chunk.numel
    copies, covered, tensors = [], 0, []
    for r in range(plan.world_size):
        lo, hi = r * shard + chunk.start, r * shard + chunk.stop
        k = max(bisect_right(group.offsets, lo) - 1, 0)
        while k < len(group.offsets) and group.offsets[k] < hi:
            t, begin = group.tensors[k], group.offsets[k]
            start, stop = max(begin, lo), min(begin + plan.tensors[t].numel, hi)
            if start < stop:
                copies.append((t, start - begin, stop - begin, r * n + start - lo))
                covered += stop - start
                tensors.append(t)
            k += 1
    unique = tuple(dict.fromkeys(tensors))
    return _ChunkCopies(chunk, tuple(copies), covered == plan.world_size * n, unique)


class GradReducer:
    """Reduces full local gradients into this rank's persistent gradient shards, chunk by chunk.

    Owned by the state of a stage 2 :func:`~shardopt.functional.shard`; see
    [Note: stage 2 reduction] and [Note: gradient accumulation]. ``shards[g]`` is the averaged
    gradient of this rank's slice of group ``g`` after :meth:`finish`.
    """

    def __init__(
        self,
        layout: FlatLayout,
        group: ProcessGroup,
        algorithm: Algorithm | str = Algorithm.AUTO,
    ) -> None:
        plan = layout.plan
        self.group = group
        self.algorithm = Algorithm(algorithm)
        self.world = plan.world_size
        self.shards = tuple(torch.zeros_like(layout.shard(g)) for g in range(len(plan.groups)))
        self.staging = layout.staging
        self.copies = tuple(_chunk_copies(plan, c) for c in layout.chunks)
        self.order = tuple(reversed(range(len(self.copies))))
        self.touching: list[list[int]] = [[] for _ in plan.tensors]
        for k, cp in enumerate(self.copies):
            for t in cp.tensors:
                self.touching[t].append(k)
        self.present = [False] * len(plan.tensors)
        self.accumulate = False
        self._queue = PendingQueue()
        self._next_slot = [0] * len(plan.groups)
        self._params: list[torch.Tensor] | None = None
        self._reset_pass()

    # -- the plain form -------------------------------------------------------------------------

    @property
    def hooked(self) -> bool:
        """Whether gradient hooks feed this reducer."""
        return self._params is not None

    def reduce(self, grads: Sequence[torch.Tensor | None]) -> list[bool]:
        """Reduces full local ``grads`` (one per plan tensor) and returns which were present."""
        for k in self.order:
            self._launch(k, grads.__getitem__)
        self.present = [g is not None for g in grads]
        return self.finish()

    def finish(self) -> list[bool]:
        """Waits for every reduction in flight; returns which tensors had gradients, and resets."""
        if self._queued:
            raise RuntimeError("shard: step called during a backward pass")
        self._queue.wait_all()
        present, self.present = self.present, [False] * len(self.present)
        self.accumulate = False
        return present

    # -- the hook form --------------------------------------------------------------------------

    def attach(self, params: Sequence[torch.Tensor]) -> list[Any]:
        """Registers a post-accumulate-grad hook on every trainable parameter; returns handles."""
        if self._params is not None:
            raise ValueError("register_grad_hooks: expected no hooks yet, got hooks registered")
        self._params = list(params)
        self._reset_pass()
        return [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self._params)
            if p.requires_grad
        ]

    def detach(self) -> None:
        """Forgets the parameters of :meth:`attach` (their hooks are removed by the caller)."""
        self._params = None
        self._reset_pass()

    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            del p
            self._on_grad(i)

        return hook

    def _reset_pass(self) -> None:
        params = self._params or []
        trainable = [p.requires_grad for p in params]
        self._ready = [False] * len(self.present)
        self._remaining = [
            sum(1 for t in cp.tensors if trainable and trainable[t]) for cp in self.copies
        ]
        self._outstanding = [len(ks) for ks in self.touching]
        self._pos = 0
        self._queued = False

    def _on_grad(self, i: int) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self._ready[i] = self.present[i] = True
        for k in self.touching[i]:
            self._remaining[k] -= 1
        while self._pos < len(self.order) and self._remaining[self.order[self._pos]] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        assert self._params is not None
        k = self.order[self._pos]
        self._pos += 1
        self._launch(k, self._ready_grad)
        for t in self.copies[k].tensors:
            self._outstanding[t] -= 1
            if self._outstanding[t] == 0 and self._ready[t]:
                self._params[t].grad = None  # packed everywhere it goes: free it

    def _ready_grad(self, t: int) -> torch.Tensor | None:
        assert self._params is not None
        return self._params[t].grad if self._ready[t] else None

    def _end_of_backward(self) -> None:
        while self._pos < len(self.order):
            self._launch_next()
        self._reset_pass()
        self.accumulate = True

    # -- packing and launching ------------------------------------------------------------------

    def _launch(self, k: int, grad_of: Callable[[int], torch.Tensor | None]) -> None:
        cp = self.copies[k]
        g, n = cp.chunk.group, cp.chunk.numel
        buffers = self.staging[g]
        assert buffers is not None  # a stage 2 layout stages every group
        slot = self._next_slot[g]
        self._next_slot[g] = (slot + 1) % len(buffers)
        self._queue.release((g, slot))  # in launch order: completions stay ordered
        staging = buffers[slot, : self.world * n]
        grads = {t: grad_of(t) for t in cp.tensors}
        if not cp.dense or any(v is None for v in grads.values()):
            staging.zero_()
        for t, s0, s1, d0 in cp.copies:
            grad = grads[t]
            if grad is not None:
                staging[d0 : d0 + s1 - s0].copy_(grad.view(-1)[s0:s1])
        out = self.shards[g][cp.chunk.start : cp.chunk.stop]
        pending = reduce_scatter_grads(
            staging,
            out,
            accumulate=self.accumulate,
            group=self.group,
            async_op=True,
            algorithm=self.algorithm,
        )
        self._queue.push((g, slot), pending)


class GradHooks:
    """The handle of :func:`register_grad_hooks`; :meth:`remove` takes the hooks off."""

    def __init__(self, reducer: GradReducer, handles: list[Any]) -> None:
        self._reducer = reducer
        self._handles = handles

    def remove(self) -> None:
        """Removes the hooks; ``step`` then takes full local gradients again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._reducer.detach()


def register_grad_hooks(params: Sequence[torch.Tensor], state: Any) -> GradHooks:
    """Reduce-scatters gradients during backward, bucket by bucket, and frees the full ones.

    ``params`` are those given to ``init`` of a stage 2 sharded transformation and ``state`` its
    state. After ``loss.backward()`` each trainable parameter's ``.grad`` is None again and its
    averaged gradient lies in this rank's shard; call ``step(params, None, state)``. Several
    backward passes before a step accumulate (see [Note: gradient accumulation]).

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import plan_partition, sgd
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> params = list(model.parameters())
        >>> sharded = shard(sgd(0.5), plan_partition(params, 1), stage=2)
        >>> state = sharded.init(params)
        >>> hooks = register_grad_hooks(params, state)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> params[0].grad is None  # reduced into this rank's shard, then freed
        True
        >>> state = sharded.step(params, None, state)
        >>> hooks.remove()
        >>> dist.destroy_process_group()

    Raises:
        ValueError: if ``state`` is not the state of a stage 2 sharded transformation, or
            ``params`` are not its parameters.
    """
    reducer: GradReducer = getattr(state, "reducer", None)  # type: ignore[assignment]
    if not callable(getattr(reducer, "attach", None)):  # duck-typed: doctests reload modules
        raise ValueError(
            "register_grad_hooks: expected the state of a stage 2 shard(...), got a "
            f"{type(state).__name__} without a gradient reducer"
        )
    params = list(params)
    problem = state.layout.check_views(params)
    if problem is not None:
        raise ValueError(f"register_grad_hooks: expected {problem}")
    return GradHooks(reducer, reducer.attach(params))
