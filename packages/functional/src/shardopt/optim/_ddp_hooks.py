"""DDP comm hooks that run a ZeroRedundancyOptimizer's step inside DDP's backward pass."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

# [Note: ending a doctest's group]
# The examples below run DDP in the calling process and end by destroying its group. A comm
# hook's future runs its callbacks on gloo's worker thread; were the last reference to the group
# dropped there (by DDP's reducer, freed after destroy_process_group), the group's destructor
# would join that very thread, and the process would abort ("Resource deadlock avoided", seen
# once in a CI run of the doctest). So the examples wait for the worker (a barrier) and free DDP
# and the optimizer on the calling thread before they destroy the group.

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

# [Note: overlap from the first iteration]
# torch's hooks partition the optimizer along DDP's buckets, so they wait until DDP has rebuilt
# its buckets (the second or third iteration) and skip the updates of the iterations before.
# Our ZeroRedundancyOptimizer partitions the parameters itself, once, at construction: each
# parameter has an owner whatever bucket it travels in. A bucket's hook therefore only needs the
# parameters that the bucket holds right now (``bucket.parameters()``): it lends them their
# reduced gradients, lets ``zero._step_params`` update those it owns and
# ``zero._sync_params_of`` send them to the others. Iteration 1 (one big bucket before the
# rebuild, or the delayed reduction of ``static_graph``) is handled like any later iteration.
#
# [Note: contract with ZeRO]
# The hooks use four things of ``zero``: ``_overlap_with_ddp``, ``_param_to_rank`` (to check
# that ddp and zero hold the same parameters), ``_step_params(params)`` (the local optimizer's
# update of the given parameters that this rank owns, with their current ``.grad``, touching no
# other parameter) and ``_sync_params_of(params, async_op=True)`` (starts the sync of the given
# parameters from their owners on ``zero.process_group``, returns the work handles). The hooks
# make one ``_step_params`` call at a time, so it may swap the local optimizer's param groups.
# A fifth, ``_steps_per_bucket``, says whether ``zero``'s class may be stepped bucket by bucket
# (torch.optim's per-parameter classes: [Note: stepping per bucket] in zero/_classes.py); when it
# is False (or missing) the hooks wait for every bucket's reduction and make one
# ``_step_params`` call with all the parameters, which is the local optimizer's one ``step()``
# of the iteration: a class that counts per call (a group's ``step``, schedule-free's ``k``,
# lookahead, MADGRAD's ``k``, Prodigy's sums) then steps as under ``zero.step()``.


class _OverlapZero(Protocol):
    """What the hooks need of a ZeroRedundancyOptimizer (see [Note: contract with ZeRO])."""

    _overlap_with_ddp: bool
    process_group: Any

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]: ...

    def _step_params(self, params: list[torch.Tensor]) -> None: ...

    def _sync_params_of(self, params: list[torch.Tensor], *, async_op: bool) -> list[Any]: ...


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: _OverlapZero,
    shard_buckets: bool = False,
) -> CommHook:
    """Wraps a DDP comm hook so that the ZeRO step runs at the end of DDP's backward pass.

    ``hook`` reduces each bucket as usual. Once the last bucket's gradients are computed, the
    returned hook takes the buckets in order: it waits for the bucket's reduction, updates the
    bucket's parameters that this rank owns and starts their sync from their owners, so that a
    bucket's update overlaps the reductions and syncs still under way; all syncs are done
    before backward returns. Unlike torch's, it updates from the first iteration on (see
    [Note: overlap from the first iteration]), runs any optimizer ``zero`` was built with (a
    class other than torch.optim's per-parameter ones in one step per iteration, after the
    last reduction: [Note: contract with ZeRO]), and works on gloo as on NCCL (see
    [Note: collective order]). Call it on every rank.

    Args:
        hook: the comm hook ``hook(state, bucket) -> Future[Tensor]`` that reduces a bucket,
            e.g. ``allreduce_hook``; ``state`` is what ``ddp.register_comm_hook`` is given.
        ddp: the DistributedDataParallel model whose hook this becomes.
        zero: a ``shardopt.optim.ZeroRedundancyOptimizer`` built with
            ``overlap_with_ddp=True`` over the parameters that ``ddp`` reduces.
        shard_buckets: accepted for torch's signature; ownership is ``zero``'s partition
            either way (see [Note: shard_buckets]).

    Returns:
        The comm hook to pass to ``ddp.register_comm_hook(state, ...)``.

    Raises:
        TypeError: ``hook`` is not callable, ``ddp`` is not a DistributedDataParallel, ``zero``
            lacks the overlap methods (torch's class, say) or ``shard_buckets`` is not a bool.
        ValueError: ``zero`` was built with ``overlap_with_ddp=False``, ``ddp`` and ``zero``
            hold different parameters, or ``zero``'s group has a rank outside ``ddp``'s.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from torch.nn.parallel import DistributedDataParallel
        >>> from shardopt.optim import ZeroRedundancyOptimizer
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = DistributedDataParallel(torch.nn.Linear(3, 1))
        >>> zero = ZeroRedundancyOptimizer(
        ...     ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.1
        ... )
        >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        >>> before = ddp.module.weight.detach().clone()
        >>> ddp(torch.ones(2, 3)).sum().backward()  # reduces, then steps: no zero.step()
        >>> bool((ddp.module.weight != before).all())  # updated from the first iteration
        True
        >>> dist.barrier()  # see [Note: ending a doctest's group]
        >>> del ddp, zero
        >>> dist.destroy_process_group()
    """
    _check_arguments("hook_with_zero_step", hook, ddp, zero, shard_buckets)
    stepper = _ZeroStepper(zero, "hook_with_zero_step")
    return _as_comm_hook(functools.partial(stepper.step_at_end, hook), hook, "zero_step")


def hook_with_zero_step_interleaved(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: _OverlapZero,
    shard_buckets: bool = False,
) -> CommHook:
    """Wraps a DDP comm hook so that each bucket's ZeRO step runs as soon as it is reduced.

    Like :func:`hook_with_zero_step`, but a bucket's update is chained on its reduction: it
    runs when that reduction completes, while backward computes and reduces the buckets after
    it (see [Note: step at the end or interleaved]). The parameter syncs start once the last
    bucket is reached, in bucket order, and are done before backward returns. Updates from the
    first iteration on, works on gloo as on NCCL. A class other than torch.optim's
    per-parameter ones is stepped once per iteration, as by :func:`hook_with_zero_step` ([Note:
    contract with ZeRO]). Call it on every rank.

    Args:
        hook: the comm hook ``hook(state, bucket) -> Future[Tensor]`` that reduces a bucket.
        ddp: the DistributedDataParallel model whose hook this becomes.
        zero: a ``shardopt.optim.ZeroRedundancyOptimizer`` built with
            ``overlap_with_ddp=True`` over the parameters that ``ddp`` reduces.
        shard_buckets: accepted for torch's signature (see [Note: shard_buckets]).

    Returns:
        The comm hook to pass to ``ddp.register_comm_hook(state, ...)``.

    Raises:
        TypeError: as :func:`hook_with_zero_step`.
        ValueError: as :func:`hook_with_zero_step`.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        >>> from torch.nn.parallel import DistributedDataParallel
        >>> from shardopt.optim import ZeroRedundancyOptimizer
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> linear = torch.nn.Linear(3, 1)
        >>> _ = torch.nn.init.constant_(linear.bias, 1.0)
        >>> ddp = DistributedDataParallel(linear)
        >>> zero = ZeroRedundancyOptimizer(
        ...     ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
        ... )
        >>> ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
        >>> ddp(torch.ones(2, 3)).sum().backward()
        >>> round(linear.bias.item(), 4)  # 1 - lr 0.1 * gradient 2, in the first iteration
        0.8
        >>> dist.barrier()  # see [Note: ending a doctest's group]
        >>> del ddp, zero
        >>> dist.destroy_process_group()
    """
    api = "hook_with_zero_step_interleaved"
    _check_arguments(api, hook, ddp, zero, shard_buckets)
    stepper = _ZeroStepper(zero, api)
    return _as_comm_hook(functools.partial(stepper.step_interleaved, hook), hook, "zero_step_il")


# [Note: shard_buckets]
# In torch, ``shard_buckets`` chooses how its ZeRO partition follows DDP's buckets: each bucket
# to one rank (False) or each bucket split over ranks for balance (True). Our partition is
# ``zero``'s own and does not depend on the buckets, so the flag changes nothing here: it is
# accepted (a bool) so that code written for torch's hooks runs unchanged.


def _check_arguments(api: str, hook: Any, ddp: Any, zero: Any, shard_buckets: Any) -> None:
    """Validates the hooks' arguments; all local, so a bad call fails before any collective."""
    if not callable(hook):
        raise TypeError(f"{api}: expected a callable comm hook (state, bucket), got {hook!r}")
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"{api}: expected a DistributedDataParallel as ddp, got {type(ddp).__name__}"
        )
    if not all(callable(getattr(zero, m, None)) for m in ("_step_params", "_sync_params_of")):
        raise TypeError(
            f"{api}: expected a shardopt.optim.ZeroRedundancyOptimizer as zero, "
            f"got {type(zero).__name__}"
        )
    if not getattr(zero, "_overlap_with_ddp", False):
        raise ValueError(
            f"{api}: expected zero built with overlap_with_ddp=True, got overlap_with_ddp=False"
        )
    if not isinstance(shard_buckets, bool):
        raise TypeError(f"{api}: expected shard_buckets to be a bool, got {shard_buckets!r}")
    _check_same_parameters(api, ddp, zero)
    _check_groups(api, ddp, zero)


