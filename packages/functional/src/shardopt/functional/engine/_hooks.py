"""The backward overlap: gradient hooks reduce each bucket as its gradients arrive (the forward
overlap, hooks that wait for parameters, is in _param_hooks.py)."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import Any

import torch

from shardopt.core.blocks import local_tensor
from shardopt.functional.engine._buckets import BucketKey
from shardopt.functional.engine._failure import failing_together
from shardopt.functional.engine._mesh import local_tensors
from shardopt.functional.engine._param_buffers import ParamBuffers
from shardopt.functional.engine._reduction import GradShards

__all__ = ["GradHooks", "GradReducer", "register_grad_hooks"]

# [Note: overlap with backward]
# Collectives must be entered in the same order on every rank, whatever order gradients arrive
# in. So buckets are reduced in one fixed order, the last bucket first (backward produces the last
# layers' gradients first), each launched as soon as its tensors and every bucket before it in
# that order have all their gradients. A bucket is a run of whole, adjacent tensors
# ([Note: plan layout] in shardopt.core), so it is ready at one point of backward, and its
# reduce-scatter runs while backward computes the buckets before it. At the end of each backward
# pass (an autograd engine callback) the buckets still waiting, those of parameters that got no
# gradient in that pass, are launched in the same order with zeros. Every backward pass therefore
# launches every bucket exactly once, on every rank. The callback then waits for the reductions,
# so ``backward()`` returns with the gradient shards complete, as DDP's returns with the
# gradients averaged: ``step`` is then the optimizer's work alone (compare it with torch's
# ``step``, which never includes DDP's all-reduce), and nothing is lost, for step would have
# waited first thing. ``GradHooks.launched_early`` reports the
# fraction of the last pass's elements launched while some gradient of the pass was still to
# come (before the last gradient hook): the part of the reduction that backward can hide.
#
# [Note: per-bucket hooks]
# torch calls a post-accumulate-grad hook once per parameter, so the hook itself is the one
# Python call per gradient; it does no more than mark the gradient present and count its
# bucket down (list updates in its own frame: no operator, no further call). The gradient that
# completes a bucket calls once more, to launch the buckets now ready in launch order; the
# launch reads the bucket's gradients in one list, packs them with one foreach copy
# (``GradShards.start_reduce``) and, at stage 2, frees them. Per bucket, not per gradient: the
# hooks cost about one Python call per gradient and a few operators per bucket.
#
# [Note: gradient presence]
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
# Without hooks, ``step`` reduces once: accumulate full local gradients over micro-steps (several
# ``backward`` calls into ``.grad``) and call ``step`` at the boundary (stage 1 with
# ``grads_averaged``: pass the averaged sum, e.g. from DDP's ``no_sync``). With gradient hooks
# every micro-step reduce-scatters: stage 2 accumulates into the gradient shard (the first pass
# after a step copies, later passes add; the full gradients are freed), so its gradient memory
# between micro-steps stays 1/W; stage 1 keeps ``.grad``, where autograd sums the passes, and
# each pass's reduction of that running sum replaces the shard. The cost is one reduction per
# micro-step instead of one per step. That is the point of stage 2
# (ZeRO-2 does the same). The shard then equals the sum over micro-steps of the rank-averaged
# gradients, which is what ``p.grad`` holds after the same ``backward`` calls on one process.
#
# [Note: one loop contract]
# A training loop must not have to change when the gradient hooks are added or dropped. Stage 2
# owns the full gradients once it reduces them: with hooks each one is freed as it is packed,
# and without hooks ``step`` (given grads=None, so reading ``.grad``) frees every ``.grad`` after
# reducing them. Either way ``.grad`` is None after ``step``, so a loop without ``zero_grad``
# trains the same with or without hooks, and ``zero_grad`` stays harmless. Stage 1 keeps the
# full gradients either way, as torch.optim does: its loop calls ``zero_grad`` (with or without
# hooks, a missed one sums the old gradient into the next step, as in torch).


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SET_GRAD = vars(torch._C.TensorBase)["grad"].__set__  # p.grad = None, as a function for map


class GradReducer:
    """Averages local gradients into its gradient shards (``grads``, [Note: gradient shards] in
    _reduction.py), bucket by bucket.

    Owned by the state of :func:`~shardopt.functional.shard` when it reduces gradients (stage 2,
    and stage 1 without ``grads_averaged``); see [Note: overlap with backward] and
    [Note: gradient accumulation]. With ``free_grads`` (stage 2) the hooks free each full
    gradient once it is packed.
    """

    def __init__(
        self, param_buffers: ParamBuffers, *, free_grads: bool, averaged: bool = False
    ) -> None:
        self.param_buffers = param_buffers
        self.grads = GradShards(param_buffers)
        self.free_grads = free_grads
        self.averaged = averaged  # [Note: one rank's gradients]: no hooks
        self.present = [False] * len(param_buffers.plan.tensors)
        self._ready = [False] * len(param_buffers.plan.tensors)
        self.accumulate = False
        self.launched_early = 0.0
        self._params: list[torch.Tensor] | None = None
        self._reset_pass()

    @property
    def shards(self) -> tuple[torch.Tensor, ...]:
        """This rank's averaged gradient shard of each group (compact)."""
        return self.grads.shards

    @property
    def direct(self) -> bool:
        """Whether a step without hooks takes the caller's gradients as they are: stage 1 of
        one rank with large tensors ([Note: one rank's gradients] in _reduction.py)."""
        return not self.free_grads and self.grads.direct

    @property
    def hooked(self) -> bool:
        """Whether gradient hooks feed this reducer."""
        return self._params is not None

    def reduce(self, grads: Sequence[torch.Tensor | None], *, views: bool = False) -> list[bool]:
        """Reduces full local ``grads`` (one per plan tensor) and returns which were present;
        ``views``: they are the shard's views ([Note: gradients in the shard]), already where
        the reduction would put them: nothing to do."""
        if views:
            return list(map(operator.is_not, grads, repeat(None)))
        for key in self.grads.order:
            self.grads.start_reduce(key, grads, accumulate=self.accumulate)
        self.present[:] = map(operator.is_not, grads, repeat(None))
        return self.finish()

    def finish(self) -> list[bool]:
        """Waits for every reduction in flight; returns which tensors had gradients, and resets."""
        if self._queued:
            raise RuntimeError("shard: step called during a backward pass")
        self.grads.finish_reduce()
        present = list(self.present)
        self.present[:] = [False] * len(present)  # in place: the hooks hold this list
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
        """Tensor ``i``'s hook: a few list updates and nothing else, unless it completes the
        next bucket to launch ([Note: per-bucket hooks])."""
        ready, present, left = self._ready, self.present, self.grads.left
        b = self.grads.position[i]

        def hook(p: torch.Tensor) -> None:
            del p
            if not self._queued:
                self._queue_end_of_backward()
            ready[i] = present[i] = True
            self._hooks_run += 1
            left[b] -= 1
            if not left[b]:  # the bucket's last gradient: launch what is ready, in order
                self._launch_ready()

        return hook

    def _reset_pass(self) -> None:
        params = self._params
        n = len(self.present)
        trainable = list(map(_REQUIRES_GRAD, params)) if params else [False] * n
        self._ready[:] = [False] * n  # in place: the hooks hold these lists
        self.grads.expect(trainable)  # counts each bucket's readiness
        self._queued = False
        self._hooks_run = 0
        self._launches: list[tuple[int, int]] = []  # (hooks run before it, elements)

    def _queue_end_of_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._queued = True

    def _launch_ready(self) -> None:
        """Launches the buckets that are ready, in order (the hook of a bucket's last gradient)."""
        with failing_together("register_grad_hooks"):
            for key in self.grads.take_ready():
                self._launch(key)

    def _launch(self, key: BucketKey) -> None:
        """Launches bucket ``key``'s reduction, counts it, and (stage 2) frees the full
        gradients it packed: the same few calls whatever the bucket's tensors (the loops over
        them run at C speed)."""
        params = self._params
        assert params is not None
        mine = self.param_buffers.of_bucket(key, params)
        grads = list(map(_GRAD, mine))  # of a DTensor parameter: its local tensor
        ready = self.param_buffers.of_bucket(key, self._ready) if self.free_grads else None
        if ready is not None and not all(ready):  # stage 2: this pass's gradients only
            grads = [g if r else None for g, r in zip(grads, ready)]  # (stage 1: the sum)
        grads = local_tensors(grads)
        self.grads.start_reduce(key, grads, accumulate=self.accumulate, of_bucket=True)
        self._launches.append((self._hooks_run, self.param_buffers.bucket(key).numel))
        if ready is not None:  # packed: free them
            deque(map(_SET_GRAD, compress(mine, ready), repeat(None)), maxlen=0)

    def _end_of_backward(self) -> None:
        with failing_together("register_grad_hooks"):
            for key in self.grads.unstarted():
                self._launch(key)
            self.grads.finish_reduce()  # backward returns with the shards complete, as DDP's
            total = sum(n for _, n in self._launches)
            early = sum(n for run, n in self._launches if run < self._hooks_run)
            self.launched_early = early / total if total else 0.0
            self._reset_pass()
            self.accumulate = self.free_grads  # stage 1 reduces the running sum: replace


