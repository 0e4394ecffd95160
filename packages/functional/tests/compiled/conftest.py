"""The tests that really compile (shard(..., compile=True)): slow on a small CPU.

[Note: compiled tests]
Compiling an update takes seconds to tens of seconds per sharded state on 2 cores, so this folder's
test files are collected only with SHARDOPT_COMPILED=1 (the ``compiled`` CI session); elsewhere
they are not collected at all (no skips reported). Each test reuses one compiled update across
its cases. The fast tests of the option (validation, fallback, ``"auto"``) are in
../test_compiled.py.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("SHARDOPT_COMPILED") == "1" else ["test_*.py", "_*.py"]
