"""The CLI's worlds: results in rank order, a failing or stuck rank reported, no leftovers."""

from __future__ import annotations

import time

import pytest
import torch
from _launch_ranks import (
    dies_on_rank_1,
    fails_on_rank_1,
    stuck_on_every_rank,
    summed,
)

from shardopt.cli.launch import TorchrunEnv, launch, resolve_backend, torchrun_env


def test_launch_returns_each_ranks_result_in_rank_order(no_leaks):
    assert launch(summed, 3, 10, timeout=60.0) == [(0, 33), (1, 33), (2, 33)]


def test_launch_reports_the_failing_rank_with_its_traceback_and_stops_the_others(no_leaks):
    with pytest.raises(RuntimeError, match="rank 1 failed") as info:
        launch(fails_on_rank_1, 2, timeout=60.0, api="demo")
    assert "ZeroDivisionError: rank 1 divides by zero" in str(info.value)
    assert str(info.value).startswith("demo: ")


def test_launch_reports_a_rank_that_died_without_a_word_as_the_root_cause(no_leaks):
    with pytest.raises(RuntimeError, match=r"bench: rank 1 exited \(code 3\) without a result"):
        launch(dies_on_rank_1, 2, timeout=60.0, api="bench")


def test_a_timeout_stops_every_rank_and_names_each_still_running(no_leaks):
    # Every rank whose fn had not returned is named, not only the one the agent saw exit first
    # (under a slow start on 2 cores, one still joining the world may time out first).
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after the timeout"):
        launch(stuck_on_every_rank, 2, timeout=3.0)
    assert time.monotonic() - start < 60


def test_torchrun_env_is_read_from_torchruns_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() is None
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert torchrun_env() == TorchrunEnv(rank=3, world_size=8, local_rank=1)
    monkeypatch.setenv("RANK", "8")
    with pytest.raises(ValueError, match="expected 0 <= RANK < WORLD_SIZE"):
        torchrun_env()


def test_auto_backend_is_gloo_without_one_gpu_per_rank():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_backend("auto", gpus + 1) == "gloo"
    with pytest.raises(ValueError, match="expected backend auto, gloo or nccl, got 'mpi'"):
        resolve_backend("mpi", 1)