def _check_same_parameters(api: str, ddp: DistributedDataParallel, zero: Any) -> None:
    """ddp must reduce exactly the trainable parameters that zero optimizes."""
    ignored = ddp.parameters_to_ignore
    reduced = {
        id(p): name
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and name not in ignored
    }
    optimized = {id(p) for p in zero._param_to_rank if p.requires_grad}
    only_ddp = sorted(name for key, name in reduced.items() if key not in optimized)
    only_zero = len(optimized - reduced.keys())
    if only_ddp or only_zero:
        raise ValueError(
            f"{api}: expected zero to optimize exactly the parameters that ddp reduces, got "
            f"{len(only_ddp)} reduced by ddp only {only_ddp[:3]} and {only_zero} in zero only"
        )


def _check_groups(api: str, ddp: DistributedDataParallel, zero: Any) -> None:
    """Every owner must see the gradients of everyone it syncs to: zero's ranks within ddp's."""
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    zero_ranks = dist.get_process_group_ranks(zero.process_group)
    if not set(zero_ranks) <= set(ddp_ranks):
        raise ValueError(
            f"{api}: expected zero's process group within ddp's, got zero's ranks "
            f"{sorted(zero_ranks)} and ddp's {sorted(ddp_ranks)}"
        )


# [Note: hook annotations]
# ``DistributedDataParallel.register_comm_hook`` compares the annotations of a hook's
# ``bucket`` parameter and return value with ``dist.GradBucket`` and
# ``torch.futures.Future[torch.Tensor]``, and logs its ``__qualname__``. Under
# ``from __future__ import annotations`` they would be strings, so the hook gets evaluated ones.


