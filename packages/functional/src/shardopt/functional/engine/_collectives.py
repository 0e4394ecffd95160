"""Stateless collectives on flat buffers: parameter all-gathers and gradient reduce-scatters."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import Bucket
from shardopt.functional.engine._failure import completed
from shardopt.functional.engine._rooted import ProcessGroup, broadcast_from, reduce_to

__all__ = [
    "Algorithm",
    "Pending",
    "PendingQueue",
    "all_gather_bucket",
    "all_gather_into",
    "all_gather_rows",
    "all_reduce_sum",
    "average_across",
    "bucket_calls",
    "comm_device",
    "exchanges",
    "one_call",
    "reduce_scatter_bucket",
    "reduce_scatter_into",
    "reduce_scratch_numel",
    "resolve_algorithm",
    "scratch_of",
]


# [Note: collective names]
# torch 2.13 names the single-tensor collectives ``all_gather_single`` and
# ``reduce_scatter_single``; older versions call them ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor`` (same arguments). The functions are looked up at every call, not bound
# at import, so a test that records calls by patching ``torch.distributed`` sees every one.


def _all_gather_fn() -> Callable[..., Any]:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn() -> Callable[..., Any]:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# [Note: collective algorithms]
# A parameter sync moves, per rank, (W-1)/W of the parameter bytes in, and a gradient reduction
# (W-1)/W of the gradient bytes out, whichever calls do it:
# - COLLECTIVE: one ``all_gather_single`` / ``reduce_scatter_single`` per bucket: the natural
#   calls, and the fast ones under NCCL.
# - EXCHANGE: each shard travels straight between its owner and the other ranks. Parameters: one
#   ``broadcast`` per owner, from its block, in place. Gradients: one ``all_to_all_single`` sends
#   every block of the packed bucket to its owner, which sums the W copies it receives (a
#   scratch of the bucket's size, beside the staging). Greedy buckets of unequal shards reduce
#   with one ``reduce`` per owner instead (an all-to-all there would receive W times the largest
#   shard). Under gloo (torch 2.13, CPU) these are the fast calls: on an 8 MiB bucket, 1 thread
#   per rank, at W = 2 and 4, the all-to-all plus the sum beats the reduce-scatter, the
#   all-reduce and a reduce per owner, and a broadcast per owner beats the all-gather (measured:
#   docs/performance.md, benchmarks/bench_gloo_collectives.py).
# AUTO picks EXCHANGE for CPU tensors under a gloo group and COLLECTIVE otherwise. Every rank of
# a world resolves it alike (same backend, same device types), so the calls always match.


class Algorithm(str, enum.Enum):
    """Which calls carry a parameter sync or gradient reduction ([Note: collective algorithms])."""

    AUTO = "auto"
    COLLECTIVE = "collective"
    EXCHANGE = "exchange"


def resolve_algorithm(
    algorithm: Algorithm | str, group: ProcessGroup, device: torch.device
) -> Algorithm:
    """AUTO made concrete for tensors on ``device`` in ``group``; other values pass through."""
    chosen = Algorithm(algorithm)
    if chosen is not Algorithm.AUTO:
        return chosen
    gloo = "gloo" in str(dist.get_backend(group)).lower()
    return Algorithm.EXCHANGE if gloo and device.type == "cpu" else Algorithm.COLLECTIVE


def comm_device(group: ProcessGroup, default: torch.device | None = None) -> torch.device:
    """Where tensors travel in ``group``: under NCCL ``default`` (e.g. the parameters' device)
    or else the current CUDA device; the CPU under any other backend."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return default if default is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Pending:
    """Collectives in flight and the local work that completes them (``None`` works: done)."""

    __slots__ = ("_finish", "_works")

    def __init__(self, works: Any, finish: Callable[[], None] | None = None) -> None:
        self._works = list(works) if isinstance(works, (list, tuple)) else [works]
        self._finish = finish

    def wait(self) -> None:
        """Waits for the collectives, then runs their completion (once)."""
        while self._works:
            work = self._works.pop(0)
            if isinstance(work, Pending):
                work.wait()
            elif work is not None:
                completed(work)  # see [Note: failing together]
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class PendingQueue:
    """Collectives in flight, completed in launch order, each tagged with the buffer it uses."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[tuple[Hashable, Pending]] = deque()

    def push(self, tag: Hashable, pending: Pending) -> None:
        """Adds a collective using buffer ``tag``."""
        self._items.append((tag, pending))

    def release(self, tag: Hashable) -> None:
        """Completes collectives in launch order until none uses buffer ``tag``."""
        while any(t == tag for t, _ in self._items):
            self._items.popleft()[1].wait()

    def wait_all(self) -> None:
        """Completes every collective in flight, in launch order."""
        while self._items:
            self._items.popleft()[1].wait()

    def __len__(self) -> int:
        return len(self._items)


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: ProcessGroup = None,
    async_op: bool = False,
) -> Any:
    """``output = cat(input of every rank)``; ``input`` may be this rank's slice of ``output``."""
    work = _all_gather_fn()(output, input, group=group, async_op=True)
    return work if async_op else completed(work)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: ProcessGroup = None,
    async_op: bool = False,
) -> Any:
    """``output = sum over ranks of block rank of input``; ``output`` may be that very block."""
    fn = _reduce_scatter_fn()
    work = fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work if async_op else completed(work)


