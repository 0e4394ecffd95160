"""What ZeroRedundancyOptimizer sends: bucketed parameter syncs and tensor-only consolidation."""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardopt.core import plan_partition
from shardopt.functional.engine._param_buffers import build_param_buffers
from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World

from _functional_helpers import GATHER

RECORDED = ("all_gather_single", "all_gather_into_tensor", "broadcast", "gather", "gather_object")
RECORDED += ("isend", "irecv", "send", "recv", "all_gather", "broadcast_object_list")
RECORDED += ("all_reduce",)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, int]]]:
    """Records (collective, bytes of its tensor or pickled object) of every call inside."""
    calls: list[tuple[str, int]] = []

    def wrap(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else next(iter(kwargs.values()))
            if isinstance(first, torch.Tensor):
                size = first.numel() * first.element_size()
            else:
                buffer = io.BytesIO()
                pickle.dump(first, buffer)
                size = buffer.tell()
            calls.append((name, size))
            return fn(*args, **kwargs)

        return call

    present = {n: wrap(n, getattr(dist, n)) for n in RECORDED if hasattr(dist, n)}
    with mock.patch.multiple(dist, **present):
        yield calls


def mlp(width: int = 32, depth: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


@pytest.mark.parametrize("view", [False, True], ids=["staged", "bucket_view"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_a_step_sends_one_broadcast_per_rank_not_one_per_parameter(
    world: World, n: int, view: bool
) -> None:
    """Gloo on CPU: each rank broadcasts its parameters once (one dtype, one bucket), exactly
    the parameter bytes in total; torch's class without bucket views sends one per parameter."""
    model = mlp()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=1e-3, parameters_as_bucket_view=view
    )
    model(torch.randn(3, 32)).sum().backward()
    with recording() as calls:
        zero.step()
    assert [name for name, _ in calls] == ["broadcast"] * n
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(size for _, size in calls) == total
    assert len(calls) < len(list(model.parameters()))


SHAPES = ((7, 3), (11,), (5, 5), (2,), (13, 2), (1,), (9,))


def sync_case(
    rank: int,
    view: bool,
    bucket_numel: int | None,
    algorithm: str,
    shapes: tuple[tuple[int, ...], ...] = SHAPES,
) -> tuple[bool, bool, list[tuple[str, int]], Any]:
    """Every rank starts from its own values; one parameter sync of a greedy plan."""
    params = [torch.full(s, float(rank + 1)) for s in shapes]
    world = dist.get_world_size()
    plan = plan_partition(params, world, strategy="greedy", bucket_numel=bucket_numel)
    ptrs = [p.data_ptr() for p in params]
    storage = "views" if view else "staged"
    with torch.no_grad():  # the buffers are filled from the parameters as they are
        param_buffers = build_param_buffers(
            plan, params, rank, algorithm=algorithm, storage=storage
        )
    with recording() as calls:
        param_buffers.sync_params()
    assert plan.owners is not None
    right = all(torch.all(p == plan.owners[t] + 1) for t, p in enumerate(params))
    kept = [p.data_ptr() for p in params] == ptrs
    return right, kept, calls, None if view else param_buffers._storage


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_staged_and_view_syncs_deliver_every_owner_s_values(world: World, n: int) -> None:
    """Both storages, both collective algorithms, one or several buckets: every parameter ends
    with its owner's values; staged syncs leave the parameters in their own storage and stage at
    most two of the largest multi-tensor buckets."""
    for view in (False, True):
        for algorithm in ("exchange", "collective"):
            for bucket_numel in (None, 30):
                right, kept, calls, sync = sync_case(world.rank, view, bucket_numel, algorithm)
                assert right, (view, algorithm, bucket_numel)
                assert kept != view, (view, algorithm, bucket_numel)
                if view and bucket_numel is None:  # unequal shards: one broadcast per owner
                    assert [name for name, _ in calls] == ["broadcast"] * n
                if sync is not None:
                    for slots in sync.slots.values():
                        assert slots.rows[0].numel() <= sum(s.numel() for s in SHAPES_T)


SHAPES_T = [torch.empty(s) for s in SHAPES]


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_equal_greedy_shards_are_all_gathered_in_place_under_collective(world: World) -> None:
    balanced = ((6, 4), (6, 4), (5,), (5,))
    for algorithm, expected in (("exchange", ["broadcast"] * 2), ("collective", None)):
        right, _, calls, _ = sync_case(world.rank, True, None, algorithm, shapes=balanced)
        assert right
        names = [name for name, _ in calls]
        if expected is None:
            assert len(names) == 1
            assert names[0].startswith("all_gather")
        else:
            assert names == expected


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_tensor_alone_in_its_bucket_is_broadcast_from_the_parameter_itself(
    world: World,
) -> None:
    """A tensor larger than bucket_numel is its own bucket: no staging for it."""
    shapes = ((40,), (3,), (2,))
    right, kept, calls, sync = sync_case(world.rank, False, 8, "exchange", shapes=shapes)
    assert right
    assert kept
    assert ("broadcast", 40 * 4) in calls
    assert all(s.rows.shape[-1] < 40 for s in sync.slots.values())


@pytest.mark.parametrize("view", [False, True], ids=["staged", "bucket_view"])
@pytest.mark.world(3, backend="gloo", timeout=120)
def test_sync_params_of_sends_only_the_given_parameters(world: World, view: bool) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(4 + i, 1, bias=False) for i in range(6)])
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.fill_(float(world.rank))
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, parameters_as_bucket_view=view)
    with torch.no_grad():  # the constructor synced them; give every rank its own values again
        for p in params:
            p.fill_(float(world.rank))
    chosen = [params[4], params[1], params[2]]
    for handle in zero._sync_params_of(chosen, async_op=True):
        handle.wait()
    for p in params:
        owner = zero._param_to_rank[p]
        expected = owner if any(p is c for c in chosen) else world.rank
        assert torch.all(p == expected)
    with pytest.raises(ValueError, match=r"_sync_params_of: expected parameters of this"):
        zero._sync_params_of([torch.zeros(3)], async_op=False)


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_consolidation_gathers_tensors_without_pickling_them(
    world: World, n: int, partition: str
) -> None:
    """After the agreement on ``to`` (one all-gather of 16 bytes per rank), both partitions move
    tensors by the windowed gathers of [Note: consolidation by gathers]; greedy adds one
    all-gather of two sizes per rank and one gather of the metadata (no tensor data), and its
    gathers carry, in at most 8 W windows, the largest other rank's packed state. Nothing is
    broadcast, sent point to point or gathered as an object."""
    model = mlp(64, 4)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition=partition)
    model(torch.randn(3, 64)).sum().backward()
    zero.step()
    with recording() as calls:
        zero.consolidate_state_dict(to=1)
    agreement, *calls = calls
    assert agreement == (GATHER, 16 * n)
    if partition == "flat":  # shard's consolidation agrees on its own input too
        assert calls.count((GATHER, 16 * n)) == 1
        calls.remove((GATHER, 16 * n))
    names = sorted({name for name, _ in calls})
    if partition == "greedy":
        assert names == sorted({GATHER, "gather"})
        sizes, meta, *windows = calls
        assert sizes == (GATHER, 16 * n)  # every rank's (metadata, data) bytes
        assert meta[0] == "gather"
        assert meta[1] < 4096  # names, shapes, offsets: no tensor data
        assert len(windows) <= 8 * n
        owned = [
            sum(2 * p.numel() * 4 for p in model.parameters() if zero._param_to_rank[p] == r)
            for r in range(n)
            if r != 1
        ]
        padding = 16 * 3 * len(list(model.parameters()))  # each packed tensor 16-byte aligned
        assert max(owned) <= sum(size for _, size in windows) <= max(owned) + padding
    else:
        assert names == ["gather"]
    assert not any(name.startswith("broadcast") for name, _ in calls)
    if world.rank == 1:
        sd = zero.state_dict()
        assert len(sd["state"]) == len(list(model.parameters()))
