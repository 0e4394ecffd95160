"""Leak checks for tests that start worlds: processes, file descriptors and temp dirs left behind.

The ``no_leaks`` fixture (registered by the pytest plugin) snapshots what exists, lets the test
run its worlds with their temp dirs under ``no_leaks.tmp``, then fails the test if anything new
is still there.
"""

from __future__ import annotations

import operator
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardopt.testing._pool import reusing_worlds
from shardopt.testing._spawn import spawn

__all__ = ["LeakCheck", "descendants", "no_leaks", "open_fds", "started_worlds"]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, grandchildren, ...), zombies included."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    stat = file.read()
            except OSError:
                continue  # ended while we looked
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def open_fds() -> set[str]:
    """This process's open file descriptors and what they point to (files, sockets, pipes)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # the fd listdir itself used
    return found


@dataclass
class LeakCheck:
    """What existed before a test's worlds ran; ``tmp`` holds the worlds' temp dirs."""

    processes: set[int]
    fds: set[str]
    tmp: Path

    def assert_clean(self) -> None:
        left = descendants(os.getpid()) - self.processes
        assert not left, f"processes left behind: {sorted(left)}"
        leaked = open_fds() - self.fds
        assert not leaked, f"file descriptors left open: {sorted(leaked)}"
        assert list(self.tmp.iterdir()) == [], f"temp files left: {list(self.tmp.iterdir())}"

    @staticmethod
    def pid_alive(pid: int) -> bool:
        """True while ``pid`` exists and is not a zombie."""
        try:
            with open(f"/proc/{pid}/stat") as file:
                return file.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False


@pytest.fixture(scope="session")
def started_worlds() -> None:
    """Runs one world of each store kind, so that the forkserver, the resource tracker and
    torch's lazily opened handles exist: they live as long as the test process, by design."""
    spawn(operator.add, 1)
    spawn(operator.add, 1, init_store="tcp")


@pytest.fixture
def no_leaks(
    started_worlds: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LeakCheck]:
    """Fails the test if its worlds leave processes, open files, sockets or temp dirs behind.

    Worlds make their temp dirs under ``no_leaks.tmp``.
    """
    tmp = tmp_path / "worlds"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    check = LeakCheck(descendants(os.getpid()), open_fds(), tmp)
    with reusing_worlds(False):  # fresh processes, which it counts ([Note: warm worlds])
        yield check
    check.assert_clean()
