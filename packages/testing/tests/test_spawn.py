"""spawn: results in rank order, and failing, dying or hanging ranks reported with nothing left."""

from __future__ import annotations

import operator
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.testing import (
    Outcome,
    RankError,
    RankExitError,
    WorldError,
    WorldTimeoutError,
    cuda_device_count,
    current_world,
    spawn,
)

# Rank functions live at module level: spawn pickles them by reference, and the ranks load this
# file by path (it is not importable under --import-mode=importlib).


def describe_rank(rank: int, world_size: int) -> tuple[Any, ...]:
    world = current_world()
    return rank, world_size, world.rank, world.world_size, world.backend.value, world.device.type


def sum_ranks(rank: int, world_size: int, scale: float) -> float:
    value = torch.tensor([scale * (rank + 1)], device=current_world().device)
    dist.all_reduce(value)
    return value.item()


def read_environment(rank: int, world_size: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), torch.get_num_threads()


def say_hello(rank: int, world_size: int) -> None:
    print(f"hello from {rank}")


class Payload:
    """A class of this test file, sent to the ranks and back."""

    def __init__(self, value: int) -> None:
        self.value = value


def add_to_payload(rank: int, world_size: int, payload: Payload) -> Payload:
    return Payload(payload.value + rank)


def raise_on_rank(rank: int, world_size: int, bad: int, peers_sleep: bool) -> None:
    if rank == bad:
        raise ValueError(f"bad rank {rank}")
    if peers_sleep:
        time.sleep(3600)  # not in a collective: only the harness can stop this rank
    dist.barrier()  # blocks: the bad rank never joins


def exit_on_rank(rank: int, world_size: int, bad: int, code: int) -> None:
    if rank == bad:
        os._exit(code)
    dist.barrier()


def signal_on_rank(rank: int, world_size: int, bad: int, signum: int) -> None:
    if rank == bad:
        os.kill(os.getpid(), signum)
    dist.barrier()


def hang_on_rank(rank: int, world_size: int, bad: int, peers_wait: bool) -> None:
    if rank == bad:
        time.sleep(3600)
    if peers_wait:
        dist.barrier()


def return_unpicklable(rank: int, world_size: int) -> Any:
    return lambda: rank


