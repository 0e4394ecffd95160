"""Worlds of the CLI: local processes whose rank 0 prints live, or the world torchrun started."""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = [
    "TorchrunEnv",
    "launch",
    "leave_torchrun_worker",
    "resolve_backend",
    "run_under_torchrun",
    "torchrun_env",
]

# [Note: CLI worlds]
# The CLI runs in one of two worlds, by one path. Under torchrun, this process is a rank:
# ``run_under_torchrun`` joins the world from torchrun's variables. Run plainly, ``launch`` starts
# the ranks on this machine with torch's elastic launcher, the API behind torchrun (an agent in this
# process, a c10d rendezvous on a port the system picks, ranks spawned as fresh interpreters given
# this process's sys.path, so ``fn`` is any module-level function importable here), and each rank
# runs ``run_under_torchrun`` too. The ranks share this terminal (rank 0 draws the progress bar, the
# others print nothing; a test harness would hold the output back until the world ends). With no
# restarts, the agent stops every rank when it sees one exit with an error, and reports that one
# (only: its exit code). A rank that fails writes a report (its traceback and the machine's
# monotonic clock, shared by its processes) while the world is still up, whether it failed in
# ``fn`` or around it (joining the group, the last barrier); ``launch`` raises the earliest
# report. Its peers soon fail too (their collectives lose a peer), so a rank that reported waits
# a moment before it exits: a rank that dies without a word (a signal, ``os._exit``) exits at
# once, the agent sees it first, and it is raised as the root cause. The agent has no deadline, so
# each rank keeps its own: at ``timeout`` after the launch it exits with code ``_TIMED_OUT``, which
# the agent reports like any failure and ``launch`` raises as a TimeoutError. A rank whose ``fn``
# returned waits for its peers in a last barrier (see run_under_torchrun) and keeps a few seconds
# more, so that the rank still in ``fn`` is the one that times out. The TimeoutError names every
# rank whose ``fn`` had not returned (each that returned leaves a mark in its log directory), not
# only the one the agent saw first: under a slow start that may be a rank still joining. Ctrl-C
# in this process reaches the agent, which stops the ranks.
_TIMED_OUT = 124
# What the CLI's forkserver imports once (torch.optim's first optimizer in a process imports
# dynamo, seconds; the demo and the bench build several): none of it starts a thread or CUDA.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shardopt.functional")
_REPORT = "shardopt-failure.json"
_DONE = "shardopt-done.json"  # written by a rank whose ``fn`` returned
_REPORTED_EXIT_DELAY_S = 0.5
_FINISHED_GRACE_S = 5.0  # a rank that finished outlives the deadline by this, in the last barrier
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torchelastic")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """This process's place in a world started by torchrun (from its environment variables)."""

    rank: int
    world_size: int
    local_rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(
                f"torchrun: expected 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0, got RANK="
                f"{self.rank}, WORLD_SIZE={self.world_size}, LOCAL_RANK={self.local_rank}"
            )


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun.

    Example:
        >>> torchrun_env() is None or torchrun_env().world_size >= 1
        True
    """
    if not all(name in os.environ for name in _TORCHRUN_VARS):
        return None
    env = os.environ
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))


def resolve_backend(backend: str, local_ranks: int) -> str:
    """``"auto"`` is NCCL when there is one CUDA device per local rank, else gloo.

    Example:
        >>> resolve_backend("gloo", 2)
        'gloo'
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"expected backend auto, gloo or nccl, got {backend!r}")
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_nccl_available() and devices >= local_ranks
    if backend == "nccl" and not nccl:
        raise ValueError(
            f"expected --backend nccl only with NCCL and a CUDA device per local rank, got torch "
            f"{torch.__version__} with {devices} CUDA device(s) for {local_ranks} rank(s)"
        )
    if backend != "auto":
        return backend
    return "nccl" if nccl else "gloo"


def run_under_torchrun(
    fn: Callable[..., Any], env: TorchrunEnv, backend: str, *args: Any, timeout: float = 1800.0
) -> Any:
    """Runs ``fn(rank, world_size, *args)`` in this torchrun process (env:// rendezvous)."""
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        out = fn(env.rank, env.world_size, *args)
        # torch 2.4's gloo can hang in a rank's group destructor when a peer destroyed its own
        # group first (half of the launches under pytest): every rank leaves after all are done.
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def leave_torchrun_worker(status: int) -> NoReturn:
    """Ends this torchrun worker now, skipping interpreter teardown (see [Note: torchrun exit])."""
    # [Note: torchrun exit]
    # A torchrun worker of the demo that has left its process group and has nothing left to do
    # sometimes aborts while the interpreter tears down ("terminate called without an active
    # exception", SIGABRT, no Python frame: torch's C++ state destroyed at exit; seen about once
    # in ten runs on a loaded 2-core machine, torch 2.13 CPU, gloo). torchrun then reports the
    # whole run failed. So a torchrun worker of the demo ends with os._exit, after flushing its
    # output. The ranks ``launch`` starts cannot: they hand their result to the elastic agent
    # when ``fn`` returns, then exit normally (24 local demo runs, 12 of them beside two busy
    # loops, saw no abort there).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank_main(
    fn: Callable[..., Any],
    backend: str,
    timeout: float,
    deadline: float,
    threads: int,
    args: tuple[Any, ...],
) -> Any:
    """One local rank, started by the elastic agent: torchrun's path, with a deadline and a
    failure report (see [Note: CLI worlds])."""
    torch.set_num_threads(threads)
    watchdog = [_watchdog(deadline)]

    def then_wait(rank: int, world_size: int, *args: Any) -> Any:
        result = _reported(fn, rank, world_size, *args)
        _mark_done(rank)
        # done: what is left is the last barrier, where a stuck peer must time out first
        watchdog[0].cancel()
        watchdog[0] = _watchdog(deadline + _FINISHED_GRACE_S)
        return result

    env = torchrun_env()
    assert env is not None, "the elastic agent sets torchrun's variables"
    try:
        result = run_under_torchrun(then_wait, env, backend, *args, timeout=timeout)
        watchdog[0].cancel()  # what is left is waiting for the agent to collect the result
        return result
    except BaseException:  # see [Note: CLI worlds] for the wait
        _report(env.rank, first_only=True)  # a failure outside fn (joining, the last barrier)
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(_REPORTED_EXIT_DELAY_S)
        os._exit(1)