def all_reduce_sum(tensor: torch.Tensor, *, group: ProcessGroup = None) -> torch.Tensor:
    """Sums ``tensor`` over ranks in place (synchronously) and returns it."""
    return all_reduce_op(tensor, dist.ReduceOp.SUM, group=group)


def all_reduce_op(tensor: Any, op: Any, *, group: ProcessGroup = None) -> Any:
    """Reduces ``tensor`` over ranks in place with ``op`` (waited for as [Note: failing
    together] says) and returns it."""
    completed(dist.all_reduce(tensor, op=op, group=group, async_op=True))
    return tensor


def average_across(
    pending: Pending,
    part: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    group: ProcessGroup,
) -> Pending:
    """Completes ``pending`` (which writes ``part``), then averages ``part`` over ``group`` and
    copies (or, with ``accumulate``, adds) it into ``out``: the replicas' step of a hybrid
    gradient reduction ([Note: hybrid sharding])."""

    def finish() -> None:
        all_reduce_op(part, dist.ReduceOp.SUM, group=group)
        part.div_(dist.get_world_size(group))
        if accumulate:
            out.add_(part)
        else:
            out.copy_(part)

    return Pending([pending], finish)


def all_gather_rows(row: torch.Tensor, *, group: ProcessGroup = None) -> torch.Tensor:
    """The 1-D ``row`` of every rank, stacked: a ``(world_size, len(row))`` tensor."""
    world = dist.get_world_size(group)
    out = row.new_empty((world, row.numel()))
    all_gather_into(out.view(-1), row.contiguous(), group=group)
    return out


def one_call(bucket: Bucket, algorithm: Algorithm) -> bool:
    """Whether a bucket moves in one all-gather / reduce-scatter (COLLECTIVE, equal shards)
    rather than one broadcast / reduce per owner (see [Note: collective algorithms])."""
    return bucket.uniform and algorithm is Algorithm.COLLECTIVE


def exchanges(bucket: Bucket, algorithm: Algorithm) -> bool:
    """Whether a bucket's gradients reduce by one all-to-all and a local sum (EXCHANGE, equal
    shards; see [Note: collective algorithms])."""
    return bucket.uniform and algorithm is Algorithm.EXCHANGE


def reduce_scratch_numel(bucket: Bucket, algorithm: Algorithm, *, widened: bool = False) -> int:
    """Elements of scratch a reduction of ``bucket`` receives into, beside its staging (a
    ``widened`` one, [Note: wire dtype]: W copies of the largest shard)."""
    if widened:
        return len(bucket.shards) * max(bucket.shards, default=0)
    return bucket.numel if exchanges(bucket, algorithm) else 0


def bucket_calls(
    bucket: Bucket, algorithm: Algorithm, *, reduce: bool = False, widened: bool = False
) -> int:
    """The calls of one gather (or, with ``reduce``, one reduction) of ``bucket`` under the
    concrete ``algorithm``, in a world of more than one rank.

    Example:
        >>> bucket_calls(Bucket(0, (4, 0, 2)), Algorithm.COLLECTIVE)
        2
        >>> bucket_calls(Bucket(0, (4, 4)), Algorithm.EXCHANGE, reduce=True)
        1
    """
    if bucket.numel == 0:
        return 0
    if one_call(bucket, algorithm) or (reduce and (widened or exchanges(bucket, algorithm))):
        return 1
    return sum(1 for n in bucket.shards if n)


