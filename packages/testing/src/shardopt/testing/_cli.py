"""The shardopt command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardopt`` command."""
    print("shardopt: no commands yet", file=sys.stderr)
    return 2
