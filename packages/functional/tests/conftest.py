"""Fixtures of the functional tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from shardopt.testing import spawn


@pytest.fixture
def run_world() -> Callable[..., list[Any]]:
    """``run_world(fn, world_size, *args, timeout=...)``: ``fn(rank, world_size, *args)`` on every
    rank of a fresh gloo world (shardopt.testing.spawn); the results in rank order."""
    return functools.partial(spawn, backend="gloo", timeout=120.0)