def _as_comm_hook(
    run: Callable[[Any, dist.GradBucket], torch.futures.Future[Any]], hook: Any, suffix: str
) -> CommHook:
    """A plain function around ``run`` that DDP accepts as a comm hook."""

    def comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return run(state, bucket)

    future = torch.futures.Future[torch.Tensor]
    comm_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket, "return": future}
    name = getattr(hook, "__name__", type(hook).__name__)
    comm_hook.__name__ = comm_hook.__qualname__ = f"{name}_with_{suffix}"
    return comm_hook


@dataclass(frozen=True, slots=True)
class _Bucket:
    """What a hook keeps of a DDP bucket: its parameters and where their gradients lie in it."""

    index: int
    is_last: bool
    params: list[torch.Tensor]
    views: list[tuple[torch.Size, tuple[int, ...], int]]  # size, stride, offset in the bucket
    numel: int
    dtype: torch.dtype

    @classmethod
    def of(cls, bucket: dist.GradBucket) -> _Bucket:
        buffer = bucket.buffer()
        base = int(buffer.storage_offset())
        views = [(g.size(), g.stride(), int(g.storage_offset()) - base) for g in bucket.gradients()]
        return cls(
            bucket.index(),
            bucket.is_last(),
            bucket.parameters(),
            views,
            buffer.numel(),
            buffer.dtype,
        )

    def gradients_in(self, value: Any, api: str) -> list[torch.Tensor]:
        """The parameters' reduced gradients: views of the hook's result, laid out as DDP's."""
        result = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        ok = isinstance(result, torch.Tensor) and result.is_contiguous()
        if not (ok and result.numel() == self.numel and result.dtype == self.dtype):
            got = (
                f"{result.dtype} tensor of {result.numel()} elements"
                if isinstance(result, torch.Tensor)
                else type(result).__name__
            )
            raise RuntimeError(
                f"{api}: expected the comm hook's result for bucket {self.index} to be a "
                f"contiguous {self.dtype} tensor of {self.numel} elements, got a {got}"
            )
        start = result.storage_offset()
        return [result.as_strided(size, stride, start + off) for size, stride, off in self.views]


