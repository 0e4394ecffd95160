"""The parent's side of a world's processes: start, wait for reports, stop and reap."""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from shardopt.testing._errors import Outcome
from shardopt.testing._rank import STACK_SIGNAL, RankReport, RankSpec, run_rank
from shardopt.testing._warm_rank import serve_rank

__all__ = [
    "Collected",
    "RankProcess",
    "collect",
    "read_text",
    "replay_output",
    "start",
    "start_serving",
    "stop",
]

# [Note: forkserver]
# Each rank is a fresh process: forking the caller is unsafe once torch has started threads
# (OpenMP pools, the TCPStore's libuv loop, CUDA). Plain "spawn" re-imports torch in every
# rank, which costs seconds a world. A forkserver is a clean server process started once per
# caller process; with torch preloaded in it, a rank is a fork of an idle interpreter that has
# torch imported (a world then costs a small fraction of that; measured: docs/performance.md).
# torch._dynamo is preloaded too: the first torch.optim optimizer a process builds imports it
# (seconds), and nearly every world here builds one. The server runs a single thread after the
# preload (checked in /proc/<pid>/task, with and without OMP_NUM_THREADS) and none of these
# imports initialises CUDA, so forking it stays safe, for NCCL ranks too. Where forkserver does
# not exist (Windows), plain spawn is used. The server outlives the call by design, holds no
# rank, and ends with the caller.
_PRELOAD = ("shardopt.testing._preload",)
# Seconds a rank that reported its result gets to exit before it is stopped. A clean exit takes
# well under a second; one that takes longer is stuck behind a collective its peers never
# joined (gloo's threads wait out the group's timeout at exit), and its result is in already.
_EXIT_GRACE_S = 2.0
# Seconds the other ranks get to report after a first failure (see [Note: failure grace]).
_FAILURE_GRACE_S = 1.0
# Seconds to wait for faulthandler's stack dumps of the ranks that missed the deadline.
_STACK_WAIT_S = 2.0


@dataclass
class RankProcess:
    """The parent's handle on one rank."""

    spec: RankSpec
    process: Any  # multiprocessing.process.BaseProcess
    conn: Connection  # results arrive here
    alive: Connection  # held open while the rank may run (see [Note: orphaned ranks])
    pid: int | None = None
    exitcode: int | None = None  # set once the process is reaped
    jobs: Connection | None = None  # a warm rank's jobs go here ([Note: warm worlds])


@dataclass
class Collected:
    """What the parent learnt while waiting: results, failure events, ranks still running."""

    results: dict[int, bytes] = field(default_factory=dict)
    events: list[tuple[int, Outcome, RankReport | None]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


@functools.cache
def _context() -> Any:  # a ForkServerContext, or a SpawnContext where there is no forkserver
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(_PRELOAD))
        atexit.register(_stop_helpers)
        return context
    return multiprocessing.get_context("spawn")


def _stop_helpers() -> None:
    """Stops and reaps the forkserver and the resource tracker when this process exits.

    Left alone they end on their own once this process is gone, but then as orphans, which
    stay zombies where PID 1 does not reap (containers without an init). The stop methods
    are private to multiprocessing, hence the guards.
    """
    helpers = (
        getattr(multiprocessing.forkserver, "_forkserver", None),
        getattr(multiprocessing.resource_tracker, "_resource_tracker", None),
    )
    for helper in helpers:
        with contextlib.suppress(Exception):
            helper._stop()  # type: ignore[union-attr]


def start(spec: RankSpec) -> RankProcess:
    """Starts a fresh rank that runs ``spec``'s function and exits."""
    return _start(spec, serving=False)


def start_serving(spec: RankSpec) -> RankProcess:
    """Starts a warm rank: it runs the jobs (rank specs) sent on its ``jobs`` pipe until the
    pipe closes ([Note: warm worlds] in _pool.py). ``spec`` names it; send it as a job too."""
    return _start(spec, serving=True)


def _start(spec: RankSpec, *, serving: bool) -> RankProcess:
    context = _context()
    conn, child_conn = context.Pipe(duplex=False)
    child_alive, alive = context.Pipe(duplex=False)
    ends = [conn, child_conn, child_alive, alive]
    jobs = None
    if serving:
        child_jobs, jobs = context.Pipe(duplex=False)
        ends += [child_jobs, jobs]
        target: Any = serve_rank
        args: tuple[Any, ...] = (child_jobs, child_conn, child_alive)
    else:
        target, args = run_rank, (spec, child_conn, child_alive)
    process = context.Process(
        target=target, args=args, name=f"shardopt-rank-{spec.rank}", daemon=True
    )
    try:
        process.start()
    except BaseException:
        for end in ends:
            end.close()
        raise
    child_conn.close()  # the rank holds the only write end: end-of-file means it is gone
    child_alive.close()
    if serving:
        ends[4].close()
    return RankProcess(
        spec=spec, process=process, conn=conn, alive=alive, pid=process.pid, jobs=jobs
    )


