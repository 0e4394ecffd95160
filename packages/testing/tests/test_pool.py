"""Warm worlds ([Note: warm worlds]): a pool's ranks run call after call on one group, each call
as a fresh world would see it; a failure or a leak replaces the pool, and never reaches the
next call."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.testing import RankError, RankExitError, WorldTimeoutError, reusing_worlds, spawn
from shardopt.testing._pool import pool_jobs


def pid_and_sum(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid(), float(t.item())


def pids(world_size: int = 2, **kwargs: Any) -> list[int]:
    results = spawn(pid_and_sum, world_size, **kwargs)
    assert [s for _, s in results] == [float(world_size)] * world_size
    return [p for p, _ in results]


def exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def raises(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 says no")
    dist.barrier()


def hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)  # past the deadline


def leaves_a_group(rank: int, world_size: int) -> None:
    dist.new_group(list(range(world_size)))


def leaves_float64(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)


def draws(rank: int, world_size: int) -> list[float]:
    return torch.randn(3).tolist()


def default_dtype(rank: int, world_size: int) -> str:
    return str(torch.get_default_dtype())


def test_a_warm_world_runs_call_after_call_on_the_same_ranks():
    with reusing_worlds():
        first = pids()
        assert [pids() for _ in range(5)] == [first] * 5
        assert pids(3) != first  # a pool per world size
        assert pids() == first


def test_calls_that_ask_for_fresh_ranks_get_them_and_leave_the_pool_alone():
    with reusing_worlds():
        warm = pids()
        assert pids(fresh=True) != warm
        assert pids(env={"SHARDOPT_TEST": "1"}) != warm  # a module may read it at import
        assert pids(init_store="tcp") != warm
        assert pids() == warm
    with reusing_worlds(False):
        assert pids() != warm


@pytest.mark.parametrize(
    ("fn", "error", "text"),
    [
        (exits, RankExitError, "rank 1 of 2 exited with code 3"),
        (raises, RankError, "rank 0 says no"),
        (hangs, WorldTimeoutError, "rank 1"),
    ],
    ids=["a rank exits", "a rank raises", "a rank hangs"],
)
def test_a_failed_call_fails_alone_with_a_fresh_worlds_error_and_the_next_gets_a_new_pool(
    fn, error, text
):
    with reusing_worlds():
        warm = pids()
        with pytest.raises(error, match=text):
            spawn(fn, 2, timeout=3.0)
        after = pids()
        assert not set(after) & set(warm)
        assert pids() == after


@pytest.mark.parametrize("fn", [leaves_a_group, leaves_float64], ids=["a group", "a global"])
def test_a_call_that_leaks_passes_and_the_next_gets_a_new_pool_without_the_leak(fn):
    with reusing_worlds():
        warm = pids()
        spawn(fn, 2)
        assert not set(pids()) & set(warm)
        assert spawn(default_dtype, 2) == ["torch.float32"] * 2


def test_every_call_draws_what_a_fresh_process_draws():
    fresh = spawn(draws, 2, fresh=True)
    with reusing_worlds():
        assert [spawn(draws, 2) for _ in range(3)] == [fresh] * 3


def test_the_pool_counts_its_jobs():
    with reusing_worlds():
        pids()
        before = pool_jobs()[(2, 1)]
        pids()
        assert pool_jobs()[(2, 1)] == before + 1
