"""Measurements of the CLI: bytes of real tensors, counted collectives, peak tensor memory."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from shardopt.testing._plan_cli_cost import RankBytes, Traffic

__all__ = [
    "CollectiveLog",
    "PeakMemory",
    "count_collectives",
    "measure_ddp",
    "measure_sharded",
    "storage_bytes",
]

# Every torch.distributed function that can move data, by name; those missing are skipped.
_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
_ONE_TENSOR = ("all_reduce", "broadcast", "reduce")  # their second argument is not a tensor


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
    tensors plus stage 2's gradient shards; buffers are the collectives' staging buffers.
    """
    params = list(params)
    reducer = state.reducer
    shards = [] if reducer is None else list(reducer.shards)
    return RankBytes(
        params=storage_bytes(params),
        grads=storage_bytes([p.grad for p in params]) + storage_bytes(shards),
        optimizer=storage_bytes(_tensor_leaves((state.inner, [f.buffers for f in state.fields]))),
        master=storage_bytes(state.master),
        buffers=storage_bytes(state.layout.staging),
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


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


@dataclass
class CollectiveLog:
    """The collectives called in a :func:`count_collectives` block: (name, input bytes, output
    bytes) per call."""

    world_size: int
    calls: list[tuple[str, int, int]] = field(default_factory=list)

    def traffic(self) -> Traffic:
        """The calls as a Traffic ([Note: traffic model]): broadcasts count as gathers, reduces
        as reduce-scatters."""

        def total(kinds: tuple[str, ...], index: int) -> int:
            return sum(int(c[index]) for c in self.calls if c[0] in kinds)

        return Traffic(
            all_reduce=total(("all_reduce",), 1),
            reduce_scatter=total(_SCATTERS, 1) + total(("reduce",), 1),
            all_gather=total(_GATHERS, 2) + total(("broadcast",), 1),
            collectives=sum(
                c[0] in (*_GATHERS, *_SCATTERS, "broadcast", "reduce") for c in self.calls
            ),
        )

    def others(self) -> list[str]:
        """Names of the calls that :meth:`traffic` leaves out."""
        known = ("all_reduce", "broadcast", "reduce", *_GATHERS, *_SCATTERS)
        return [c[0] for c in self.calls if c[0] not in known]


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Records every torch.distributed collective called from Python inside the block.

    The collectives are looked up on ``torch.distributed`` at each call by shardopt, torch's
    ZeroRedundancyOptimizer and DDP's Python comm hooks; DDP's built-in C++ all-reduce is not
    seen (register ``allreduce_hook`` to count it).
    """
    log = CollectiveLog(dist.get_world_size())
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = args[0] if args else next(iter(kwargs.values()), None)
            inp = args[1] if len(args) > 1 and name not in _ONE_TENSOR else out
            log.calls.append((name, _nbytes(inp), _nbytes(out)))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


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
