"""Fixtures of the functional tests."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardopt.testing import spawn

# Plain helpers that several test modules share live in _functional_helpers.py, importable
# because this folder is put on sys.path: see [Note: shared test helpers] in the core tests'
# conftest.py.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def run_world() -> Callable[..., list[Any]]:
    """``run_world(fn, world_size, *args, timeout=...)``: ``fn(rank, world_size, *args)`` on every
    rank of a fresh gloo world (shardopt.testing.spawn); the results in rank order."""
    return functools.partial(spawn, backend="gloo", timeout=120.0)
