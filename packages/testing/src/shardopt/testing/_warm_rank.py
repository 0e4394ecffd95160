"""The child side of a warm world: a rank that runs job after job on one process group, and
checks after each that the job left the process as it found it ([Note: warm worlds])."""

from __future__ import annotations

import multiprocessing
import operator
import pickle
import sys
import threading
import traceback
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from shardopt.testing._rank import (
    RankSpec,
    join_group,
    leave_group,
    redirect,
    run_job,
    watch_parent,
)
from shardopt.testing._world import World, set_current_world

__all__ = ["serve_rank"]


@dataclass(frozen=True, slots=True)
class _Globals:
    """What a job may change in the process and must leave as it found it."""

    default_dtype: torch.dtype
    grad_enabled: bool
    deterministic: bool
    anomaly: bool
    python_threads: int

    @staticmethod
    def now() -> _Globals:
        return _Globals(
            torch.get_default_dtype(),
            torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_anomaly_enabled(),
            threading.active_count(),
        )


def serve_rank(jobs: Connection, result_conn: Connection, alive_conn: Connection) -> None:
    """Entry point of a warm rank: runs the jobs (rank specs) sent on ``jobs`` until it closes.
    After each it sends the report, then what the job leaked ("" for nothing); it exits after a
    failure or a leak."""
    watch_parent(alive_conn)
    seed, fresh = torch.initial_seed(), None
    while True:
        try:
            spec: RankSpec = pickle.loads(jobs.recv_bytes())
        except (EOFError, OSError):  # the pool is closed
            leave_group(together=True)
            return
        redirect(spec)
        torch.manual_seed(seed)  # a fresh process's default generator
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()  # compiled code and recompile counts, as a fresh process's
        fresh = fresh or _Globals.now()  # (after the first redirect: its threads are up)
        report = run_job(spec, join=_join_or_keep)
        result_conn.send_bytes(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
        leak = "the job failed"
        if report.ok:
            try:
                leak = _after_job(fresh)
            except Exception:
                traceback.print_exc()
                leak = "ending the job failed"
        result_conn.send_bytes(pickle.dumps(leak))
        if leak:
            return


def _join_or_keep(spec: RankSpec) -> World:
    """The pool's group: made by the first job, kept by the next ones (a barrier starts each).
    (Called once the job's function is loaded, so it also notes the modules' globals.)"""
    _BEFORE[:] = _module_globals({source.name for source in spec.sources})
    if not dist.is_initialized():
        join_group(spec)
        _BASE_STORE[:] = [dist.distributed_c10d._get_default_store()]
    _JOBS[0] += 1
    _use_store(dist.PrefixStore(f"job{_JOBS[0]}/", _BASE_STORE[0]))
    dist.barrier()
    group = dist.group.WORLD
    assert group is not None
    world = World(spec.rank, spec.world_size, spec.backend, torch.device("cpu"), group)
    set_current_world(world)
    return world


def _after_job(fresh: _Globals) -> str:
    """Waits for the other ranks, then says what the job leaked ("" for nothing)."""
    set_current_world(None)
    if not dist.is_initialized():
        return "the process group was destroyed"
    if not _in_step():
        return "the ranks ran different numbers of collectives"
    dist.barrier()
    if _group_count() != 1:
        return "process groups other than the world's"
    if multiprocessing.active_children():
        return "a child process"
    changed = _changed_globals(_BEFORE)
    _BEFORE.clear()
    if changed:
        return f"module globals replaced: {', '.join(changed[:5])}"
    now = _Globals.now()
    return "" if now == fresh else f"process globals {now} (fresh: {fresh})"


# Each job sees the pool group's store under a prefix of its own, so that keys a job leaves
# (shardopt's failure announcements, a test's own) never reach the next one: the default store
# torch hands out (``_get_default_store``) is the one its group table holds for the world group.
_BASE_STORE: list[Any] = []
_JOBS = [0]


def _use_store(store: Any) -> None:
    """Makes ``store`` the default store. (Where torch's group table differs, the job keeps the
    group's store: ``_in_step`` then fails on it too, so the pool serves that one job.)"""
    try:
        groups = dist.distributed_c10d._world.pg_map
        world = dist.group.WORLD
        backend, _ = groups[world]  # type: ignore[index]
        groups[world] = (backend, store)  # type: ignore[index]
    except (AttributeError, KeyError, TypeError, ValueError):
        pass


def _in_step() -> bool:
    """Whether every rank ran as many collectives on the world group (its sequence numbers,
    compared through the store): a barrier would otherwise meet another rank's collective."""
    world, store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    count = getattr(world, "_get_sequence_number_for_group", None)
    if count is None or not isinstance(store, dist.PrefixStore):
        return False  # not known: the pool is replaced (see _use_store)
    mine = str(count())
    store.set(f"collectives/{dist.get_rank()}", mine)
    theirs = [store.get(f"collectives/{r}").decode() for r in range(dist.get_world_size())]
    return theirs == [mine] * len(theirs)


def _group_count() -> int:
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = getattr(world, "pg_map", None)
    return 1 if groups is None else len(groups)


# A job's function runs in a process that later jobs reuse: one that replaces a module's global
# (a test that patches a function of shardopt, of its own test module, or of torch's main
# modules, and does not put it back, as a fresh process never needed) would change what the
# next job runs. So the globals of those modules are noted before the function runs, and a
# value replaced by another counts as a leak. A name first bound (a lazy cache, a submodule
# imported) or a value that was None does not: that is what a fresh process does too.
_TORCH_MODULES = frozenset(
    ("torch", "torch.optim", "torch.distributed", "torch.nn", "torch.nn.functional")
)
_BEFORE: list[tuple[str, dict[str, Any], dict[str, Any]]] = []


def _module_globals(extra: set[str]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, namespace, a copy of it) of every shardopt module, torch's main ones and
    ``extra``."""
    return [
        (name, vars(module), dict(vars(module)))
        for name, module in list(sys.modules.items())
        if name.startswith("shardopt") or name in _TORCH_MODULES or name in extra
    ]


def _changed_globals(before: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The ``module.name`` globals replaced since ``before`` was noted."""
    changed = []
    for name, live, copy in before:
        if len(live) == len(copy) and all(map(operator.is_, live.values(), copy.values())):
            continue  # the usual case, at C speed
        for key, value in copy.items():
            now = live.get(key, _MISSING)
            if now is value or value is None or key.startswith("__"):
                continue
            if isinstance(value, types.ModuleType) and isinstance(now, types.ModuleType):
                continue
            changed.append(f"{name}.{key}")
    return changed


_MISSING = object()
