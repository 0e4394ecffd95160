"""The ``shardopt`` command line: ``plan``, ``demo``, ``bench`` and ``gpu-check``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

__all__ = ["build_parser", "main", "version_line"]

_DEMO_EXTRA = ("matplotlib", "tqdm", "shardopt.testing")
_EXTRA = {"demo": _DEMO_EXTRA, "bench": _DEMO_EXTRA}


def version_line() -> str:
    """``shardopt <version> (torch <version>)``, from the installed distributions' metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("shardopt-core")
    except PackageNotFoundError:
        ours = "unknown"
    try:
        theirs = version("torch")
    except PackageNotFoundError:
        theirs = "unknown"
    return f"shardopt {ours} (torch {theirs})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (their heavy imports wait until they run)."""
    from shardopt.cli._bench_cli import add_bench_parser
    from shardopt.cli._demo_cli import add_demo_parser
    from shardopt.cli._plan_cli import add_plan_parser
    from shardopt.cli.gpu_check import add_gpu_check_parser

    parser = argparse.ArgumentParser(
        prog="shardopt", description="shardopt: sharded optimizers for torch.distributed."
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(commands)
    add_bench_parser(commands)
    add_plan_parser(commands)
    add_gpu_check_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardopt`` command; returns the exit status.

    Bad input (a ValueError) is reported on one line, with status 2; a failed or timed out
    rank with its traceback, status 1.

    Example:
        >>> main(["plan", "mlp-12x1024", "-w", "0"])
        2
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = [m for m in _EXTRA.get(args.command, ()) if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"shardopt {args.command}: error: needs {' and '.join(missing)}, the [demo] extra: "
            "pip install 'shardopt-functional[demo]'",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.run(args))
    except ValueError as exc:
        print(f"shardopt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"shardopt {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`shardopt plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
