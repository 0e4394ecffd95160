"""The ``shardopt`` command: ``plan`` (needs only this distribution), ``demo`` and ``bench``
(the ``[demo]`` extra: matplotlib, tqdm and the shardopt.testing harness)."""

from shardopt.cli._cli import build_parser, main, version_line
from shardopt.cli._demo_cli import main as demo_main

__all__ = ["build_parser", "demo_main", "main", "version_line"]