def collect(ranks: list[RankProcess], deadline: float) -> Collected:
    collected = Collected()
    pending = {r.spec.rank: r for r in ranks}
    while pending and not collected.events:
        if time.monotonic() >= deadline:
            _dump_stacks([pending[rank] for rank in sorted(pending)])
            collected.events = [(rank, Outcome.TIMED_OUT, None) for rank in sorted(pending)]
            collected.pending = sorted(pending)
            return collected
        _wait_once(pending, collected, deadline)
    # [Note: failure grace] The first failure seen is not always the root cause: when a rank
    # dies, its peers' "connection closed" errors can reach us before the end of its pipe
    # does (the kernel closes a dying process's sockets and pipes one by one). So the ranks
    # still running get a moment to report too, and the events are then ordered.
    grace_end = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    while pending and collected.events and time.monotonic() < grace_end:
        _wait_once(pending, collected, grace_end)
    collected.events.sort(key=_event_order)
    collected.pending = sorted(pending)
    return collected


def _wait_once(pending: dict[int, RankProcess], collected: Collected, until: float) -> None:
    """Waits until a pending rank reports or ends (or ``until``), and records what happened."""
    owners: dict[Any, RankProcess] = {}
    for r in pending.values():
        owners[r.conn] = r
        owners[r.process.sentinel] = r
    timeout = max(0.0, until - time.monotonic())
    ready = multiprocessing.connection.wait(list(owners), timeout=timeout)
    for rank in sorted({owners[w].spec.rank for w in ready}):
        _receive(pending[rank], pending, collected)


def _receive(r: RankProcess, pending: dict[int, RankProcess], collected: Collected) -> None:
    """Handles a rank whose pipe or process sentinel is ready."""
    rank = r.spec.rank
    data: bytes | None = None
    if r.conn.poll():
        try:
            data = r.conn.recv_bytes()
        except (EOFError, OSError):
            data = None  # the pipe closed without a report: the process is gone
    elif not _ended(r):
        return  # a spurious wake-up: nothing to read, still running
    pending.pop(rank)
    if data is None:
        collected.events.append((rank, Outcome.EXITED, None))
        return
    report: RankReport = pickle.loads(data)
    if report.ok:
        collected.results[rank] = report.result
    else:
        collected.events.append((rank, Outcome.RAISED, report))


def _ended(r: RankProcess) -> bool:
    r.process.join(timeout=0)
    return r.process.exitcode is not None


def _event_order(event: tuple[int, Outcome, RankReport | None]) -> tuple[int, float, int]:
    # [Note: root cause first] A rank that died takes the others' collectives down with it, and
    # a rank that raised did so before the errors it caused in its peers: so a death comes
    # first, then exceptions in the order the ranks caught them (monotonic clocks are shared
    # by the processes of one machine), then ranks that missed the deadline.
    rank, outcome, report = event
    priority = {Outcome.EXITED: 0, Outcome.RAISED: 1, Outcome.TIMED_OUT: 2}[outcome]
    return (priority, report.raised_at if report is not None else 0.0, rank)


def _dump_stacks(late: list[RankProcess]) -> None:
    asked = []
    for r in late:
        pid = r.process.pid
        if pid is not None and r.process.exitcode is None:
            try:
                os.kill(pid, STACK_SIGNAL)
                asked.append(r)
            except OSError:
                pass
    until = time.monotonic() + _STACK_WAIT_S
    while asked and time.monotonic() < until:
        asked = [r for r in asked if read_text(r.spec.stack_path).count("\n") < 2]
        time.sleep(0.05)


def stop(ranks: list[RankProcess], finished: set[int]) -> None:
    """Stops and reaps every rank. When every rank finished, they get a grace period to exit;
    otherwise those that finished wait for their peers (see [Note: leave together]) and are
    stopped with the rest."""
    everyone = len(finished) == len(ranks)
    for r in ranks:
        if (not everyone or r.spec.rank not in finished) and r.process.exitcode is None:
            r.process.terminate()
    until = time.monotonic() + _EXIT_GRACE_S
    for r in ranks:
        r.process.join(max(0.0, until - time.monotonic()))
        if r.process.exitcode is None:
            r.process.kill()
            r.process.join()
    for r in ranks:
        r.exitcode = r.process.exitcode
        r.conn.close()
        r.alive.close()
        if r.jobs is not None:
            r.jobs.close()
        r.process.close()


def replay_output(ranks: list[RankProcess]) -> None:
    if sys.stdout is None:
        return
    for r in ranks:
        text = read_text(r.spec.log_path)
        if text:
            lines = text.splitlines(keepends=True)
            sys.stdout.write("".join(f"[rank {r.spec.rank}] {line}" for line in lines))
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return ""
