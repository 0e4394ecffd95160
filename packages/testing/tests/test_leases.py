"""Device leases ([Note: device leases]): NCCL worlds side by side hold disjoint CUDA devices,
wait while too few are free, and a dead holder's lease is free again. Simulated device counts:
the leases are files, whatever the machine has."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardopt.testing import _leases
from shardopt.testing._leases import lease_devices

# The holder loads the lease module alone (it needs only the standard library), not the package,
# which imports torch: a second per process saved.
HOLDER = """
import importlib.util, time
spec = importlib.util.spec_from_file_location("leases", {module!r})
leases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(leases)
with leases.lease_devices({count}, devices={devices}, timeout=10, directory={where!r}) as held:
    print(held, flush=True)
    time.sleep({hold})
"""


def _holder(tmp_path: Path, count: int, devices: int, hold: float) -> subprocess.Popen[str]:
    """A process that leases ``count`` devices for ``hold`` s; returns once it holds them."""
    script = HOLDER.format(
        module=_leases.__file__, count=count, devices=devices, where=str(tmp_path), hold=hold
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip()  # the lease is held
    return child


def _end(child: subprocess.Popen[str], *, kill: bool = False) -> None:
    if kill:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()


def test_worlds_side_by_side_hold_disjoint_devices_and_wait_for_free_ones(tmp_path: Path):
    """Six worlds of 2 ranks on 4 simulated devices, each holding its lease 0.1 s: no two leases
    held at once share a device, at most two are held at once, and every world gets one."""
    spans: list[tuple[float, float, list[int]]] = []
    lock = threading.Lock()

    def world() -> None:
        with lease_devices(2, devices=4, timeout=30, directory=str(tmp_path)) as held:
            start = time.monotonic()
            time.sleep(0.1)
            with lock:
                spans.append((start, time.monotonic(), held))

    threads = [threading.Thread(target=world) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == 6
    for i, (a0, a1, a) in enumerate(spans):
        for b0, b1, b in spans[i + 1 :]:
            if a0 < b1 and b0 < a1:  # held at the same time
                assert not set(a) & set(b), (a, b)
    starts = sorted(s for s, _, _ in spans)
    assert starts[-1] - starts[0] >= 0.2  # 6 leases of 2 on 4 devices: at least 3 rounds


def test_a_lease_waits_for_another_process_to_free_its_devices(tmp_path: Path):
    child = _holder(tmp_path, 3, 4, hold=1.0)
    start = time.monotonic()
    with lease_devices(2, devices=4, timeout=30, directory=str(tmp_path)) as held:
        waited = time.monotonic() - start
    _end(child)
    assert waited >= 0.5
    assert len(held) == 2


def test_a_killed_holders_devices_are_free_at_once(tmp_path: Path):
    child = _holder(tmp_path, 2, 2, hold=60.0)
    _end(child, kill=True)
    start = time.monotonic()
    with lease_devices(2, devices=2, timeout=30, directory=str(tmp_path)) as held:
        assert held == [0, 1]
    assert time.monotonic() - start < 1.0


def test_a_lease_never_free_times_out_naming_the_holders(tmp_path: Path):
    child = _holder(tmp_path, 2, 2, hold=60.0)
    try:
        with (
            pytest.raises(TimeoutError, match=f"held by .*pid {child.pid}"),
            lease_devices(1, devices=2, timeout=0.3, directory=str(tmp_path)),
        ):
            pass
    finally:
        _end(child, kill=True)


def test_more_devices_than_there_are_is_refused(tmp_path: Path):
    with (
        pytest.raises(ValueError, match="expected count <= 2 devices, got 3"),
        lease_devices(3, devices=2, timeout=1, directory=str(tmp_path)),
    ):
        pass


def test_an_nccl_spawn_leases_its_devices_and_a_gloo_one_none(tmp_path, monkeypatch):
    """What spawn gives an NCCL world's ranks (4 simulated devices, 2 of them held elsewhere),
    and that a gloo world leases nothing."""
    from shardopt.testing import _spawn
    from shardopt.testing._world import Backend

    monkeypatch.setattr(_spawn, "cuda_device_count", lambda: 4)
    monkeypatch.setenv("SHARDOPT_DEVICE_LOCKS", str(tmp_path))
    child = _holder(tmp_path, 2, 4, hold=60.0)  # devices 0 and 1
    try:
        with _spawn._leases(Backend.NCCL, 2) as devices:
            assert devices == (2, 3)
        with _spawn._leases(Backend.GLOO, 2) as devices:
            assert devices == ()
    finally:
        _end(child, kill=True)
