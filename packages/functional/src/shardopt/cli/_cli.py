"""The ``shardopt`` command line: ``plan``, ``demo``, and, from the developer tools, ``bench``
and ``gpu-check``.

[Note: developer tools]
Installing the library ships the library: ``shardopt-functional`` holds ``shard``, the
drop-ins and the command's ``plan`` and ``demo`` (the quick start). The bench's internals and
the GPU check are developer tools, in ``shardopt-devtools`` (packages/devtools), which the
command calls when it is installed (every venv of this repository has it). They build on this
package's public CLI modules (``shardopt.cli.measure``, ``models``, ``launch``,
``torch_optim``), which the demo uses too; nothing here imports them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

__all__ = ["build_parser", "main", "version_line"]

_DEMO_EXTRA = ("matplotlib", "tqdm", "shardopt.testing")
_EXTRA = {"demo": _DEMO_EXTRA, "bench": _DEMO_EXTRA}
_DEV_COMMANDS = ("bench", "gpu-check")  # [Note: developer tools]


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
    from shardopt.cli._demo_cli import add_demo_parser
    from shardopt.cli._plan_cli import add_plan_parser

    parser = argparse.ArgumentParser(
        prog="shardopt", description="shardopt: sharded optimizers for torch.distributed."
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(commands)
    add_plan_parser(commands)
    _add_dev_parsers(commands)
    return parser


def _add_dev_parsers(commands: Any) -> None:
    """``bench`` and ``gpu-check``, from the developer tools (``shardopt-devtools``) where they
    are installed; else each says, when run, what to install."""
    if importlib.util.find_spec("shardopt.devtools") is not None:
        from shardopt.devtools import add_dev_parsers

        add_dev_parsers(commands)
        return
    for name in _DEV_COMMANDS:
        # any arguments at all, options included (no prefix character marks an option here)
        p = commands.add_parser(
            name, help=f"{name} (needs shardopt-devtools)", add_help=False, prefix_chars="\0"
        )
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(run=_needs_devtools)


def _needs_devtools(args: argparse.Namespace) -> int:
    print(
        f"shardopt {args.command}: error: needs the developer tools, shardopt-devtools: "
        "pip install -e packages/devtools (from a clone of the repository)",
        file=sys.stderr,
    )
    return 2


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
