"""Worlds of the CLI: local processes whose rank 0 prints live, or the world torchrun started."""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "TorchrunEnv",
    "launch",
    "leave_torchrun_worker",
    "resolve_backend",
    "run_under_torchrun",
    "torchrun_env",
]

# [Note: CLI worlds]
# A test harness collects what ranks print and replays it when the world ends: right for tests,
# wrong for a progress bar. So the CLI starts its ranks itself, as children that share the
# terminal (rank 0 draws the bar, the others print nothing), with a TCPStore held by the parent
# on a port the system picks. Ranks are spawned (fresh interpreters given this process's
# sys.path, so ``fn`` is any module-level function importable here); torch's import costs a
# second or two per world, nothing beside a demo or a bench. Every rank is stopped and reaped
# whatever happens: a failure in one rank, a timeout, or Ctrl-C in the parent.
_EXIT_GRACE_S = 10.0
_FAILURE_GRACE_S = 1.0
# [Note: first failure]
# When a rank fails, its peers soon fail too (their collectives lose a peer), and their reports
# may arrive first. So after a first failure the others get a moment to report, and the failure
# that happened first (ranks stamp it with the machine's monotonic clock, shared by its
# processes) is the one raised; a rank that died without a word comes before all.
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
        return fn(env.rank, env.world_size, *args)
    finally:
        dist.destroy_process_group()


def leave_torchrun_worker(status: int) -> NoReturn:
    """Ends this torchrun worker now, skipping interpreter teardown (see [Note: torchrun exit])."""
    # [Note: torchrun exit]
    # A torchrun worker of the demo that has left its process group and has nothing left to do
    # sometimes aborts while the interpreter tears down ("terminate called without an active
    # exception", SIGABRT, no Python frame: torch's C++ state destroyed at exit; seen about once
    # in ten runs on a loaded 2-core machine, torch 2.13 CPU, gloo). torchrun then reports the
    # whole run failed. The ranks that multiprocessing starts never run that teardown (it ends
    # them with os._exit), so a torchrun worker ends the same way, after flushing its output.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout: float,
    threads: int,
    conn: multiprocessing.connection.Connection,
) -> None:
    """The body of one local rank: join the world, run ``fn``, send back its result."""
    torch.set_num_threads(threads)
    delta = datetime.timedelta(seconds=timeout)
    joined = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=delta)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=delta
        )
        joined = True
        report: tuple[str, Any, float] = ("ok", fn(rank, world_size, *args), 0.0)
    except BaseException:  # stamped before leaving the world: see [Note: first failure]
        report = ("error", traceback.format_exc(), time.monotonic())
    try:
        if joined:
            dist.destroy_process_group()
        try:
            conn.send(report)
        except Exception:  # a result that does not pickle
            conn.send(("error", traceback.format_exc(), time.monotonic()))
    finally:
        conn.close()


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
    context = multiprocessing.get_context("spawn")
    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=delta, wait_for_workers=False)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs: list[Any] = []
    conns: list[Any] = []
    finished = False
    try:
        for rank in range(world_size):
            mine, theirs = context.Pipe(duplex=False)
            proc = context.Process(
                target=_rank_main,
                args=(
                    fn,
                    args,
                    rank,
                    world_size,
                    backend,
                    store.port,
                    timeout,
                    threads,
                    theirs,
                ),
                name=f"shardopt-rank-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
        results = _collect(procs, conns, time.monotonic() + timeout, api)
        finished = True
        return results
    finally:
        _stop(procs, _EXIT_GRACE_S if finished else 0.0)
        for conn in conns:
            conn.close()
        del store


def _collect(procs: list[Any], conns: list[Any], deadline: float, api: str) -> list[Any]:
    """The ranks' results; or raises the root failure (see [Note: first failure])."""
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, str]] = []  # (when, rank, what)
    waiting = dict(enumerate(conns))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = multiprocessing.connection.wait(list(waiting.values()), timeout=left)
        for rank in [r for r, c in waiting.items() if c in ready]:
            try:
                status, value, when = waiting.pop(rank).recv()
            except EOFError:
                procs[rank].join(1.0)
                status, when = "exit", 0.0  # a dead rank is the likeliest root cause
                value = f"exited (code {procs[rank].exitcode}) without a result"
            if status == "ok":
                results[rank] = value
            else:
                failures.append((when, rank, value))
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if failures:
        _, rank, what = min(failures)
        kind = "failed:\n" if what.startswith("Traceback") else ""
        raise RuntimeError(f"{api}: rank {rank} {kind}{what}")
    if waiting:
        raise TimeoutError(f"{api}: ranks {sorted(waiting)} still running after the timeout")
    return [results[rank] for rank in range(len(conns))]


def _stop(procs: list[Any], grace: float) -> None:
    """Reaps the ranks: those still running get ``grace`` seconds to exit, then are stopped."""
    until = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, until - time.monotonic()))
        if proc.exitcode is None:
            proc.terminate()
            proc.join(1.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        proc.close()
