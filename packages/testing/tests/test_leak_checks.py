"""The no_leaks check used by the world tests sees each kind of leak it claims to see."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest


def test_a_process_left_running_is_caught(no_leaks: Any) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match="processes left behind"):
            no_leaks.assert_clean()
    finally:
        child.kill()
        child.wait()


def test_a_listening_socket_left_open_is_caught(no_leaks: Any) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with pytest.raises(AssertionError, match="file descriptors left open"):
            no_leaks.assert_clean()


def test_a_world_temp_dir_left_behind_is_caught(no_leaks: Any) -> None:
    directory = tempfile.mkdtemp(prefix="shardopt-world-")
    try:
        with pytest.raises(AssertionError, match="temp files left"):
            no_leaks.assert_clean()
    finally:
        os.rmdir(directory)


def test_a_zombie_is_not_alive(no_leaks: Any) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
    try:
        assert not no_leaks.pid_alive(child.pid)
        with pytest.raises(AssertionError, match="processes left behind"):
            no_leaks.assert_clean()
    finally:
        child.wait()
