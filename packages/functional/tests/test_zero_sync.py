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
from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.optim._zero_sync import ParamSync
from shardopt.testing import World

RECORDED = ("all_gather_single", "all_gather_into_tensor", "broadcast", "gather", "gather_object")
RECORDED += ("isend", "irecv", "send", "recv", "all_gather", "broadcast_object_list")


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


def sync_case(
    rank: int,
    view: bool,
    staging: int,
    algorithm: str,
    direct: int = 1 << 30,
    shapes: tuple[tuple[int, ...], ...] = ((7, 3), (11,), (5, 5), (2,), (13, 2), (1,), (9,)),
) -> tuple[bool, bool, int]:
    params = [torch.full(s, float(rank + 1)) for s in shapes]  # every rank its own values
    plan = plan_partition(params, dist.get_world_size(), strategy="greedy")
    ptrs = [p.data_ptr() for p in params]
    options = {"staging_numel": staging, "direct_numel": direct, "algorithm": algorithm}
    sync = ParamSync(plan, params, rank, None, views=view, **options)
    with recording() as calls:
        sync.sync()
    assert plan.owners is not None
    right = all(torch.all(p == plan.owners[t] + 1) for t, p in enumerate(params))
    kept = [p.data_ptr() for p in params] == ptrs
    staged = [s.numel() for s in sync._staging if s is not None]
    assert all(size <= staging for size in staged)
    return right, kept, len(calls)


def small_owners(n: int) -> set[int]:
    """The ranks owning the tensors of fewer than 10 elements in :func:`sync_case`."""
    numels = [21, 11, 25, 2, 26, 1, 9]
    owners = plan_partition([((k,), "float32") for k in numels], n, strategy="greedy").owners
    assert owners is not None
    return {owners[t] for t, k in enumerate(numels) if k < 10}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_staged_and_view_syncs_deliver_every_owner_s_values(world: World, n: int) -> None:
    """Both storages, both collective algorithms, and a staging buffer far smaller than the
    parameters (many chunks): every parameter ends with its owner's values; staged syncs leave
    the parameters in their own storage and keep the staging within its bound."""
    for view in (False, True):
        for algorithm in ("rooted", "collective"):
            right, kept, calls = sync_case(world.rank, view, 4 * n, algorithm)
            assert right, (view, algorithm)
            assert kept != view, (view, algorithm)
            if view:  # unequal blocks: one broadcast per rank, whatever the algorithm
                assert calls == n
    balanced = ((6, 4),) * n + ((5,),) * n
    for algorithm in ("rooted", "collective"):  # equal blocks: all-gathered in place
        right, _, calls = sync_case(world.rank, True, 4 * n, algorithm, shapes=balanced)
        assert right
        assert calls == (n if algorithm == "rooted" else 1)
    # staged, rooted: the 4 tensors of >= 10 elements in place, the 3 small ones packed in one
    # chunk: one broadcast per rank owning one of them
    right, kept, calls = sync_case(world.rank, False, 1 << 10, "rooted", direct=10)
    assert right
    assert kept
    assert calls == 4 + len(small_owners(n))


@pytest.mark.parametrize("view", [False, True], ids=["staged", "bucket_view"])
@pytest.mark.world(3, backend="gloo", timeout=120)
def test_sync_params_of_sends_only_the_given_parameters(world: World, view: bool) -> None:
    params = [torch.full((4 + i,), float(world.rank)) for i in range(6)]
    plan = plan_partition(params, 3, strategy="greedy")
    sync = ParamSync(plan, params, world.rank, None, views=view)
    chosen = [params[4], params[1], params[2]]
    for handle in sync.sync_of(chosen, async_op=True):
        handle.wait()
    assert plan.owners is not None
    for t, p in enumerate(params):
        expected = plan.owners[t] if any(p is c for c in chosen) else world.rank
        assert torch.all(p == expected), t
    with pytest.raises(ValueError, match=r"_sync_params_of: expected parameters of this"):
        sync.sync_of([torch.zeros(3)], async_op=False)


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_consolidation_gathers_tensors_without_pickling_them(
    world: World, n: int, partition: str
) -> None:
    """Greedy: one small object gather (metadata), then one buffer per other rank, point to point
    to the target; flat: tensor gathers only. Nothing is broadcast; the tensors moved add up to
    the other ranks' state."""
    model = mlp(64, 4)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition=partition)
    model(torch.randn(3, 64)).sum().backward()
    zero.step()
    with recording() as calls:
        zero.consolidate_state_dict(to=1)
    names = sorted({name for name, _ in calls})
    state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())  # exp_avg, exp_avg_sq
    if partition == "greedy":
        assert names == (
            ["gather_object", "irecv"] if world.rank == 1 else ["gather_object", "isend"]
        )
        meta = [size for name, size in calls if name == "gather_object"]
        assert meta[0] < 4096  # names, shapes, offsets, steps: no tensor data
        if world.rank == 1:
            mine = sum(2 * p.numel() * 4 for p in model.parameters() if zero._param_to_rank[p] == 1)
            moved = sum(size for name, size in calls if name == "irecv")
            assert state_bytes - mine <= moved <= state_bytes - mine + 16 * 3 * 8
    else:
        assert names == ["gather"]
    assert not any(name.startswith("broadcast") for name, _ in calls)
    if world.rank == 1:
        sd = zero.state_dict()
        assert len(sd["state"]) == len(list(model.parameters()))
