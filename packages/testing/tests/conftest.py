"""Fixtures of the shardopt.testing tests: pytester (the leak checks are the plugin's)."""

from __future__ import annotations

pytest_plugins = ["pytester"]