class GradHooks:
    """The handle of :func:`register_grad_hooks`; :meth:`remove` takes the hooks off."""

    def __init__(self, reducer: GradReducer, handles: list[Any]) -> None:
        self._reducer = reducer
        self._handles = handles

    @property
    def launched_early(self) -> float:
        """The fraction of the last backward pass's reduce-scatter elements launched before
        its last gradient was produced (see [Note: overlap with backward])."""
        return self._reducer.launched_early

    def remove(self) -> None:
        """Removes the hooks; ``step`` then takes full local gradients again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._reducer.detach()


def register_grad_hooks(params: Sequence[torch.Tensor], state: Any) -> GradHooks:
    """Reduce-scatters gradients during backward, bucket by bucket, and frees the full ones.

    ``params`` are those given to ``init`` of a sharded transformation that reduces gradients
    (stage 2, or stage 1 without ``grads_averaged``) and ``state`` its state. After
    ``loss.backward()`` this rank's shard holds the averaged gradient; in stage 2 each trainable
    parameter's ``.grad`` is None again (freed once packed), in stage 1 it keeps the local
    gradient. Call ``step(params, None, state)``. Several backward passes before a step
    accumulate (see [Note: gradient accumulation]).

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
        ValueError: if ``state`` is not the state of a sharded transformation that reduces
            gradients, or ``params`` are not its parameters.
    """
    reducer: GradReducer = getattr(state, "reducer", None)  # type: ignore[assignment]
    attachable = callable(getattr(reducer, "attach", None))  # duck-typed: doctests reload modules
    if not attachable or reducer.averaged:
        raise ValueError(
            "register_grad_hooks: expected the state of a shard(...) that reduces gradients "
            f"(stage 2, or stage 1 without grads_averaged), got a {type(state).__name__} "
            "without a gradient reducer"
        )
    params = list(params)
    problem = state.param_buffers.check_views([local_tensor(p) for p in params])
    if problem is not None:
        raise ValueError(f"register_grad_hooks: expected {problem}")
    return GradHooks(reducer, reducer.attach(params))