@pytest.mark.parametrize("init_store", ["file", "tcp"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_spawn_returns_each_ranks_value_in_rank_order(
    world_size: int, init_store: str, no_leaks: Any
) -> None:
    results = spawn(describe_rank, world_size, backend="gloo", init_store=init_store)
    assert results == [(r, world_size, r, world_size, "gloo", "cpu") for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_auto_backend_is_nccl_with_a_gpu_per_rank_and_gloo_otherwise(world_size: int) -> None:
    gpus = cuda_device_count() >= world_size and dist.is_nccl_available()
    backend, device = ("nccl", "cuda") if gpus else ("gloo", "cpu")
    assert [r[4:] for r in spawn(describe_rank, world_size)] == [(backend, device)] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_all_reduce_over_the_whole_world(world_size: int) -> None:
    expected = 0.5 * world_size * (world_size + 1) / 2
    assert spawn(sum_ranks, world_size, 0.5) == [expected] * world_size


def test_operator_functions_and_partials_run_as_rank_functions() -> None:
    assert spawn(operator.add, 3) == [3, 4, 5]


def test_classes_of_a_test_file_travel_to_the_ranks_and_back() -> None:
    results = spawn(add_to_payload, 2, Payload(10))
    assert [p.value for p in results] == [10, 11]


def test_ranks_see_env_overrides_and_run_one_thread_by_default() -> None:
    results = spawn(read_environment, 2, "SHARDOPT_TEST_VAR", env={"SHARDOPT_TEST_VAR": "on"})
    assert results == [("on", 1), ("on", 1)]
    assert spawn(read_environment, 1, "SHARDOPT_TEST_VAR", num_threads=2) == [(None, 2)]


def test_ranks_see_the_callers_environment_as_of_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    spawn(operator.add, 1)  # the forkserver runs before the variable is set
    monkeypatch.setenv("SHARDOPT_TEST_LATE", "late")
    assert spawn(read_environment, 1, "SHARDOPT_TEST_LATE") == [("late", 1)]


def test_rank_output_is_replayed_prefixed_by_rank(capsys: pytest.CaptureFixture[str]) -> None:
    spawn(say_hello, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n" in out
    assert "[rank 1] hello from 1\n" in out


@pytest.mark.parametrize(
    ("world_size", "bad", "peers_sleep"),
    [(2, 1, False), (3, 0, False), (4, 2, False), (2, 0, True), (4, 3, True)],
)
def test_raising_rank_is_named_with_its_traceback_and_the_others_are_stopped(
    world_size: int, bad: int, peers_sleep: bool, no_leaks: Any
) -> None:
    with pytest.raises(RankError) as info:
        spawn(raise_on_rank, world_size, bad, peers_sleep, timeout=60)
    error = info.value
    assert error.rank == bad
    head = f"spawn: rank {bad} of {world_size} raised ValueError: bad rank {bad}\n"
    assert str(error).startswith(head)
    assert 'raise ValueError(f"bad rank {rank}")' in error.traceback
    assert "in raise_on_rank" in str(error)
    assert isinstance(error.exception, ValueError)
    assert error.failures[0].outcome is Outcome.RAISED
    if peers_sleep:  # sleeping peers raise nothing: the harness stopped them
        assert sorted(error.stopped) == sorted(set(range(world_size)) - {bad})
    for pid in error.pids:
        assert not no_leaks.pid_alive(pid)


@pytest.mark.parametrize(("world_size", "bad", "code"), [(2, 1, 3), (3, 0, 0), (4, 2, 17)])
def test_rank_that_exits_early_is_reported_with_its_exit_code(
    world_size: int, bad: int, code: int, no_leaks: Any
) -> None:
    with pytest.raises(RankExitError) as info:
        spawn(exit_on_rank, world_size, bad, code, timeout=60)
    error = info.value
    assert error.ranks[0] == bad
    assert error.failures[0].exitcode == code
    head = f"spawn: rank {bad} of {world_size} exited with code {code} before returning a result"
    assert str(error).startswith(head)


@pytest.mark.parametrize(
    ("signum", "name"), [(signal.SIGKILL, "SIGKILL (9)"), (signal.SIGSEGV, "SIGSEGV (11)")]
)
def test_rank_killed_by_a_signal_is_reported_with_the_signal(
    signum: int, name: str, no_leaks: Any
) -> None:
    with pytest.raises(RankExitError) as info:
        spawn(signal_on_rank, 2, 1, signum, timeout=60)
    error = info.value
    assert error.ranks[0] == 1
    assert error.failures[0].exitcode == -signum
    assert str(error).startswith(f"spawn: rank 1 of 2 was killed by signal {name}")
    if signum == signal.SIGSEGV:  # faulthandler dumped the crashing rank's Python stack
        assert "in signal_on_rank" in error.failures[0].traceback


@pytest.mark.parametrize(("peers_wait", "late"), [(True, [0, 1]), (False, [1])])
def test_hanging_rank_times_out_naming_the_late_ranks_with_their_stacks(
    peers_wait: bool, late: list[int], no_leaks: Any
) -> None:
    with pytest.raises(WorldTimeoutError) as info:
        spawn(hang_on_rank, 2, 1, peers_wait, timeout=5)
    error = info.value
    assert list(error.ranks) == late
    assert str(error).startswith(f"spawn: ranks {late} of 2 did not finish within 5 s")
    stacks = {f.rank: f.traceback for f in error.failures}
    assert "in hang_on_rank" in stacks[1]
    assert "_exit_when_parent_dies" not in stacks[1]  # the harness's own thread is left out
    if peers_wait:
        assert "in barrier" in stacks[0]


@pytest.mark.slow
def test_ranks_exit_when_the_parent_process_dies(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import os, time
        from shardopt.testing import spawn

        def record_and_sleep(rank, world_size, path):
            with open(path, "a") as file:
                file.write(f"{{os.getpid()}}\\n")
            time.sleep(3600)

        if __name__ == "__main__":
            spawn(record_and_sleep, 2, {str(pid_file)!r}, timeout=600)
        """
    )
    (tmp_path / "orphans.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "orphans.py")], cwd=tmp_path)
    try:
        pids = _wait_for_lines(pid_file, 2, parent)
    finally:
        parent.kill()
        parent.wait()
    for pid in pids:
        assert _wait_until_gone(pid), f"rank process {pid} outlived its parent"


def _wait_for_lines(path: Path, count: int, parent: subprocess.Popen[bytes]) -> list[int]:
    for _ in range(1200):  # the child imports torch and starts a forkserver first
        if path.exists() and len(lines := path.read_text().split()) >= count:
            return [int(line) for line in lines]
        assert parent.poll() is None, "the spawning script ended early"
        time.sleep(0.1)
    raise AssertionError("the ranks never started")


def _wait_until_gone(pid: int) -> bool:
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_unpicklable_function_is_refused_before_any_rank_starts(no_leaks: Any) -> None:
    with pytest.raises(TypeError, match="spawn: fn and args must be picklable"):
        spawn(lambda rank, world_size: rank, 2)


def test_unpicklable_return_value_is_the_ranks_error() -> None:
    with pytest.raises(RankError, match="rank 0 returned a value that cannot be pickled"):
        spawn(return_unpicklable, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "spawn: expected an int world_size >= 1, got 0"),
        ({"world_size": True}, ValueError, "spawn: expected an int world_size >= 1, got True"),
        ({"timeout": 0}, ValueError, "spawn: expected a finite timeout > 0 seconds, got 0"),
        ({"num_threads": 0}, ValueError, "spawn: expected an int num_threads >= 1, got 0"),
        ({"backend": "mpi"}, ValueError, "spawn: expected backend in .* got 'mpi'"),
        ({"init_store": "env"}, ValueError, "spawn: expected init_store in .* got 'env'"),
        ({"env": {"A": 1}}, TypeError, "spawn: expected env to map str to str"),
        ({"fn": 3}, TypeError, "spawn: expected fn to be callable, got 3"),
    ],
)
def test_bad_arguments_are_refused_with_the_rule_and_the_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {"fn": operator.add, "world_size": 1, **kwargs}
    with pytest.raises(error, match=match):
        spawn(arguments.pop("fn"), arguments.pop("world_size"), **arguments)


@pytest.mark.skipif(cuda_device_count() >= 2, reason="this machine has 2 CUDA devices")
def test_nccl_without_a_cuda_device_per_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="spawn: backend 'nccl' needs one CUDA device per rank"):
        spawn(operator.add, 2, backend="nccl")


def test_world_errors_survive_pickling() -> None:
    with pytest.raises(RankError) as info:
        spawn(raise_on_rank, 2, 1, True, timeout=60)
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, RankError)
    assert isinstance(copy, WorldError)
    assert str(copy) == str(info.value)
    assert copy.failures == info.value.failures
