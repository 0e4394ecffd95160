"""Measurements of the CLI: bytes of real tensors, counted collectives, peak tensor memory."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardopt.functional import RankBytes, Traffic

__all__ = [
    "PeakMemory",
    "count_collectives",
    "measure_ddp",
    "measure_sharded",
    "storage_bytes",
    "traffic_of",
]


@contextlib.contextmanager
def count_collectives() -> Iterator[Any]:
    """shardopt.testing's collective counter (the [demo] extra installs the harness): the log of
    every torch.distributed call inside. Imported here, at use, so ``shardopt plan`` never
    imports the harness or pytest."""
    from shardopt.testing import count_collectives as counter

    with counter() as log:
        yield log


def traffic_of(log: Any) -> Traffic:
    """A :func:`count_collectives` log's calls summed by kind, as the cost model's Traffic."""
    return Traffic(*log.totals())


def storage_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the distinct storages under ``tensors`` (None and non-tensors skipped).

    Views of one buffer count once, at the buffer's full size: what the process really holds.

    Example:
        >>> buf = torch.zeros(10)
        >>> storage_bytes([buf[:2], buf[5:], None, torch.zeros(3, dtype=torch.float16)])
        46
    """
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes():
                seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def measure_sharded(params: Iterable[torch.Tensor], state: Any) -> RankBytes:
    """What this rank holds under shardopt: ``params`` (all of the model's) and a ShardedState.

    The optimizer state is every tensor of ``state.inner`` and of its flat field buffers (a
    rank holds them even for groups where it owns nothing); gradients are the ``.grad``
    tensors plus the gradient shards where gradients are reduced; buffers are the gradient
    staging buffers.
    """
    params = list(params)
    grads = None if state.reducer is None else state.reducer.grads
    shards, staging = ((), ()) if grads is None else (grads.allocated_shards, grads.staging)
    return RankBytes(
        params=storage_bytes(params),
        grads=storage_bytes([p.grad for p in params]) + storage_bytes(shards),
        optimizer=storage_bytes(_tensor_leaves((state.inner, [f.buffers for f in state.fields]))),
        master=storage_bytes(state.master.stored),  # int16 where remainders: 2 bytes each
        buffers=storage_bytes(staging),
    )


def measure_ddp(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> RankBytes:
    """What this rank holds under DDP: ``params`` with their ``.grad``, and a torch optimizer."""
    params = list(params)
    return RankBytes(
        params=storage_bytes(params),
        grads=storage_bytes([p.grad for p in params]),
        optimizer=storage_bytes(_tensor_leaves(list(optimizer.state.values()))),
        master=0,
        buffers=0,
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Sends file descriptor 2 to /dev/null: the profiler's start and stop log a line each."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class PeakMemory:
    """The peak of the bytes allocated by torch's CPU allocator since the block began.

    Uses the profiler's memory records (allocations and frees, in time order); on CUDA, use
    ``torch.cuda.max_memory_allocated`` instead.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._profile: Any = None

    def __enter__(self) -> PeakMemory:
        activities = [torch.profiler.ProfilerActivity.CPU]
        self._profile = torch.profiler.profile(activities=activities, profile_memory=True)
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        events = self._profile.profiler.kineto_results.events()
        records = sorted(
            (e.start_ns(), e.nbytes())
            for e in events
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        level = 0
        for _, nbytes in records:
            level += nbytes
            self.peak = max(self.peak, level)