def _watchdog(deadline: float) -> threading.Timer:
    """A started daemon timer that ends this process with ``_TIMED_OUT`` at ``deadline``."""
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), os._exit, (_TIMED_OUT,))
    timer.daemon = True
    timer.start()
    return timer


def _reported(fn: Callable[..., Any], rank: int, world_size: int, *args: Any) -> Any:
    """``fn(rank, world_size, *args)``; a failure is written to this rank's error file first,
    stamped with the machine's monotonic clock, while the world is still up."""
    try:
        return fn(rank, world_size, *args)
    except BaseException:
        _report(rank)
        raise


def _log_dir() -> str:
    """This rank's log directory, which the elastic agent names in the rank's environment."""
    return os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])


def _mark_done(rank: int) -> None:
    """Records that this rank's ``fn`` returned: a timeout then names only the ranks still in it."""
    with open(os.path.join(_log_dir(), _DONE), "w", encoding="utf-8") as file:
        json.dump({"rank": rank}, file)


def _read_all(logs: str, name: str) -> list[dict[str, Any]]:
    """Every rank's file ``name`` under ``logs``, parsed; unreadable ones are left out."""
    found = []
    for path in glob.glob(os.path.join(logs, "**", name), recursive=True):
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as file:
            found.append(json.load(file))
    return found


def _report(rank: int, *, first_only: bool = False) -> None:
    """Writes the exception being handled to this rank's report (unless ``first_only`` and one
    is there), stamped with the machine's monotonic clock."""
    path = os.path.join(_log_dir(), _REPORT)
    if first_only and os.path.exists(path):
        return
    report = {"rank": rank, "when": time.monotonic(), "traceback": traceback.format_exc()}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(report, file)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 1800.0,
    api: str = "launch",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` local processes; their results.

    The ranks print to this process's terminal (see [Note: CLI worlds]). ``fn``, ``args`` and
    the results must be picklable. Raises RuntimeError (with the rank's traceback) when a rank
    fails and TimeoutError after ``timeout`` seconds; every rank is stopped in both cases.
    """
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"{api}: expected world size >= 1, got {world_size!r}")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="shardopt-launch-") as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=f"shardopt-{uuid.uuid4().hex}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"timeout": max(1, int(timeout))},
            max_restarts=0,
            monitor_interval=0.05,
            start_method=_start_method(),
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        entry = elastic_launch(config, _rank_main)
        error = None
        try:
            with _quiet_agent():
                results = entry(fn, backend, timeout, deadline, threads, args)
        except ChildFailedError as exc:
            error = _failure(exc, logs, api, world_size)
    if error is not None:
        raise error  # outside the handler: no context that would keep the agent alive
    return [results[rank] for rank in range(world_size)]


def _start_method() -> str:
    """``"forkserver"`` with torch preloaded (see [Note: CLI worlds]), or ``"spawn"`` where there
    is none (Windows). The preload is set only before this process's forkserver starts; one
    already running (the testing harness's, say) keeps its own preload."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        multiprocessing.set_forkserver_preload(list(_PRELOAD))
    return "forkserver"


def _failure(exc: ChildFailedError, logs: str, api: str, world_size: int) -> Exception:
    """The error of the rank that failed first (see [Note: CLI worlds])."""
    rank, failure = exc.get_first_failure()
    if failure.exitcode == _TIMED_OUT:
        # every rank whose fn had not returned: the agent stops the others without a record,
        # and under a slow start the first to time out may be one still joining the world
        done = {report["rank"] for report in _read_all(logs, _DONE)}
        stuck = [r for r in range(world_size) if r not in done]
        return TimeoutError(f"{api}: ranks {stuck} still running after the timeout")
    reports = {r["rank"]: (r["when"], r["traceback"]) for r in _read_all(logs, _REPORT)}
    if rank not in reports:  # died without a word: the likeliest root cause
        return RuntimeError(f"{api}: rank {rank} exited (code {failure.exitcode}) without a result")
    rank = min(reports, key=lambda r: reports[r][0])
    trace = reports[rank][1]
    return RuntimeError(f"{api}: rank {rank} failed:\n{trace}")


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Silences the elastic agent's own log lines (its failure table repeats what we raise)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_AGENT_LOGGERS)]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
