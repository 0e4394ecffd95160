"""The ``shardopt`` command: ``plan`` (needs only this distribution), ``demo`` (the ``[demo]``
extra: matplotlib, tqdm and the shardopt.testing harness), and ``bench`` and ``gpu-check`` from
the developer tools (``shardopt-devtools``, [Note: developer tools] in _cli.py). The public
modules ``measure``, ``models``, ``launch`` and ``torch_optim`` are what the demo and those
tools share."""

from shardopt.cli._cli import build_parser, main, version_line
from shardopt.cli._demo_cli import main as demo_main

__all__ = ["build_parser", "demo_main", "main", "version_line"]
