"""shardopt's developer tools, apart from the library (``shardopt-devtools``): the internals of
``shardopt bench`` (``bench``) and of ``shardopt gpu-check`` (``gpu_check``). The ``shardopt``
command of ``shardopt-functional`` adds their subcommands when this distribution is installed;
nothing heavy is imported until one runs."""

from __future__ import annotations

from typing import Any

__all__ = ["add_dev_parsers"]


def add_dev_parsers(commands: Any) -> None:
    """Adds ``bench`` and ``gpu-check`` to ``commands`` (an argparse subparsers object)."""
    from shardopt.devtools.bench import add_bench_parser
    from shardopt.devtools.gpu_check import add_gpu_check_parser

    add_bench_parser(commands)
    add_gpu_check_parser(commands)
