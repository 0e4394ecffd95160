"""Warm worlds: ranks kept alive between ``spawn`` calls, one pool per world size in each
calling process (see [Note: warm worlds])."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from shardopt.testing._processes import Collected, RankProcess, collect, start_serving, stop
from shardopt.testing._rank import RankSpec

__all__ = ["close_pools", "pool_jobs", "pooling", "reusing_worlds", "run_pooled"]

# [Note: warm worlds]
# A fresh world forks its ranks, loads what the function needs, joins a group and tears it all
# down at the end: about 70 ms at W = 2 on 2 cores, a fifth of it destroying gloo's group. A pool
# keeps a world size's ranks and their process group alive between calls, per calling process
# (so per pytest-xdist worker). Each call is a job on the pool's ranks, which first
#
# - take the job's environment, thread count, log and stack files, as a fresh rank does;
# - reset torch's default generator to a fresh process's seed, and torch._dynamo's caches;
# - meet in a barrier on the pool's group (made by the first job, on the pool's own FileStore).
#
# After the job every rank meets the others in a barrier again and checks that the job left
# nothing behind (``_after_job`` in _warm_rank.py): the world group still up and the only one,
# no child process, no new Python thread, torch's grad mode, default dtype, determinism and
# anomaly switches as they were. A rank that finds a leak exits, and the pool is replaced. A job
# that fails (a rank raised, died, or missed the deadline) stops every rank of the pool as a
# fresh world's are stopped, with the same error; the next call starts a new pool. So a failure
# costs one pool start and never reaches the next call.
#
# Pooled: gloo worlds without environment overrides (a module may read them at import) and
# with the FileStore rendezvous, inside ``reusing_worlds()``, which the pytest plugin enters
# for the session (``--fresh-worlds`` turns it off). Fresh processes, as before: NCCL worlds,
# ``spawn(..., fresh=True)``, the world marker's ``fresh=True``, and tests that use
# ``no_leaks`` (it counts processes and files).
_GROUP_TIMEOUT_S = 900.0  # the pool group's collectives: longer than a job's usual deadline


@dataclass
class _Pool:
    ranks: list[RankProcess]
    directory: str  # the pool group's FileStore
    jobs: int = 0
    busy: bool = False  # running a job (another thread's call then gets fresh ranks)
    unchecked: str = ""  # the last job, whose after-job reports are not read yet

    leaked: bool = False

    @property
    def alive(self) -> bool:
        return not self.leaked and all(r.process.exitcode is None for r in self.ranks)


_POOLS: dict[tuple[int, int], _Pool] = {}  # by (world size, threads)
_ENABLED = [False]
_AT_EXIT = [False]
_LOCK = threading.Lock()


def pooling() -> bool:
    """Whether ``spawn`` runs eligible worlds on warm ranks in this process."""
    return _ENABLED[0]


@contextlib.contextmanager
def reusing_worlds(enabled: bool = True) -> Iterator[None]:
    """Inside, ``spawn`` runs gloo worlds on warm ranks ([Note: warm worlds]); with
    ``enabled=False``, on fresh ones. The pools outlive the block; :func:`close_pools` (run at
    exit too) stops them."""
    previous, _ENABLED[0] = _ENABLED[0], bool(enabled)
    try:
        yield
    finally:
        _ENABLED[0] = previous


def pool_jobs() -> dict[tuple[int, int], int]:
    """Jobs run by each live pool, by (world size, threads): a pool that was replaced counts
    from its start."""
    return {key: pool.jobs for key, pool in _POOLS.items()}


def close_pools() -> None:
    """Stops every pool: its ranks leave the group together and exit."""
    while _POOLS:
        with _LOCK:
            _, pool = _POOLS.popitem()
        for r in pool.ranks:
            if r.jobs is not None:
                r.jobs.close()
        _retire(pool, pool.ranks, finished={r.spec.rank for r in pool.ranks})


def _retire(pool: _Pool, ranks: list[RankProcess], finished: set[int]) -> None:
    stop(ranks, finished=finished)
    for r, kept in zip(ranks, pool.ranks):
        kept.exitcode = r.exitcode
    shutil.rmtree(pool.directory, ignore_errors=True)


def _pool_for(specs: list[RankSpec]) -> _Pool | None:
    """The pool of the specs' size, started if need be and marked busy; None while it is busy
    (worlds run side by side from threads: the second one runs fresh)."""
    with _LOCK:
        pool = _idle_pool(specs)
        if pool is not None:
            pool.busy = True
        return pool


def _idle_pool(specs: list[RankSpec]) -> _Pool | None:
    key = (specs[0].world_size, specs[0].num_threads)
    pool = _POOLS.get(key)
    if pool is not None and pool.busy:
        return None
    if pool is not None and pool.unchecked:  # the last job's after-job checks
        job, pool.unchecked = pool.unchecked, ""
        pool.leaked = not _all_clean(pool.ranks, job)
    if pool is not None and not pool.alive:
        del _POOLS[key]
        _retire(pool, pool.ranks, finished=set())
        pool = None
    if pool is None:
        if not _AT_EXIT[0]:  # registered after the forkserver's exit handler, so it runs first
            atexit.register(close_pools)
            _AT_EXIT[0] = True
        directory = tempfile.mkdtemp(prefix="shardopt-pool-")
        pool = _POOLS[key] = _Pool([start_serving(spec) for spec in specs], directory)
    return pool


def run_pooled(specs: list[RankSpec], timeout: float) -> tuple[list[RankProcess], Collected] | None:
    """Runs one world (its ranks' specs) as a job on the pool of its size; returns the ranks
    (with the job's specs) and what was collected, or None where that pool is busy. A failed or
    leaking job retires the pool."""
    pool = _pool_for(specs)
    if pool is None:
        return None
    store = os.path.join(pool.directory, "store")
    jobs = [replace(s, store_path=store, timeout=max(s.timeout, _GROUP_TIMEOUT_S)) for s in specs]
    ranks = [replace(r, spec=spec) for r, spec in zip(pool.ranks, specs)]
    collected, clean = Collected(), False
    try:
        for r, job in zip(ranks, jobs):
            r.jobs.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))  # type: ignore[union-attr]
        collected = collect(ranks, time.monotonic() + timeout)
        clean = not collected.events
        if not clean:
            _log_retirement(specs, collected)
        else:  # read the ranks' after-job checks at the next call: they run meanwhile
            pool.unchecked = os.environ.get("PYTEST_CURRENT_TEST", "a job")
    finally:
        pool.jobs += 1
        if not clean:
            with _LOCK:
                del _POOLS[(specs[0].world_size, specs[0].num_threads)]
            done = set(collected.results) if collected.events else set()
            _retire(pool, ranks, finished=done)
        pool.busy = False
    return ranks, collected


_LEAKS: list[str] = []  # the last job's after-job reports that were not clean


def _all_clean(ranks: list[RankProcess], job: str) -> bool:
    """Reads each rank's after-job check of ``job``: False if one leaked, ended, or is late."""
    deadline = time.monotonic() + 30.0
    _LEAKS.clear()
    for r in ranks:
        if not multiprocessing.connection.wait([r.conn], max(0.0, deadline - time.monotonic())):
            _LEAKS.append(f"rank {r.spec.rank}: no after-job report in 30 s")
            continue
        try:
            leak = pickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            leak = "ended"
        if leak:
            _LEAKS.append(f"rank {r.spec.rank}: {leak}")
    if _LEAKS:
        _log(len(ranks), job, "; ".join(_LEAKS))
    return not _LEAKS


def _log_retirement(specs: list[RankSpec], collected: Collected) -> None:
    why = f"failed: {[(e[0], e[1].value) for e in collected.events]}"
    _log(specs[0].world_size, os.environ.get("PYTEST_CURRENT_TEST", "a job"), why)


def _log(world_size: int, job: str, why: str) -> None:
    """Appends why a pool was replaced to the file SHARDOPT_POOL_LOG names (a debugging aid)."""
    if os.environ.get("SHARDOPT_POOL_LOG"):
        with open(os.environ["SHARDOPT_POOL_LOG"], "a") as file:
            file.write(f"W={world_size} {job}: {why}\n")
