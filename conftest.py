"""The workspace's conftest: a watchdog on every test (see [Note: hang watchdog])."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator

import pytest

# [Note: hang watchdog]
# pytest-timeout (--timeout=600 in the nox sessions) stops a test by a signal, which Python
# handles only when the main thread next runs bytecode. A test stuck in C++ that holds the GIL
# (torch 2.4's gloo destructor joining a thread that waits for the GIL, see [Note: torch range]
# in noxfile.py) never gets there, and the whole run waits for CI's limit with nothing printed.
# faulthandler's watchdog is a C thread that needs no GIL: a minute past pytest-timeout's limit
# (or past SHARDOPT_TEST_WATCHDOG_S seconds) it prints every thread's Python stack and ends the
# process, so pytest-xdist reports the test as crashed, names it, starts a new worker and the run
# goes on.
GRACE_S = 60.0


def _watchdog_s(config: pytest.Config) -> float:
    if "SHARDOPT_TEST_WATCHDOG_S" in os.environ:
        return float(os.environ["SHARDOPT_TEST_WATCHDOG_S"])
    timeout = config.getoption("timeout", default=None)  # pytest-timeout's, where installed
    return float(timeout or 600) + GRACE_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    faulthandler.dump_traceback_later(_watchdog_s(item.config), exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