# [Note: reduced gradients]
# DDP writes a bucket's reduced values into the parameters' ``.grad`` only in its
# ``finalize_backward``, after every hook's future is done; when a hook's future completes,
# ``.grad`` still holds the local gradient (``gradient_as_bucket_view=False``) or a view of
# the bucket that a hook may or may not have reduced in place. So the step reads the reduced
# values from the future's result, laid out as DDP lays the bucket out, lends them to the
# parameters as ``.grad`` for the update and gives the original ``.grad`` objects back:
# DDP later copies into them, and with ``gradient_as_bucket_view=True`` it checks that they
# still alias the bucket. The final ``.grad`` is thus what DDP alone would leave.
#
# [Note: collective order]
# Collectives of one process group must be started in the same order on every rank. A future's
# callbacks run on the thread that completes it: inline on the calling thread for NCCL (its
# futures complete when the collective is enqueued), but on one of gloo's worker threads, at a
# moment that differs between ranks, for gloo. A sync started from there could pair with
# another collective on another rank (torch's interleaved hook starts its broadcasts there;
# both of torch's hooks refuse gloo). Every sync here is started on the thread that calls the
# hooks, once the last bucket is reached (DDP starts the reductions in index order, so all are
# started by then), in bucket order: the same order on every rank and backend, and for both
# hooks. Updates are local and may run in callbacks; a lock runs them one at a time.
#
# [Note: step at the end or interleaved]
# As torch's: ``hook_with_zero_step`` lets backward compute every gradient first, then updates
# bucket after bucket, each as soon as its reduction is done, overlapping the reductions and
# syncs still under way (good when communication is slow next to computation);
# ``hook_with_zero_step_interleaved`` chains each bucket's update on its reduction, so updates
# also overlap the rest of backward (good when communication is fast). The interleaved update
# returns the reduced tensor: its future then carries CUDA events that cover the update, and
# waiting for it orders the sync after the update on the GPU. A parameter's update comes only
# after all of backward's uses of it (its gradient is complete); a custom autograd function that
# saved a parameter without taking its gradient would see it changed, which autograd reports.
#
# [Note: uneven inputs]
# Under ``Join([ddp, zero])`` DDP's join hook calls the comm hook on a rank that has run out of
# inputs, for every bucket in index order, with zero-filled buckets and outside backward. The
# hooks use only the bucket and its reduction, so that rank keeps updating the parameters it
# owns with the others' reduced gradients and keeps taking part in the syncs, in the same order;
# ``zero``'s own join hook has no ``step()`` to shadow. Every rank ends with the model that DDP
# with a plain optimizer leaves (the last joiner's).
#
# [Note: unused parameters]
# With ``find_unused_parameters=True`` DDP fills a locally unused parameter's bucket slot with
# zeros, and leaves ``.grad`` untouched only if no rank used it, a fact it learns after the last
# hook. The update sees the reduced bucket, so a parameter that no rank used in an iteration is
# updated with a zero gradient (as torch's hooks do); DDP with a plain optimizer skips it.


