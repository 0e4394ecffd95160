"""Loading a test module by path, for the scripts that run its cases outside pytest."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def load_test_module(path: str, name: str) -> ModuleType:
    """The module at ``path``, imported as ``name`` (registered, so that spawned ranks find it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
