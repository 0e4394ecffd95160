"""spawn: run a function on every rank of a fresh world of processes and collect the results."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from shardopt.testing._errors import RankFailure, format_world_error
from shardopt.testing._leases import lease_devices
from shardopt.testing._modules import ModuleSource, dumps_with_sources
from shardopt.testing._pool import pooling, run_pooled
from shardopt.testing._processes import (
    Collected,
    RankProcess,
    collect,
    read_text,
    replay_output,
    start,
    stop,
)
from shardopt.testing._rank import RankSpec, StoreType
from shardopt.testing._world import Backend, cuda_device_count, resolve_backend

__all__ = ["spawn"]

_RANK_MODULE = os.path.join("shardopt", "testing", "_rank.py")
_LEASE_WAIT_S = 600.0  # how long an NCCL world waits for free devices ([Note: device leases])


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | Backend = "auto",
    timeout: float = 120.0,
    init_store: str = "file",
    env: Mapping[str, str] | None = None,
    num_threads: int = 1,
    fresh: bool = False,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on every rank of a new world; returns the results.

    Each rank is a fresh process (forkserver, see [Note: forkserver]) with the default process
    group initialised (``current_world()`` gives its rank, device and group). The group is
    destroyed and every process reaped whatever happens; the rendezvous files and ports are
    released. What the ranks print is replayed on this process's stdout, prefixed by rank.

    ``fn`` and ``args`` are pickled: ``fn`` must be a module-level function or a
    ``functools.partial`` of one (functions from test files work, see
    [Note: loading test modules in ranks]), and the return values must be picklable too
    (return CPU tensors). A ``__main__`` script must guard its entry point with
    ``if __name__ == "__main__":``. Ranks are daemon processes: they cannot spawn worlds.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in each rank.
        world_size: number of ranks, >= 1.
        *args: extra arguments, the same for every rank.
        backend: ``"gloo"``, ``"nccl"`` (one CUDA device a rank) or ``"auto"`` (NCCL when
            there is one CUDA device a rank, else gloo).
        timeout: seconds the ranks get, from when they are all started. The process group's
            collective timeout is a little longer (see [Note: process-group timeout]).
        init_store: ``"file"`` (a FileStore in a fresh temp dir) or ``"tcp"`` (a TCPStore on
            127.0.0.1 at a port the system picks); both are safe side by side.
        env: environment overrides for the ranks (on top of this process's environment).
        num_threads: torch intra-op threads in each rank (``OMP_NUM_THREADS`` too).
        fresh: new processes even where warm worlds are on (inside ``reusing_worlds()``, which
            the pytest plugin turns on: see [Note: warm worlds]). Gloo worlds without ``env``
            otherwise run on this process's warm ranks of their size: a fresh process group
            each call, a failed call stops them.

    Returns:
        The return values of ``fn``, in rank order.

    Raises:
        RankError: a rank raised; names it and carries its traceback. The others are stopped.
        RankExitError: a rank's process ended before returning (os._exit, a signal, a crash).
        WorldTimeoutError: ranks still running after ``timeout`` s; names them, with stacks.
        TypeError: ``fn`` or ``args`` cannot be pickled.
        ValueError: a bad argument, or NCCL without one CUDA device a rank.

    Example:
        >>> import operator
        >>> spawn(operator.add, 2)  # rank + world_size on each rank
        [2, 3]
    """
    _check_arguments(fn, world_size, timeout, num_threads, env)
    chosen = resolve_backend(backend, world_size)
    store_type = _store_type(init_store)
    try:
        payload, sources = dumps_with_sources((fn, args))
    except Exception as exc:
        raise TypeError(
            "spawn: fn and args must be picklable (a module-level function or a "
            f"functools.partial of one, and picklable arguments); pickling {fn!r} failed: {exc}"
        ) from exc
    environ = {**os.environ, "OMP_NUM_THREADS": str(num_threads), **(env or {})}
    with _Rendezvous(store_type, timeout) as rendezvous, _leases(chosen, world_size) as devices:
        specs = [
            rendezvous.spec(rank, world_size, chosen, num_threads, environ, payload, sources)
            for rank in range(world_size)
        ]
        specs = [replace(spec, devices=devices) for spec in specs]
        pooled = (  # [Note: warm worlds]
            not fresh and pooling() and env is None and chosen is Backend.GLOO
        ) and store_type is StoreType.FILE
        return _run_world(specs, timeout, pooled)


@contextlib.contextmanager
def _leases(backend: Backend, world_size: int) -> Iterator[tuple[int, ...]]:
    """An NCCL world's devices, leased for its lifetime ([Note: device leases]); () for gloo."""
    if backend is not Backend.NCCL:
        yield ()
        return
    with lease_devices(world_size, devices=cuda_device_count(), timeout=_LEASE_WAIT_S) as held:
        yield tuple(held)


