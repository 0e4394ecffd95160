"""Leases on CUDA devices, so that NCCL worlds started side by side (pytest-xdist workers) never
share a GPU ([Note: device leases])."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from typing import IO

try:
    import fcntl
except ImportError:  # no flock (Windows): leases are not taken, and ranks use cuda:<rank>
    fcntl = None  # type: ignore[assignment]

__all__ = ["lease_devices", "lock_directory"]

# [Note: device leases]
# Every process that starts an NCCL world takes, for the world's lifetime, an exclusive lock on
# one file per device it gives a rank (``cuda<i>.lock`` in ``lock_directory()``, shared by every
# process of the machine's user). It takes all it needs or none: it tries each device in turn,
# and where fewer are free than the world has ranks it lets go of those it holds and waits a
# moment before trying again, so that two worlds each holding part of what they need never wait
# on each other. The locks are ``flock``s: the kernel drops them when their holder's file is
# closed, by the lease's end or by the holder's death, so a killed test leaves no stale lease.
# Rank r of the world then runs on the r-th leased device, not on ``cuda:r``.
_RETRY_S = 0.05


def lock_directory() -> str:
    """Where the device locks live: ``SHARDOPT_DEVICE_LOCKS``, else one folder per user in the
    temp dir."""
    where = os.environ.get("SHARDOPT_DEVICE_LOCKS") or os.path.join(
        tempfile.gettempdir(), f"shardopt-device-locks-{getattr(os, 'getuid', lambda: 0)()}"
    )
    os.makedirs(where, exist_ok=True)
    return where


@contextlib.contextmanager
def lease_devices(
    count: int, *, devices: int, timeout: float, directory: str | None = None
) -> Iterator[list[int]]:
    """Holds ``count`` of the devices ``0 .. devices - 1`` that no other lease holds, for the
    block; yields their indices in increasing order.

    Raises:
        ValueError: more devices asked for than there are.
        TimeoutError: fewer than ``count`` were free for ``timeout`` seconds; names the holders.
    """
    if count > devices:
        raise ValueError(f"lease_devices: expected count <= {devices} devices, got {count}")
    if fcntl is None:
        yield list(range(count))
        return
    where = directory or lock_directory()
    deadline = time.monotonic() + timeout
    while True:
        held = _try_all(where, count, devices)
        if held is not None:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"lease_devices: {count} of {devices} CUDA devices were not free for {timeout} s; "
                f"held by {_holders(where, devices)}"
            )
        time.sleep(_RETRY_S)
    try:
        yield sorted(held)
    finally:
        for file in held.values():
            file.close()  # (closing drops the lock)


def _try_all(where: str, count: int, devices: int) -> dict[int, IO[str]] | None:
    """Locks ``count`` free devices, or none (then None)."""
    held: dict[int, IO[str]] = {}
    for index in range(devices):
        file = open(os.path.join(where, f"cuda{index}.lock"), "a+")  # noqa: SIM115
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.close()
            continue
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        held[index] = file
        if len(held) == count:
            return held
    for kept in held.values():
        kept.close()
    return None


def _holders(where: str, devices: int) -> dict[int, str]:
    """Each device's holder as its lock file says (a process id), where one is written."""
    found = {}
    for index in range(devices):
        with contextlib.suppress(OSError), open(os.path.join(where, f"cuda{index}.lock")) as file:
            found[index] = f"pid {file.read().strip() or '?'}"
    return found