@dataclass(frozen=True, slots=True)
class _Pending:
    """A bucket met in this backward pass and the future to wait for before syncing it."""

    bucket: _Bucket
    future: torch.futures.Future[Any]
    updated: bool  # whether the future's completion means the update is done (interleaved)


class _ZeroStepper:
    """Runs ``zero``'s updates and syncs from DDP's comm hooks, one backward pass at a time."""

    def __init__(self, zero: _OverlapZero, api: str) -> None:
        self._zero = zero
        self._api = api
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._per_bucket = bool(getattr(zero, "_steps_per_bucket", False))

    def step_at_end(
        self, hook: CommHook, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """The hook of :func:`hook_with_zero_step`."""
        meta = _Bucket.of(bucket)
        reduced = hook(state, bucket)
        self._record(_Pending(meta, reduced, updated=False))
        return reduced

    def step_interleaved(
        self, hook: CommHook, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """The hook of :func:`hook_with_zero_step_interleaved`."""
        if not self._per_bucket:  # one update per iteration, at the end
            return self.step_at_end(hook, state, bucket)
        meta = _Bucket.of(bucket)
        updated = hook(state, bucket).then(functools.partial(self._update_when_reduced, meta))
        self._record(_Pending(meta, updated, updated=True))
        return updated

    def _record(self, pending: _Pending) -> None:
        index = pending.bucket.index
        if index == 0:
            self._pending = []  # a new backward pass (a failed one may have left buckets)
        if index != len(self._pending):
            raise RuntimeError(
                f"{self._api}: expected DDP's buckets in index order, got bucket {index} "
                f"after {len(self._pending)} bucket(s)"
            )
        self._pending.append(pending)
        if pending.bucket.is_last:
            self._finish()

    def _update_when_reduced(self, bucket: _Bucket, reduced: torch.futures.Future[Any]) -> Any:
        value = reduced.value()
        self._update(bucket, value)
        return value

    def _finish(self) -> None:
        """Updates what is left, syncs the buckets in order, waits ([Note: collective order]);
        a class not stepped per bucket gets one update of every bucket first."""
        pending, self._pending = self._pending, []
        works: list[Any] = []
        if not self._per_bucket:
            values = [entry.future.wait() for entry in pending]
            self._update_all([entry.bucket for entry in pending], values)
        for entry in pending:
            value = entry.future.wait()
            if self._per_bucket and not entry.updated:
                self._update(entry.bucket, value)
            works.extend(self._zero._sync_params_of(entry.bucket.params, async_op=True))
        for work in works:
            work.wait()

    def _update(self, bucket: _Bucket, value: Any) -> None:
        """``zero``'s update of the bucket's parameters with their reduced gradients."""
        self._update_all([bucket], [value])

    def _update_all(self, buckets: list[_Bucket], values: list[Any]) -> None:
        """One ``zero`` update of the buckets' parameters with their reduced gradients."""
        grads = [g for b, v in zip(buckets, values) for g in b.gradients_in(v, self._api)]
        params = [p for b in buckets for p in b.params]
        with self._lock, torch.no_grad():
            kept = [p.grad for p in params]
            try:
                for p, reduced in zip(params, grads):
                    p.grad = reduced
                self._zero._step_params(params)
            finally:
                for p, local in zip(params, kept):
                    p.grad = local