def _check_arguments(
    fn: object, world_size: int, timeout: float, num_threads: int, env: object
) -> None:
    if not callable(fn):
        raise TypeError(f"spawn: expected fn to be callable, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: expected an int world_size >= 1, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"spawn: expected a finite timeout > 0 seconds, got {timeout!r}")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"spawn: expected an int num_threads >= 1, got {num_threads!r}")
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str)
        for k, v in dict(env).items()  # type: ignore[call-overload]
    ):
        raise TypeError(f"spawn: expected env to map str to str, got {env!r}")


def _store_type(init_store: str) -> StoreType:
    try:
        return StoreType(init_store)
    except ValueError:
        raise ValueError(
            f"spawn: expected init_store in ('file', 'tcp'), got {init_store!r}"
        ) from None


class _Rendezvous:
    """The world's temp dir (store file, logs, stacks) and, for TCP, the parent's TCPStore."""

    def __init__(self, kind: StoreType, timeout: float) -> None:
        self.store_type = kind
        self.timeout = timeout
        self.directory = ""
        self.port = 0
        self._store: dist.TCPStore | None = None

    def __enter__(self) -> _Rendezvous:
        self.directory = tempfile.mkdtemp(prefix="shardopt-world-")
        if self.store_type is StoreType.TCP:
            # Port 0: the system picks a free port, so worlds side by side never collide.
            self._store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
            self.port = self._store.port
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._store = None  # closes the listening socket
        shutil.rmtree(self.directory, ignore_errors=True)

    def spec(
        self,
        rank: int,
        world_size: int,
        backend: Backend,
        num_threads: int,
        environ: dict[str, str],
        payload: bytes,
        sources: tuple[ModuleSource, ...],
    ) -> RankSpec:
        return RankSpec(
            rank=rank,
            world_size=world_size,
            backend=backend,
            store_type=self.store_type,
            store_path=os.path.join(self.directory, "store"),
            store_port=self.port,
            timeout=self.timeout,
            num_threads=num_threads,
            environ=environ,
            payload=payload,
            sources=sources,
            log_path=os.path.join(self.directory, f"rank{rank}.log"),
            stack_path=os.path.join(self.directory, f"rank{rank}.stack"),
        )


def _run_world(specs: list[RankSpec], timeout: float, pooled: bool) -> list[Any]:
    ranks: list[RankProcess] = []
    collected = Collected()
    ran = run_pooled(specs, timeout) if pooled else None
    if ran is not None:
        ranks, collected = ran
    else:
        try:
            for spec in specs:
                ranks.append(start(spec))  # returns once the rank's process exists
            # The clock starts with the ranks: a forkserver's first start (seconds, importing
            # torch) does not eat into the time the ranks get.
            collected = collect(ranks, time.monotonic() + timeout)
        finally:
            stop(ranks, finished=set(collected.results))
    replay_output(ranks)
    if collected.events:
        raise _world_error(ranks, collected, timeout)
    return [pickle.loads(collected.results[spec.rank]) for spec in specs]


def _world_error(ranks: list[RankProcess], collected: Collected, timeout: float) -> Exception:
    by_rank = {r.spec.rank: r for r in ranks}
    failures = []
    for rank, outcome, report in collected.events:
        r = by_rank[rank]
        failures.append(
            RankFailure(
                rank=rank,
                outcome=outcome,
                pid=r.pid,
                exitcode=r.exitcode,
                exception_type=report.exception_type if report else "",
                message=report.message if report else _exit_note(r),
                traceback=report.traceback
                if report
                else _clean_stacks(read_text(r.spec.stack_path)),
                output=read_text(r.spec.log_path),
            )
        )
    first = collected.events[0][2]
    exception = _loads_or_none(first.exception) if first is not None else None
    stopped = [rank for rank in collected.pending if rank not in {e[0] for e in collected.events}]
    world_size = len(ranks)
    return format_world_error("spawn", world_size, failures, stopped, timeout, exception)


def _exit_note(r: RankProcess) -> str:
    if os.path.exists(r.spec.log_path):
        return ""
    return (
        "it ended while starting, before fn ran; its error is on this process's stderr. "
        "A script that calls spawn must guard its entry point with "
        "`if __name__ == '__main__':`"
    )


def _clean_stacks(text: str) -> str:
    """faulthandler's dump without the parent-watch thread and the harness's own frames."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "_exit_when_parent_dies" in block:
            continue
        lines = block.splitlines()
        harness = [i for i, line in enumerate(lines) if _RANK_MODULE in line]
        blocks.append("\n".join(lines[: harness[0]] if harness else lines))
    return "\n\n".join(blocks)


def _loads_or_none(data: bytes) -> BaseException | None:
    try:
        value = pickle.loads(data) if data else None
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None