def all_gather_bucket(
    buffer: torch.Tensor,
    bucket: Bucket,
    *,
    group: ProcessGroup = None,
    async_op: bool = False,
    algorithm: Algorithm | str = Algorithm.AUTO,
) -> Pending:
    """Gathers every rank's shard of ``bucket`` into every rank's flat ``buffer``, in place.

    Rank ``r`` contributes ``buffer[bucket.shard_start(r):][:bucket.shards[r]]``, its own shard,
    so nothing is copied: one all-gather of the bucket (COLLECTIVE, equal shards), else one
    broadcast per rank with a non-empty shard (EXCHANGE, or greedy shards of unequal sizes). See
    [Note: collective algorithms].

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import Bucket
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> buf = torch.arange(4.0)
        >>> all_gather_bucket(buf, Bucket(0, (4,))).wait()
        >>> buf
        tensor([0., 1., 2., 3.])
        >>> dist.destroy_process_group()
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_bucket("all_gather_bucket", buffer, bucket, world)
    if world == 1 or bucket.numel == 0:
        return Pending(None)
    if one_call(bucket, resolve_algorithm(algorithm, group, buffer.device)):
        mine = buffer[bucket.shard_start(rank) : bucket.shard_start(rank) + bucket.shards[rank]]
        region = buffer[bucket.start : bucket.stop]
        pending = Pending(all_gather_into(region, mine, group=group, async_op=True))
    else:
        works = [
            broadcast_from(
                buffer[bucket.shard_start(r) : bucket.shard_start(r) + n],
                r,
                group=group,
                async_op=True,
            )
            for r, n in enumerate(bucket.shards)
            if n
        ]
        pending = Pending(works)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_bucket(
    staging: torch.Tensor,
    bucket: Bucket,
    output: torch.Tensor,
    *,
    accumulate: bool = False,
    group: ProcessGroup = None,
    async_op: bool = False,
    algorithm: Algorithm | str = Algorithm.AUTO,
    scratch: torch.Tensor | None = None,
) -> Pending:
    """Averages one bucket of packed gradients over ranks into this rank's ``output``.

    ``staging`` holds the bucket's ``bucket.numel`` elements of local gradients, laid out as
    the bucket (shard ``r`` destined to rank ``r``). It is summed in place (this rank's shard
    receives the sum, the rest becomes scratch; under EXCHANGE the W copies of this rank's shard
    are received into ``scratch``, ``bucket.numel`` elements, allocated when None, and summed
    into it), then the completion divides by the world size
    and copies (or, with ``accumulate``, adds) into ``output`` (``bucket.shards[rank]``
    elements, any float dtype). Summing first and dividing after keeps the result equal to
    ``sum(grads) / world_size`` computed on one process. See [Note: collective algorithms].

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import Bucket
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> out = torch.ones(2)
        >>> grads = torch.tensor([1.0, 2.0])
        >>> reduce_scatter_bucket(grads, Bucket(0, (2,)), out, accumulate=True).wait()
        >>> out
        tensor([2., 3.])
        >>> dist.destroy_process_group()
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if staging.numel() != bucket.numel or output.numel() != bucket.shards[rank]:
        raise ValueError(
            f"reduce_scatter_bucket: expected staging of {bucket.numel} and output of "
            f"{bucket.shards[rank]} elements, got {staging.numel()} and {output.numel()}"
        )
    lo = bucket.shard_start(rank) - bucket.start
    mine = staging[lo : lo + bucket.shards[rank]]
    work: Any = None
    received: torch.Tensor | None = None
    algo = resolve_algorithm(algorithm, group, staging.device)
    if world > 1 and bucket.numel:
        if one_call(bucket, algo):
            work = reduce_scatter_into(mine, staging, group=group, async_op=True)
        elif exchanges(bucket, algo):
            received = scratch_of(scratch, staging)
            work = dist.all_to_all_single(received, staging, group=group, async_op=True)
        else:
            work = _reduce_to_owners(staging, bucket, group)

    def finish() -> None:
        if received is not None:  # the W copies of this rank's shard: their sum
            torch.sum(received.view(world, -1), 0, out=mine)
        if accumulate:
            output.add_(mine.div_(world) if world > 1 else mine)
        elif world > 1:
            torch.div(mine, world, out=output)  # one pass: divide and store
        else:
            output.copy_(mine)

    pending = Pending(work, finish)
    if not async_op:
        pending.wait()
    return pending


def scratch_of(
    scratch: torch.Tensor | None, staging: torch.Tensor, numel: int | None = None
) -> torch.Tensor:
    """``scratch``'s first ``numel`` elements (default: the staging's), or a new buffer."""
    n = staging.numel() if numel is None else numel
    if scratch is None:
        return staging.new_empty(n)
    if scratch.numel() < n or scratch.dtype != staging.dtype:
        raise ValueError(
            f"reduce_scatter_bucket: expected a scratch of at least {n} "
            f"{staging.dtype} elements, got {scratch.numel()} {scratch.dtype}"
        )
    return scratch.view(-1)[:n]


def _reduce_to_owners(staging: torch.Tensor, bucket: Bucket, group: ProcessGroup) -> list[Any]:
    """One in-place ``reduce`` of each rank's shard of the packed ``staging`` to that rank."""
    return [
        reduce_to(
            staging[bucket.shard_start(r) - bucket.start :][:n],
            r,
            op=dist.ReduceOp.SUM,
            group=group,
            async_op=True,
        )
        for r, n in enumerate(bucket.shards)
        if n
    ]


def _check_bucket(api: str, buffer: torch.Tensor, bucket: Bucket, world: int) -> None:
    if len(bucket.shards) != world or buffer.dim() != 1 or buffer.numel() < bucket.stop:
        raise ValueError(
            f"{api}: expected a 1-D buffer of at least {bucket.stop} elements and a bucket of "
            f"{world} shards, got {tuple(buffer.shape)} and {len(bucket.shards)} shards"
        )
