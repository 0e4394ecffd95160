"""Counting torch.distributed collectives: each call's name, tensor bytes and root rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["CallTotals", "CollectiveCall", "CollectiveLog", "count_collectives"]

# Every torch.distributed function that can move data or synchronise ranks, by name; those
# missing from this torch are skipped.
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
    "barrier",
)
_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")
_ONE_TENSOR = ("all_reduce", "broadcast", "reduce")  # their second argument is not a tensor


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveCall(NamedTuple):
    """One recorded collective.

    ``first`` is the bytes of its first argument (the first keyword argument when none is
    positional), ``second`` those of its second positional argument (None when there is none),
    ``root`` the ``group_src`` / ``group_dst`` keyword of a rooted call (else None), ``group``
    its ``group`` keyword (None: the default group, or none given).
    """

    name: str
    first: int
    second: int | None
    root: int | None
    group: Any = None


class CallTotals(NamedTuple):
    """Bytes handed to each kind of collective, and the calls of the data-moving kinds (the
    fields of shardopt.functional.Traffic, in its order)."""

    all_reduce: int
    reduce_scatter: int
    all_gather: int
    collectives: int


@dataclass
class CollectiveLog:
    """The collectives called in a :func:`count_collectives` block, in call order."""

    world_size: int
    calls: list[CollectiveCall] = field(default_factory=list)

    def totals(self) -> CallTotals:
        """The calls summed by kind ([Note: traffic model]): broadcasts count as gathers,
        reduces and single-tensor all-to-alls as reduce-scatters."""

        def total(kinds: tuple[str, ...], input_side: bool) -> int:
            return sum(
                _input_bytes(c) if input_side else c.first for c in self.calls if c.name in kinds
            )

        return CallTotals(
            all_reduce=total(("all_reduce",), True),
            reduce_scatter=total(_SCATTERS, True) + total(("reduce",), True),
            all_gather=total(_GATHERS, False) + total(("broadcast",), True),
            collectives=sum(
                c.name in (*_GATHERS, *_SCATTERS, "broadcast", "reduce") for c in self.calls
            ),
        )

    def in_group(self, group: Any) -> CollectiveLog:
        """The calls made in ``group`` (by identity; None: the default group)."""
        return CollectiveLog(self.world_size, [c for c in self.calls if c.group is group])

    def others(self) -> list[str]:
        """Names of the calls that :meth:`totals` leaves out."""
        known = ("all_reduce", "broadcast", "reduce", *_GATHERS, *_SCATTERS)
        return [c.name for c in self.calls if c.name not in known]


def _input_bytes(call: CollectiveCall) -> int:
    """The bytes a call reads: its second argument, or its only tensor (the first)."""
    if call.second is None or call.name in _ONE_TENSOR:
        return call.first
    return call.second


def _root(kwargs: dict[str, Any]) -> int | None:
    """The group rank of a rooted call's root: ``group_src``/``group_dst``, or (torch < 2.6) the
    group rank of the global ``src``/``dst``."""
    for key in ("group_src", "group_dst"):
        if kwargs.get(key) is not None:
            return int(kwargs[key])
    for key in ("src", "dst"):
        if kwargs.get(key) is not None:
            group = kwargs.get("group")
            if group is None or group is dist.GroupMember.WORLD:
                return int(kwargs[key])
            return dist.get_group_rank(group, kwargs[key])
    return None


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Records every torch.distributed collective called from Python inside the block.

    The collectives are looked up on ``torch.distributed`` at each call by shardopt, torch's
    ZeroRedundancyOptimizer and DDP's Python comm hooks; DDP's built-in C++ all-reduce is not
    seen (register ``allreduce_hook`` to count it). The log is filled as calls happen.

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> with count_collectives() as log:
        ...     _ = dist.all_reduce(torch.zeros(4))
        ...     _ = dist.broadcast(torch.zeros(2), src=0)
        >>> [(c.name, c.first, c.root) for c in log.calls]
        [('all_reduce', 16, None), ('broadcast', 8, 0)]
        >>> log.totals().all_reduce, log.others()
        (16, [])
        >>> dist.destroy_process_group()
    """
    log = CollectiveLog(dist.get_world_size())
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()), None)
            second = _nbytes(args[1]) if len(args) > 1 else None
            root = _root(kwargs)
            call = CollectiveCall(name, _nbytes(first), second, root, kwargs.get("group"))
            log.calls.append(call)
            return fn(*args, **kwargs)

        return recorded

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
