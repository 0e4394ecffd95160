"""``python -m shardopt.demo`` (or under torchrun): the shardopt demo, as ``shardopt demo``."""

from __future__ import annotations

import sys

from shardopt.cli import demo_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
