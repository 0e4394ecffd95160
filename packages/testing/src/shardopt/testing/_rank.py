"""The child side of a world: set the process up, join the group, run the function, report."""

from __future__ import annotations

import datetime
import enum
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import IO, Any

import torch
import torch.distributed as dist

from shardopt.testing._modules import ModuleSource, loads_with_sources
from shardopt.testing._world import Backend, World, set_current_world

__all__ = ["STACK_SIGNAL", "RankReport", "RankSpec", "StoreType", "run_rank"]

# Sent by the parent to a rank that missed the deadline: faulthandler dumps its Python stacks.
STACK_SIGNAL = signal.SIGUSR1
# Exit code of a rank whose parent died (see [Note: orphaned ranks]).
_ORPHANED_EXIT_CODE = 75
# [Note: process-group timeout] The group's timeout bounds every collective, so that a rank
# can never block forever, even if the parent cannot stop it. It is longer than the world's
# timeout: the parent's deadline comes first and reports the late ranks with their stacks,
# rather than a rank reporting the collective timeout that the late rank caused.
_GROUP_TIMEOUT_MARGIN_S = 30.0


class StoreType(enum.Enum):
    """How the ranks rendezvous: a FileStore in the world's temp dir or the parent's TCPStore."""

    FILE = "file"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank needs, sent by the parent when it starts the process."""

    rank: int
    world_size: int
    backend: Backend
    store_type: StoreType
    store_path: str  # FileStore file (FILE)
    store_port: int  # parent's TCPStore port on 127.0.0.1 (TCP)
    timeout: float
    num_threads: int
    environ: dict[str, str]
    payload: bytes  # pickled (fn, args)
    sources: tuple[ModuleSource, ...]
    log_path: str  # the rank's stdout and stderr
    stack_path: str  # faulthandler's stack dumps
    devices: tuple[int, ...] = ()  # NCCL: each rank's leased CUDA device ([Note: device leases])


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank sends back: a pickled result, or what it raised."""

    ok: bool
    result: bytes = b""
    exception_type: str = ""
    message: str = ""
    traceback: str = ""
    exception: bytes = b""  # the pickled exception, b"" when it cannot be pickled
    raised_at: float = 0.0  # time.monotonic() when caught: orders failures across ranks


_STACK_FILE: IO[str] | None = None  # kept open for faulthandler for the process's lifetime


def run_rank(spec: RankSpec, result_conn: Connection, alive_conn: Connection) -> None:
    """Entry point of a rank's process (the target of its multiprocessing.Process)."""
    _prepare_process(spec, alive_conn)
    report = run_job(spec)
    # [Note: report before teardown] The report goes out before the group is destroyed: a
    # rank that raised must be heard before the "connection closed" errors its teardown causes
    # in its peers, so that the parent names the root cause (see [Note: root cause first]).
    try:
        result_conn.send_bytes(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        result_conn.close()
    try:
        leave_group(together=report.ok)
    except Exception:
        traceback.print_exc()  # into the rank's log; the result has already been sent


def _prepare_process(spec: RankSpec, alive_conn: Connection) -> None:
    redirect(spec)
    watch_parent(alive_conn)


def redirect(spec: RankSpec) -> None:
    # [Note: rank environment] The rank gets the parent's environment as of the spawn call
    # (a forkserver child would otherwise see the environment of the forkserver's start),
    # plus the caller's overrides, one intra-op thread unless asked otherwise, and its output
    # redirected to a log file the parent replays (pytest's capture then shows it per test).
    # A warm rank does this for every job ([Note: warm worlds] in _pool.py).
    global _STACK_FILE
    os.environ.clear()
    os.environ.update(spec.environ)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    if _STACK_FILE is not None:
        _STACK_FILE.close()
    _STACK_FILE = open(spec.stack_path, "w")  # noqa: SIM115 - lives until the next job
    faulthandler.enable(file=_STACK_FILE, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True)
    torch.set_num_threads(spec.num_threads)


def watch_parent(alive_conn: Connection) -> None:
    watcher = threading.Thread(
        target=_exit_when_parent_dies, args=(alive_conn,), name="shardopt-parent-watch", daemon=True
    )
    watcher.start()


def _exit_when_parent_dies(alive_conn: Connection) -> None:
    # [Note: orphaned ranks] The parent holds the write end of `alive_conn` and closes it only
    # after this process has ended, so end-of-file here means the parent died (a killed
    # pytest worker, say). The rank then exits at once instead of running on, or blocking in a
    # collective until the process-group timeout.
    try:
        while True:
            alive_conn.recv_bytes()
    except (EOFError, OSError):
        os._exit(_ORPHANED_EXIT_CODE)


def run_job(spec: RankSpec, join: Callable[[RankSpec], World] | None = None) -> RankReport:
    try:
        fn, args = loads_with_sources(spec.payload, spec.sources)
        (join or join_group)(spec)
        value = fn(spec.rank, spec.world_size, *args)
        return RankReport(ok=True, result=_dumps_result(value, spec.rank))
    except BaseException as exc:
        return _report_raised(exc)


def _dumps_result(value: Any, rank: int) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"spawn: rank {rank} returned a value that cannot be pickled "
            f"({type(value).__name__}): {exc}"
        ) from exc


def join_group(spec: RankSpec) -> World:
    timeout = datetime.timedelta(seconds=spec.timeout + _GROUP_TIMEOUT_MARGIN_S)
    store: dist.Store
    if spec.store_type is StoreType.FILE:
        store = dist.FileStore(spec.store_path, spec.world_size)
    else:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, False, timeout=timeout)
    device = torch.device("cpu")
    extra: dict[str, Any] = {}
    if spec.backend is Backend.NCCL:
        device = torch.device("cuda", spec.devices[spec.rank] if spec.devices else spec.rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(
        spec.backend.value,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
        **extra,
    )
    # [Note: barrier after init] gloo's init returns on a rank once its side of the connections
    # is up. A rank with little to do could then finish, destroy the group and exit while a
    # slower peer is still connecting: the peer fails with "Connection closed by peer". One
    # barrier makes every rank wait until all are connected.
    dist.barrier()
    group = dist.group.WORLD
    assert group is not None
    world = World(spec.rank, spec.world_size, spec.backend, device, group)
    set_current_world(world)
    return world


def leave_group(*, together: bool) -> None:
    # [Note: leave together] torch 2.4's gloo can hang in a rank's group destructor when a peer
    # destroyed its own group first (seen in about half of 3-rank worlds). A rank that succeeded
    # waits in a barrier for its peers before it destroys the group; if a peer failed, the parent
    # stops it there (see ``stop``). A rank that raised leaves at once: its peers may never come.
    set_current_world(None)
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def _report_raised(exc: BaseException) -> RankReport:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # drop this module's frames: the traceback starts in the user's code
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(pickled)  # an exception that pickles but cannot be rebuilt is dropped
    except Exception:
        pickled = b""
    cls = type(exc)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    return RankReport(
        ok=False,
        exception_type=name,
        message=str(exc),
        traceback=text,
        exception=pickled,
        raised_at=time.monotonic(),
    )
