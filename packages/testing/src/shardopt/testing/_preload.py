"""Modules the forkserver imports once, so that every rank starts with them loaded."""

from __future__ import annotations

import contextlib
import importlib
import warnings

# See [Note: forkserver]. A failed import only costs the ranks time, so nothing here may raise:
# the forkserver would die with it and take every later world down.
_MODULES = ("torch", "torch.distributed", "torch._dynamo", "shardopt.testing._equivalence")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in _MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(_name)
    with contextlib.suppress(Exception):
        from shardopt.testing._candidates import zero_redundancy_optimizer_class

        zero_redundancy_optimizer_class()
