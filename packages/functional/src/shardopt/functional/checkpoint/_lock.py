"""One save at a time at a checkpoint path, from any job: a lock file beside it."""

from __future__ import annotations

import datetime
import json
import os
import socket

try:
    import fcntl
except ImportError:  # (not POSIX: no saves at all, with a clear error)
    fcntl = None  # type: ignore[assignment]

__all__ = ["SaveLock", "lock_path"]

# [Note: checkpoint lock]
# Two jobs (independent process groups) may save to one ``path``; each save's publish removes
# the versions beside ``path`` that it supersedes ([Note: atomic checkpoints]). So rank 0 of a
# save holds ``<path>.lock`` from before it looks at ``path`` until its cleanup is done: an
# exclusive ``flock`` on that file, taken without waiting. A save that finds it held fails at
# once, on every rank of its job, naming the holder (pid, host and time, which the holder wrote
# into the file): it deletes nothing and writes nothing. The kernel drops a lock when its
# holder's process dies, so a crashed save's lock is stale by construction: the file is still
# there, unlocked, and the next save takes it over (on NFS, ``flock`` locks through the lock
# manager). The holder removes the file when done; since a waiter may still hold the removed
# file open, a save that took the lock checks that the file it locked is still the one at the
# name (else it tries again). A file at ``<path>.lock`` that is not shardopt's (non-empty, not
# its record, or not a regular file) is refused, never written or removed.

RECORD = "shardopt checkpoint lock"
_TRIES = 8


def lock_path(target: str) -> str:
    return f"{target}.lock"


def _holder(fd: int) -> str:
    """Who holds the lock, from the record its holder wrote."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(record['pid'])} on host {str(record['host'])!r} since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its record yet"


def _is_record(content: bytes) -> bool:
    try:
        return json.loads(content).get("lock") == RECORD
    except (ValueError, AttributeError, UnicodeDecodeError):
        return False


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class SaveLock:
    """``<target>.lock``, held exclusively by rank 0 of a save (see [Note: checkpoint lock]).

    Example:
        >>> import tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> first, second = SaveLock(target), SaveLock(target)
        >>> first.acquire(), f"held by pid {os.getpid()}" in second.acquire()
        (None, True)
        >>> first.release(), os.path.exists(lock_path(target)), second.acquire()
        (None, False, None)
        >>> second.release()
    """

    def __init__(self, target: str) -> None:
        self.target, self.path = target, lock_path(target)
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns None, or why not (to follow ``expected``)."""
        if fcntl is None:
            return "a POSIX system (shardopt locks the checkpoint path with flock), got none"
        try:  # (DCP's writer makes missing parents too)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as exc:
            return f"a directory for {self.target!r} that shardopt can create, got {exc}"
        for _ in range(_TRIES):
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                return f"a lock file {self.path!r} that shardopt can create, got {exc}"
            problem = self._lock(fd)
            if problem == "again":
                os.close(fd)
                continue
            if problem is not None:
                os.close(fd)
                return problem
            self._fd = fd
            return None
        return f"the lock file {self.path!r} to stay in place, got it replaced {_TRIES} times"

    def _lock(self, fd: int) -> str | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return (
                f"no other save writing to {self.target!r} at the same time, got its lock "
                f"{self.path!r} held by {_holder(fd)}; retry once that save is done"
            )
        except OSError as exc:
            return f"a filesystem with file locks at {self.path!r}, got {exc}"
        if not _same_file(fd, self.path):
            return "again"  # its holder removed it after we opened it: take the new one
        content = os.pread(fd, 4096, 0)
        if os.fstat(fd).st_size > 4096 or (content and not _is_record(content)):
            return (
                f"{self.path!r} to be absent or shardopt's lock file, got a file of "
                f"{os.fstat(fd).st_size} bytes that is not (shardopt neither writes nor "
                "deletes it: move it)"
            )
        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = {"lock": RECORD, "pid": os.getpid(), "host": socket.gethostname(), "since": since}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return None

    def release(self) -> None:
        """Removes the file and drops the lock (nothing if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        finally:
            os.close(fd)
